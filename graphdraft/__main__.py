"""`python -m graphdraft {demo,generate} [flags]`: see `graphdraft.cli`."""

from __future__ import annotations

import sys

from graphdraft.cli import main
from graphdraft.cli.report import report_greedy_match

__all__ = ["main", "report_greedy_match"]

if __name__ == "__main__":
    sys.exit(main())
