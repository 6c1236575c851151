"""Helpers shared by the tests: a gloo process launcher, a live-bytes meter and (in ``megatron_cpu``)
a shim that lets Megatron-Core run on CPU. Test and dry-run use only; never on the training path."""

from .distributed import DistributedTestError, run_distributed
from .live_bytes import LiveBytesMeter

__all__ = ["run_distributed", "DistributedTestError", "LiveBytesMeter"]
