"""The Engine's decode modes: what one step runs on the device (`base.DecodeMode`).

`base.py` (the shared state `CycleParts` and the cycle's device steps), `chain.py`
(`ChainMode`, `TargetOnlyMode`); the tree mode lives beside the tree cycle
(`graphdraft.serving.tree_cycle.TreeMode`). Nothing is imported here.
"""
