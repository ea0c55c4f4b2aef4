"""Checkpoints (safetensors, HF layout), GGUF conversion, tokenizers and chat templates."""
