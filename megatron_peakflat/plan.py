"""``python -m megatron_peakflat.plan``: the peak planner's command line (entry planner/plan.py, the command
line in planner/cli.py)."""

from __future__ import annotations

import sys

from .planner.plan import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
