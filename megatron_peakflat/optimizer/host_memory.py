"""Host memory for the optimizer state: one large (pinned) region carved into flat buffers.

The region comes from the native ``HostPool`` (one mmap, one ``cudaHostRegister``) when the
extension is built, else from one torch byte tensor registered through ``torch.cuda.cudart()``.
Either way a single registration covers the whole state: torch's caching host allocator would round
a 42 GB request up to 64 GB. Pinning that fails falls back to pageable memory with a warning.
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
from .._ext import carve_end, register_host_memory, unregister_host_memory

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


class HostRegion:
    """``nbytes`` of zeroed host memory, pinned when ``pin`` and possible, carved into typed tensors."""

    def __init__(self, nbytes: int, *, pin: bool, ext: ModuleType | None):
        self.nbytes = int(nbytes)
        self.pinned = False
        self.pin_error = ""
        self._pool = None
        self._bytes: torch.Tensor | None = None
        self._used = 0
        self._registered_ptr = 0
        pin = pin and torch.cuda.is_available()
        if ext is not None:
            self._pool = ext.HostPool(self.nbytes, pin)
            self.pinned, self.pin_error = bool(self._pool.pinned), str(self._pool.pin_error)
            self.backend = "native HostPool"
            if pin and not self.pinned and not getattr(ext, "with_cuda", False):
                # a C++-only build cannot register memory itself: register its region through torch
                self._register(int(self._pool.base_address), int(self._pool.capacity))
        else:
            self._bytes = torch.zeros(self.nbytes, dtype=torch.uint8)
            self.backend = "torch"
            if pin:
                self._register(self._bytes.data_ptr(), self.nbytes)
        if pin and not self.pinned:
            log.warning("peakflat optimizer: pinning %s of host memory failed (%s); using pageable memory, "
                        "host<->GPU copies will be slower", format_bytes(self.nbytes), self.pin_error,
                        extra={"per_rank": True})

    def _register(self, ptr: int, nbytes: int) -> None:
        """One cudaHostRegister of the whole region."""
        self.pin_error = register_host_memory(ptr, nbytes)
        if not self.pin_error:
            self.pinned, self._registered_ptr = True, ptr

    def carve(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D tensor of ``numel`` elements inside the region, at a multiple of 256 bytes from
        its start (the native pool's region starts on a page; torch's allocation on at least 64 bytes)."""
        if numel < 0:
            raise ValueError(f"HostRegion.carve: numel must be >= 0, got {numel}")
        size = dtype.itemsize
        used = int(self._pool.used) if self._pool is not None else self._used
        capacity = int(self._pool.capacity) if self._pool is not None else self.nbytes
        off = carve_end(used, 0)
        end = off + numel * size
        if end > capacity:  # checked before the native pool, whose own check raises a RuntimeError
            raise MemoryError(f"HostRegion: {end} bytes needed, {capacity} reserved")
        if self._pool is not None:
            return self._pool.carve(int(numel), dtype)
        self._used = end
        assert self._bytes is not None
        return self._bytes[off:end].view(dtype)

    def __del__(self) -> None:
        if self._registered_ptr:
            unregister_host_memory(self._registered_ptr)
