"""SCO in Megatron: offload the boundary input of each block-level full-recompute checkpoint.

``wrap_checkpointed_forward(original)`` replaces ``megatron.core.recompute.checkpointed_forward``
(and the names imported into ``transformer_block`` and ``hybrid_block``). When SCO is on, the
replacement runs the original as one offloader group (one microbatch through one model chunk)
and, for the duration of the call only, gives ``megatron.core.recompute`` a view of
``tensor_parallel`` whose ``checkpoint`` brackets each chunk with ``offloader.boundary(args[0])``.
Only the checkpoints issued by ``checkpointed_forward`` itself are affected: MoE, attention and
MTP call ``tensor_parallel.checkpoint`` through their own modules' names, which stay untouched.

Handed back to Megatron's own path, with a logged reason: fp8/fp4 (``te_checkpoint``), CUDA-graph
warm-up or capture, and ``distribute_saved_activations`` (also rejected by the config check).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Callable, Iterator

import torch

from ..sco import BoundaryOffloader, build_offloader
from . import compat, state

__all__ = ["wrap_checkpointed_forward", "offloader", "get_offloader", "reset"]

log = logging.getLogger("megatron_peakflat")

_offloader: BoundaryOffloader | None = None
_offloader_key: tuple[Any, ...] | None = None
_handed_back: set[str] = set()


def offloader() -> BoundaryOffloader | None:
    """The offloader in use (None before the first SCO call)."""
    return _offloader


def reset() -> None:
    """Forget the offloader and its pool (tests; a new budget takes effect on the next call)."""
    global _offloader, _offloader_key
    _offloader, _offloader_key = None, None
    _handed_back.clear()


def get_offloader(budget: int | None, prefetch: int, device: torch.device, pool: str = "torch") -> BoundaryOffloader:
    """The process's offloader for these settings, built on first use (its pool lives across steps)."""
    global _offloader, _offloader_key
    key = (budget, prefetch, device.type, pool)
    if _offloader is None or _offloader_key != key:
        _offloader = build_offloader(budget, prefetch, device, pool=pool)
        _offloader_key = key
    return _offloader


def _unsupported(block: Any) -> str | None:
    config = block.config
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "fp8/fp4 checkpoints go through te_checkpoint"
    if getattr(config, "distribute_saved_activations", False):
        return "distribute_saved_activations splits the boundary across TP ranks"
    from megatron.core.transformer.cuda_graphs import is_graph_capturing, is_graph_warmup

    if is_graph_warmup() or is_graph_capturing() or (torch.cuda.is_available()
                                                      and torch.cuda.is_current_stream_capturing()):
        return "CUDA-graph capture records no checkpoints"
    return None


class _TensorParallelView:
    """``megatron.core.tensor_parallel`` with ``checkpoint`` bracketing its first argument as a boundary."""

    def __init__(self, real: Any, off: BoundaryOffloader) -> None:
        self._real = real
        self._off = off

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def checkpoint(self, function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
        if not args or not torch.is_tensor(args[0]):
            return self._real.checkpoint(function, distribute_saved_activations, *args)
        with self._off.boundary(args[0]):
            return self._real.checkpoint(function, distribute_saved_activations, *args)


@contextlib.contextmanager
def _block_checkpoints(module: Any, off: BoundaryOffloader) -> Iterator[None]:
    real = module.tensor_parallel
    module.tensor_parallel = _TensorParallelView(real, off)
    try:
        yield
    finally:
        module.tensor_parallel = real


def wrap_checkpointed_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """The replacement of ``checkpointed_forward``: Megatron's own, inside an SCO group when SCO is on."""
    module = sys.modules[original.__module__]
    if not hasattr(module, "tensor_parallel"):
        raise ImportError(f"{original.__module__}.checkpointed_forward no longer calls tensor_parallel.checkpoint "
                          f"through its module's name; SCO was checked on megatron-core {', '.join(compat.CHECKED_ON)}")

    @functools.wraps(original)
    def checkpointed_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cfg = state.get()
        if cfg is None or not cfg.sco.enabled or not torch.is_grad_enabled():
            return original(self, hidden_states, *args, **kwargs)
        reason = _unsupported(self)
        if reason is not None:
            if reason not in _handed_back:
                _handed_back.add(reason)
                log.warning("peakflat sco: handing back to Megatron's full recompute: %s", reason)
            return original(self, hidden_states, *args, **kwargs)
        off = get_offloader(cfg.sco.budget, cfg.sco.prefetch, hidden_states.device, cfg.sco.pool)
        # A pipeline stage's received input is also held by the schedule until backward: moving it
        # would cost host memory and bandwidth and free nothing.
        keep_first = not getattr(self, "pre_process", True)
        with off.group(keep_first=keep_first), _block_checkpoints(module, off):
            return original(self, hidden_states, *args, **kwargs)

    return checkpointed_forward
