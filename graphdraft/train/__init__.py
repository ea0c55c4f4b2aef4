"""Training of graphdraft's shipped byte-level model pair (`graphdraft/assets/`).

`python -m graphdraft.train --help`; see `graphdraft/assets/MODEL_CARD.md` for the run that
produced the shipped checkpoints. Modules: `data` (the stdlib corpus and its held-out split),
`forward` (dense training forwards over the runtime modules' parameters, EAGLE-3
training-time test), `train` (the two training loops, on the CPU or a CUDA GPU), `evaluate`
(held-out target loss and the head's mean accept length through the runtime's `Engine`).
"""
