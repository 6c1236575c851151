"""``python -m megatron_peakflat.demo``: the main job on its built-in defaults (``make demo``). Its code lives in
``cli/demo.py``; this module keeps the short spelling."""

import sys

from .cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
