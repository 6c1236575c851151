"""A reusable host buffer pool for checkpoint boundaries, bounded by a byte budget.

The pool hands out host slots (flat uint8 tensors) and takes them back. Slots are kept and reused
across iterations, so after the first step no host allocation (``cudaHostAlloc`` for pinned
memory) happens on the training path. ``HostPool`` is the interface the offloader uses; the torch
implementation here (``TorchHostPool``) can be replaced by a compiled pool exposing the same four
members.

Guarantees:
- ``reserved`` (bytes of slots the pool holds, in use or free) never exceeds ``budget``;
- ``acquire`` returns ``None`` instead of exceeding the budget; it never raises for lack of memory;
- when pinning fails, the pool shrinks its budget to what it already holds and, if it holds
  nothing, falls back to pageable memory; both are logged once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..config_base import format_bytes

__all__ = ["HostSlot", "HostPool", "TorchHostPool", "host_available_bytes", "resolve_budget"]

log = logging.getLogger("megatron_peakflat")

SAFE_FRACTION = 0.5
"""Share of the host's available RAM that the default budget may take, before dividing by local ranks."""
CLAMP_FRACTION = 0.9
"""An explicit budget above this share of available RAM per local rank is clamped."""


@dataclass(eq=False)
class HostSlot:
    """One host buffer. ``ready`` is an event after which the buffer may be overwritten (None: now)."""

    buffer: torch.Tensor
    ready: Any = None
    in_use: bool = field(default=False, repr=False)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel * itemsize`` bytes of the slot, as a contiguous tensor of ``shape``."""
        n = shape.numel() * dtype.itemsize
        return self.buffer[:n].view(dtype).view(shape)


class HostPool(Protocol):
    budget: int
    reserved: int
    pinned: bool

    def acquire(self, nbytes: int) -> HostSlot | None: ...

    def release(self, slot: HostSlot, ready: Any = None) -> None: ...


def host_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def resolve_budget(requested: int | None, *, available: int | None = None, local_ranks: int | None = None) -> int:
    """The pool budget in bytes for this rank.

    ``None`` gives SAFE_FRACTION of the available host RAM divided among the local ranks. An
    explicit request above CLAMP_FRACTION of the available RAM per local rank is clamped to it,
    with a warning, since pinning more than is free would push the host into swap or the OOM killer.
    """
    available = host_available_bytes() if available is None else available
    local_ranks = _local_ranks() if local_ranks is None else local_ranks
    if requested is None:
        if available is None:
            log.warning("peakflat SCO: cannot read MemAvailable; budget 0 (boundaries stay on the device); "
                        "pass --peakflat-sco-budget")
            return 0
        return int(available * SAFE_FRACTION) // local_ranks
    if available is not None:
        ceiling = int(available * CLAMP_FRACTION) // local_ranks
        if requested > ceiling:
            log.warning("peakflat SCO: --peakflat-sco-budget %s exceeds %s (%.0f%% of the %s available, over %d "
                        "local ranks); clamped", format_bytes(requested), format_bytes(ceiling),
                        CLAMP_FRACTION * 100, format_bytes(available), local_ranks)
            return ceiling
    return int(requested)


class TorchHostPool:
    """``HostPool`` on torch host tensors, pinned when ``pin`` (needed for asynchronous copies).

    Slots are allocated lazily at the sizes asked for and recycled: a request is served by a free
    slot of at least the size and at most twice it, else by a new slot if the budget allows, else
    by dropping free slots of other sizes to make room. Boundaries of one model share a size, so in
    steady state every request is served from the free list.
    """

    def __init__(self, budget: int, *, pin: bool) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget}")
        self.budget = int(budget)
        self.pinned = bool(pin)
        self.reserved = 0
        self.in_use = 0
        self.peak_in_use = 0
        self.allocations = 0
        self._free: list[HostSlot] = []

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Allocate ``count`` slots of ``nbytes`` now (within the budget), e.g. before a measurement."""
        slots = [s for s in (self.acquire(nbytes) for _ in range(count)) if s is not None]
        for s in slots:
            self.release(s)

    def acquire(self, nbytes: int) -> HostSlot | None:
        slot = self._take_free(nbytes)
        if slot is None:
            if self.reserved + nbytes > self.budget:
                self._drop_free(self.reserved + nbytes - self.budget)
            if self.reserved + nbytes > self.budget:
                return None
            slot = self._allocate(nbytes)
            if slot is None:
                return None
        slot.in_use = True
        self.in_use += slot.nbytes
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return slot

    def release(self, slot: HostSlot, ready: Any = None) -> None:
        """Return ``slot``; its next user must wait for ``ready`` (an event) before writing it."""
        if not slot.in_use:
            raise RuntimeError("host slot released twice")
        slot.in_use = False
        slot.ready = ready
        self.in_use -= slot.nbytes
        self._free.append(slot)

    def _take_free(self, nbytes: int) -> HostSlot | None:
        best = None
        for s in self._free:
            if nbytes <= s.nbytes <= 2 * nbytes and (best is None or s.nbytes < best.nbytes):
                best = s
        if best is not None:
            self._free.remove(best)
        return best

    def _drop_free(self, need: int) -> None:
        while self._free and need > 0:
            s = self._free.pop()
            if s.ready is not None:
                s.ready.synchronize()
            self.reserved -= s.nbytes
            need -= s.nbytes

    def _allocate(self, nbytes: int) -> HostSlot | None:
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        except RuntimeError as e:
            if self.pinned and self.reserved > 0:
                log.warning("peakflat SCO: pinning %s more host memory failed (%s); budget shrunk from %s to "
                            "the %s already pinned", format_bytes(nbytes), str(e).splitlines()[0],
                            format_bytes(self.budget), format_bytes(self.reserved))
                self.budget = self.reserved
                return None
            if self.pinned:
                log.warning("peakflat SCO: pinned host memory unavailable (%s); using pageable memory, "
                            "copies will not overlap compute", str(e).splitlines()[0])
                self.pinned = False
                return self._allocate(nbytes)
            log.warning("peakflat SCO: host allocation of %s failed (%s); budget shrunk to %s",
                        format_bytes(nbytes), str(e).splitlines()[0], format_bytes(self.reserved))
            self.budget = self.reserved
            return None
        self.reserved += nbytes
        self.allocations += 1
        return HostSlot(buf)
