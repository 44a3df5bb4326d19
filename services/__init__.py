"""The five Tandem services; each runs as its own process (`python -m services.<role>`)."""
