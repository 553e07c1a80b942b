"""The model: Llama-family layers, the tokenizer and sampler, and loading checkpoints (or the built-in one)."""
