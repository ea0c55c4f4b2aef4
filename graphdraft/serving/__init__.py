"""Serving: the engine's cycle, verification, speculation policy, metrics, data parallelism, CLI."""
