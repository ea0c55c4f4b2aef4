"""`python -m graphdraft {demo,generate} [flags]`: see `graphdraft.serving.cli`."""

from __future__ import annotations

import sys

from graphdraft.serving.cli import main
from graphdraft.serving.cli.report import report_greedy_match

__all__ = ["main", "report_greedy_match"]

if __name__ == "__main__":
    sys.exit(main())
