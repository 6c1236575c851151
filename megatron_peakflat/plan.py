"""``python -m megatron_peakflat.plan``: the peak planner's command line (console script ``peakflat-plan``).
Its code lives in ``cli/plan.py``; this module keeps the short spelling."""

import sys

from .cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
