"""A reusable host buffer pool for checkpoint boundaries, bounded by a byte budget.

The pool hands out host slots (flat uint8 tensors) and takes them back. Slots are kept and reused
across iterations, so after the first step no host allocation (``cudaHostAlloc`` for pinned
memory) happens on the training path. ``HostPool`` is the interface the offloader uses; the torch
implementation (``TorchHostPool``, the default) allocates slots lazily; ``NativeHostPool`` carves
them from the compiled extension's single pre-registered region (``--peakflat-sco-pool native``).

Guarantees:
- ``reserved`` (host bytes of the slots the pool holds, in use or free) never exceeds ``budget``;
- ``acquire`` returns ``None`` instead of exceeding the budget; it never raises for lack of memory;
- when pinning fails, the pool shrinks its budget to what it already holds and, if it holds
  nothing, falls back to pageable memory; both are logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..config_base import format_bytes
from ..runtime import host
from ..runtime.pinned import PinnedRegion

__all__ = ["HostSlot", "HostPool", "TorchHostPool", "NativeHostPool", "make_pool", "resolve_budget"]

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
    cost: int = 0
    """Host bytes the slot really takes (torch's pinned allocator rounds up to a power of two)."""

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel * itemsize`` bytes of the slot, as a contiguous tensor of ``shape``."""
        n = shape.numel() * dtype.itemsize
        return self.buffer[:n].view(dtype).view(shape)


class HostPool(Protocol):
    """What ``BoundaryOffloader`` needs from a pool; the guarantees are in the module docstring."""

    budget: int
    reserved: int
    pinned: bool

    def acquire(self, nbytes: int) -> HostSlot | None:
        """A slot of at least ``nbytes``, in use until released; None when the budget has no room."""
        ...

    def release(self, slot: HostSlot, ready: Any = None) -> None:
        """Return ``slot``; its next user must wait for ``ready`` (an event; None: now) before writing it."""
        ...


def resolve_budget(requested: int | None, *, available: int | None = None, local_ranks: int | None = None) -> int:
    """The pool budget in bytes for this rank.

    This rank's share is the available host RAM divided among the local ranks, less the pinned memory that
    other components have promised and not yet allocated (``runtime.host``: OffloadStreamAdamW's state,
    allocated at its first step, after this budget is chosen in the first forward). ``None`` gives
    SAFE_FRACTION of that share. An explicit request above CLAMP_FRACTION of it is clamped, with one
    warning naming the request, the share and the shortfall, since pinning more than is free would push the
    host into swap or the OOM killer: the run goes on with a smaller pool, and the boundaries past it stay on
    the GPU (exact either way). A default budget that finds nothing left to take (the optimizer's promise
    takes the whole share) is 0, with a warning too: SCO then keeps every boundary on the GPU.
    """
    available = host.mem_available() if available is None else available
    ranks = host.local_ranks() if local_ranks is None else max(1, local_ranks)
    if available is None:
        if requested is None:
            log.warning("peakflat sco: cannot read MemAvailable; budget 0 (boundaries stay on the device); "
                        "pass --peakflat-sco-budget", extra={"per_rank": True})
            return 0
        return int(requested)
    promised = host.promised()
    mine = host.share(available, ranks)
    if promised:
        log.info("peakflat sco: %s of host memory per rank, less %s that the optimizer will pin: %s to size the "
                 "boundary pool from", format_bytes(available // ranks), format_bytes(promised), format_bytes(mine),
                 extra={"per_rank": True})
    less = f", less {format_bytes(promised)} the optimizer will pin" if promised else ""
    if requested is None:
        budget = int(mine * SAFE_FRACTION)
        if budget == 0:
            log.warning("peakflat sco: no host memory left for the boundary pool on this rank (MemAvailable %s / "
                        "LOCAL_WORLD_SIZE=%d%s = %s); budget 0, every boundary stays on the GPU. Fix: free host "
                        "memory, run fewer ranks per node, or drop --peakflat-sco", format_bytes(available), ranks,
                        less, format_bytes(mine), extra={"per_rank": True})
        return budget
    ceiling = int(mine * CLAMP_FRACTION)
    if requested > ceiling:
        log.warning("peakflat sco: --peakflat-sco-budget %s requested, %s available on this rank (%.0f%% of "
                    "MemAvailable %s / LOCAL_WORLD_SIZE=%d%s): short by %s; budget clamped to %s, boundaries past it "
                    "stay on the GPU", format_bytes(requested), format_bytes(ceiling), CLAMP_FRACTION * 100,
                    format_bytes(available), ranks, less, format_bytes(requested - ceiling), format_bytes(ceiling),
                    extra={"per_rank": True})
        return ceiling
    return int(requested)


class _RecyclingPool:
    """Slot bookkeeping shared by the pools: a free list served best-fit, and usage counters."""

    budget: int
    pinned: bool

    def __init__(self) -> None:
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
        """A free slot of ``nbytes`` to twice that (the smallest), else a new one; None past the budget."""
        slot = self._take_free(nbytes) or self._new_slot(nbytes)
        if slot is None:
            return None
        slot.in_use = True
        self.in_use += slot.cost
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return slot

    def release(self, slot: HostSlot, ready: Any = None) -> None:
        """Return ``slot``; its next user must wait for ``ready`` (an event) before writing it."""
        if not slot.in_use:
            raise RuntimeError("host slot released twice")
        slot.in_use = False
        slot.ready = ready
        self.in_use -= slot.cost
        self._free.append(slot)

    def _take_free(self, nbytes: int) -> HostSlot | None:
        best = None
        for s in self._free:
            if nbytes <= s.nbytes <= 2 * nbytes and (best is None or s.nbytes < best.nbytes):
                best = s
        if best is not None:
            self._free.remove(best)
        return best

    def _new_slot(self, nbytes: int) -> HostSlot | None:
        raise NotImplementedError


class TorchHostPool(_RecyclingPool):
    """``HostPool`` on torch host tensors, pinned when ``pin`` (needed for asynchronous copies).

    Slots are allocated lazily at the sizes asked for and recycled: a request is served by a free
    slot of at least the size and at most twice it, else by a new slot if the budget allows, else
    by dropping free slots of other sizes to make room. Boundaries of one model share a size, so in
    steady state every request is served from the free list. The budget counts what the host
    really gives: torch's pinned allocator rounds each block up to a power of two, so a pinned
    slot costs that rounded size.
    """

    def __init__(self, budget: int, *, pin: bool) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget}")
        super().__init__()
        self.budget = int(budget)
        self.pinned = bool(pin)
        self._warned: set[str] = set()

    def _new_slot(self, nbytes: int) -> HostSlot | None:
        excess = self.reserved + self._cost(nbytes) - self.budget
        if excess > 0:
            if excess > sum(s.cost for s in self._free):
                return None  # dropping every free slot would not make room: keep them for reuse
            self._drop_free(excess)
        return self._allocate(nbytes)

    def _cost(self, nbytes: int) -> int:
        return 1 << max(nbytes - 1, 0).bit_length() if self.pinned else nbytes

    def _drop_free(self, need: int) -> None:
        """Give up free slots until ``need`` bytes of budget are released (waiting for their last copy)."""
        while self._free and need > 0:
            s = self._free.pop()
            if s.ready is not None:
                s.ready.synchronize()
            self.reserved -= s.cost
            need -= s.cost

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """One warning per pool for each kind of failure ('pinned', 'pageable'); repeats go to the debug log."""
        if kind in self._warned:
            log.debug(msg, *args)
            return
        self._warned.add(kind)
        log.warning(msg, *args, extra={"per_rank": True})

    def _allocate(self, nbytes: int) -> HostSlot | None:
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        except (RuntimeError, MemoryError) as e:  # cudaHostAlloc's failure is a RuntimeError (AcceleratorError)
            reason = (str(e).splitlines() or [type(e).__name__])[0]
            if self.pinned and self.reserved > 0:
                self._warn_once("pinned", "peakflat sco: pinning %s more host memory failed (%s); budget shrunk "
                                "from %s to the %s already pinned, boundaries past it stay on the GPU",
                                format_bytes(nbytes), reason, format_bytes(self.budget), format_bytes(self.reserved))
                self.budget = self.reserved
                return None
            if self.pinned:
                self._warn_once("pinned", "peakflat sco: pinned host memory unavailable (%s); using pageable memory, "
                                "copies will not overlap compute", reason)
                self.pinned = False
                return self._allocate(nbytes)
            self._warn_once("pageable", "peakflat sco: host allocation of %s failed (%s); budget shrunk from %s to "
                            "%s, boundaries past it stay on the GPU", format_bytes(nbytes), reason,
                            format_bytes(self.budget), format_bytes(self.reserved))
            self.budget = self.reserved
            return None
        slot = HostSlot(buf, cost=self._cost(nbytes))
        self.reserved += slot.cost
        self.allocations += 1
        return slot


class NativeHostPool(_RecyclingPool):
    """``HostPool`` over the compiled pool (``megatron_peakflat._C.HostPool``): one host region of
    ``budget`` bytes (``runtime.pinned.PinnedRegion``), registered (pinned) with CUDA once, carved into slots
    at exact sizes.

    Unlike ``TorchHostPool`` nothing is rounded up, but the whole budget is mapped, and pinned when
    ``pin``, when the pool is built. Slots are recycled like ``TorchHostPool``'s; a carved slot is
    never returned to the region, so a request that fits no free slot and no remaining space gets
    ``None`` (the boundary stays on the device).

    If pinning fails, the region keeps its budget, pageable (logged): copies then wait for the stream,
    but a smaller budget would leave boundaries on the GPU, whose peak SCO is there to bound.
    """

    def __init__(self, budget: int, *, pin: bool, module: Any) -> None:
        if budget <= 0:
            raise ValueError(f"budget must be > 0 bytes for the native pool, got {budget}")
        super().__init__()
        self._region = PinnedRegion(int(budget), pin=bool(pin), ext=module)
        self.budget = int(budget)
        self.pinned = self._region.pinned
        if pin and not self.pinned:
            log.warning("peakflat sco: native host pool is pageable (%s); copies will not overlap compute",
                        self._region.pin_error, extra={"per_rank": True})

    def _new_slot(self, nbytes: int) -> HostSlot | None:
        if not self._region.fits(nbytes):
            return None
        slot = HostSlot(self._region.carve(nbytes, torch.uint8), cost=nbytes)
        self.reserved = self._region.used
        self.allocations += 1
        return slot


def make_pool(budget: int, *, pin: bool, impl: str = "torch") -> "TorchHostPool | NativeHostPool":
    """The pool for ``impl`` ('torch' or 'native'); 'native' falls back to 'torch', logged, when the
    compiled extension is missing or its region cannot be mapped."""
    if impl == "native" and budget > 0:
        from .. import _ext

        module = _ext.load()
        if module is None:
            log.warning("peakflat sco: native host pool unavailable (%s); using torch pinned tensors", _ext.reason(),
                        extra={"per_rank": True})
        else:
            try:
                return NativeHostPool(budget, pin=pin, module=module)
            except RuntimeError as e:
                log.warning("peakflat sco: native host pool of %s failed (%s); using torch pinned tensors",
                            format_bytes(budget), str(e).splitlines()[0], extra={"per_rank": True})
    elif impl not in ("torch", "native"):
        raise ValueError(f"pool impl must be 'torch' or 'native', got {impl!r}")
    return TorchHostPool(budget, pin=pin)
