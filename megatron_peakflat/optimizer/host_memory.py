"""Host memory for the optimizer state: one large (pinned) region carved into flat buffers.

The region (``runtime.pinned.PinnedRegion``, shared with SCO's native boundary pool) comes from the native
``HostPool`` (one mmap, one ``cudaHostRegister``) when the extension is built, else from one torch byte tensor
registered through ``torch.cuda.cudart()``. Either way a single registration covers the whole state: torch's
caching host allocator would round a 42 GB request up to 64 GB. Pinning that fails falls back to pageable
memory with a warning.
Before anything is allocated, ``check_host_budget`` refuses a state that does not fit this rank's
share of the node's available memory: the optimizer raises, naming the shortfall and the fixes, rather than
pin more than is free (which would push the node into swap or its OOM killer). It does not keep the buckets
that do not fit on the GPU instead: that memory is what the offload frees for activations, and a run planned
with it would fail later, at a peak, rather than at the first step (docs/known-gaps.md, "Host memory short").
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from ..config_base import format_bytes
from ..runtime import host
from ..runtime.pinned import PinnedRegion

__all__ = ["HostMemoryError", "HostRegion", "check_host_budget"]

log = logging.getLogger("megatron_peakflat")


class HostMemoryError(RuntimeError):
    """The pinned optimizer state would not fit this rank's share of host memory."""


def check_host_budget(need: int, *, what: str, available: int | None = None,
                      local_world_size: int | None = None, owner: str | None = None) -> int | None:
    """Raise HostMemoryError when ``need`` bytes exceed this rank's share: MemAvailable / LOCAL_WORLD_SIZE,
    less what other components promised to pin and have not yet (``runtime.host``; ``owner``'s own promise
    is this need). Returns the share."""
    avail = host.mem_available() if available is None else available
    if avail is None:
        log.warning("peakflat optimizer: /proc/meminfo unreadable; cannot check %s of host memory", format_bytes(need),
                    extra={"per_rank": True})
        return None
    ranks = max(1, local_world_size if local_world_size is not None else host.local_ranks())
    share = host.share(avail, ranks, exclude=owner)
    if need > share:
        others = host.promised(exclude=owner)
        promised = f", less {format_bytes(others)} other optimizers will pin" if others else ""
        raise HostMemoryError(
            f"OffloadStreamAdamW needs {format_bytes(need)} of host memory for {what} on this rank, but this rank's "
            f"share is {format_bytes(share)} (MemAvailable {format_bytes(avail)} / LOCAL_WORLD_SIZE={ranks}"
            f"{promised}): short by {format_bytes(need - share)}; nothing was allocated. "
            f"Fix: shard the state over more data-parallel ranks (--use-distributed-optimizer with a larger DP size), "
            f"run fewer ranks per node, or keep part of the state on the GPU (--peakflat-optimizer megatron with "
            f"--optimizer-offload-fraction < 1).")
    return share


class HostRegion(PinnedRegion):
    """``nbytes`` of zeroed host memory, pinned when ``pin`` and possible, carved into typed tensors
    (``runtime.pinned.PinnedRegion``). Pinning is tried only where CUDA is available; a failed pin leaves the
    state pageable, with a warning."""

    def __init__(self, nbytes: int, *, pin: bool, ext: ModuleType | None):
        pin = pin and torch.cuda.is_available()
        super().__init__(nbytes, pin=pin, ext=ext)
        if pin and not self.pinned:
            log.warning("peakflat optimizer: pinning %s of host memory failed (%s); using pageable memory, "
                        "host<->GPU copies will be slower", format_bytes(self.nbytes), self.pin_error,
                        extra={"per_rank": True})
