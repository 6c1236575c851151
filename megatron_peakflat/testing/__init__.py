"""Helpers shared by the tests: a gloo process launcher, a live-bytes meter and (in ``megatron_cpu``)
a shim that lets Megatron-Core run on CPU, and the relative error every exactness test measures. Test and dry-run use only; never on the training path."""

from .compare import loss_and_grad_errors, max_rel_error
from .distributed import DistributedTestError, run_distributed
from .live_bytes import LiveBytesMeter

__all__ = ["run_distributed", "DistributedTestError", "LiveBytesMeter", "max_rel_error", "loss_and_grad_errors"]
