"""The server's choice text: `graphdraft.serving.stop_strings.ChoiceText` (the one rule the CLI
shares: incremental decoding, stop strings cut exactly, held-back tails, kept tokens)."""

from __future__ import annotations

from graphdraft.serving.stop_strings import ChoiceText, Token

__all__ = ["ChoiceText", "Token"]
