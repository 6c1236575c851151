"""User-facing SCO: build an offloader from the flags' values, and checkpoint a chain of chunks with it.

``build_offloader`` resolves the budget (default: a safe share of free host RAM per local rank) and
picks pinned memory when the device is a GPU. ``checkpoint_chunks`` is the plain-PyTorch use:
full recompute over a sequence of chunks, each boundary offloaded; Megatron's integration
(``integration/sco.py``) does the same around ``tensor_parallel.checkpoint``.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ..config_base import format_bytes
from .offload import BoundaryOffloader
from .pool import make_pool, resolve_budget

__all__ = ["build_offloader", "checkpoint_chunks"]

log = logging.getLogger("megatron_peakflat")


def build_offloader(budget: int | None = None, prefetch: int = 1, device: torch.device | str | None = None,
                    *, pool: str = "torch", log_summary: bool = True) -> BoundaryOffloader:
    """An offloader over a new pool of ``budget`` bytes (resolved by ``resolve_budget``).

    The pool is pinned when ``device`` is a CUDA device (so copies are asynchronous), pageable
    otherwise. With ``pool='torch'`` nothing is allocated until the first boundary is offloaded;
    ``pool='native'`` maps (and pins) the whole budget now.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if budget is not None and budget < 0:
        raise ValueError(f"budget must be >= 0 bytes, got {budget}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    nbytes = resolve_budget(budget)
    host = make_pool(nbytes, pin=device.type == "cuda", impl=pool)
    log.info("peakflat sco: %s host pool, budget %s per rank (%s), prefetch %d", type(host).__name__,
             format_bytes(nbytes), "pinned" if host.pinned else "pageable", prefetch, extra={"per_rank": True})
    return BoundaryOffloader(host, prefetch=prefetch, log_summary=log_summary)


def checkpoint_chunks(chunks: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor,
                      offloader: BoundaryOffloader | None = None) -> torch.Tensor:
    """Run ``chunks`` in order under full recompute; with ``offloader``, each boundary goes to its pool.

    Uses the reentrant ``torch.utils.checkpoint``, which saves each chunk's input with
    ``save_for_backward`` as Megatron's ``CheckpointFunction`` does. Without ``offloader`` this is
    plain full recompute, the reference the offloaded run must match bitwise.
    """
    if offloader is None:
        for fn in chunks:
            x = checkpoint(fn, x, use_reentrant=True)
        return x
    with offloader.group():
        for fn in chunks:
            with offloader.boundary(x):
                x = checkpoint(fn, x, use_reentrant=True)
    return x
