"""Run by ``tests/test_logs.py`` in a process of its own (a rank forked by ``testing.forked_module``): the pretrain
entry's logging set-up, then one shared and one per-rank line on the package's logger."""

import logging

from megatron_peakflat.cli import pretrain

if __name__ == "__main__":
    pretrain._setup_logging([])
    log = logging.getLogger("megatron_peakflat")
    log.info("peakflat: shared")
    log.info("peakflat: mine", extra={"per_rank": True})
