"""``python -m megatron_peakflat.check``: what this machine gives megatron-peakflat, and whether a training command
line would start (console script ``peakflat-check``). Its code lives in ``cli/check.py``; this module keeps the
short spelling."""

import sys

from .cli.check import main

if __name__ == "__main__":
    sys.exit(main())
