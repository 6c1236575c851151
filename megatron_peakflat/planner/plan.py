"""The planner's entry: ``python -m megatron_peakflat.plan`` and the ``peakflat-plan`` console script run
``main`` (the command line itself is in ``cli.py``)."""

from __future__ import annotations

import sys

from .cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
