"""Flax model code: Llama-family decoder, KV cache, loaders, tokenizer."""
