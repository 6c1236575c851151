"""``python -m megatron_peakflat.plan``: the peak planner's command line (see memory/cli.py)."""

from __future__ import annotations

import sys

from .memory.cli import main

if __name__ == "__main__":
    sys.exit(main())
