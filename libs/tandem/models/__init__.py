"""Model checkpoints and the Llama-family forward.

files (locate and check a checkpoint) -> loader.load_model: config (ModelConfig from GGUF metadata
or config.json), gguf_weights / safetensors_weights (Hugging Face-named tensors), llama (the paged
forward), tokenizer + chat_template + detokenizer (text). reference holds the naive forward that
every fast path is tested against.
"""
