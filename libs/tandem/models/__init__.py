"""Model checkpoints: locating and checking them, and (with the engine) the Llama-family forward."""
