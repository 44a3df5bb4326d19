"""The relay: appends every reply's tokens to its Redis token log and finishes replies."""
