"""Models: the Llama target, the EAGLE-3 head, their layers, attention backend and logits."""
