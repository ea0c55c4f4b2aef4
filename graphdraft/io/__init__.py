"""Checkpoints (safetensors, HF layout) and the shipped byte tokenizer."""
