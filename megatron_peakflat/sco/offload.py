"""Pack/unpack hooks that keep checkpoint boundaries in a host pool between forward and backward.

Under full recompute, a checkpointed chunk saves only its inputs; the large one is the boundary
hidden state ``[s, b, h]``. ``BoundaryOffloader`` moves exactly that tensor to a host slot:

- ``group()`` brackets one forward of one model chunk for one microbatch. Boundaries are keyed by
  their group, so several microbatches and interleaved chunks can be in flight; backward order is
  the reverse of the packing order inside a group.
- ``boundary(x)`` brackets one checkpoint call whose boundary input is ``x``. Its pack hook offloads
  a saved tensor only when it is ``x`` (same storage, offset, shape and stride); every other saved
  tensor (masks, rotary tables) passes through untouched.
- forward: when the next boundary of the group is packed (so ``x`` is known not to be the last),
  ``x`` is copied to a pool slot on a side stream that waits only for the event recorded when its
  checkpoint began (so the copy overlaps that chunk's forward); ``record_stream`` keeps the allocator
  from reusing ``x``'s memory before that copy is done, and the offloader drops its reference at once.
- the last boundary of a group stays on the device: it is the first one backward needs, so
  offloading it would only make backward wait for its copy. So does a boundary that the caller
  says is held elsewhere anyway (``group(keep_first=True)``: a pipeline stage's received input),
  one that is not contiguous, and one for which the pool has no room within its budget.
- backward: unpacking boundary i issues the host-to-device copies of the next ``prefetch``
  boundaries of its group on a second side stream, so at most ``1 + prefetch`` boundaries of a
  group are back on the device at once; the unpack makes the compute stream wait for its own copy.
  A host slot goes back to the pool once its copy to the device is issued; the pool's next user
  waits for that copy's event before overwriting it.

On CPU tensors the same path runs with synchronous copies into the pool's host buffers, so the
mechanics (what is offloaded, when it is freed, exactness) are testable without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .. import stats
from ..config_base import format_bytes
from .pool import HostPool, HostSlot

__all__ = ["BoundaryOffloader", "Handle"]

log = logging.getLogger("megatron_peakflat")

COMPONENT = "sco"


@dataclass(eq=False)
class Handle:
    """What the autograd graph holds in place of one saved tensor; dies with the graph's saved tensors."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    group: "_Group | None"
    index: int
    device_tensor: torch.Tensor | None = None
    """The tensor on the device: until offload is final, when resident, or once brought back."""
    slot: HostSlot | None = None
    """The pool slot holding the data while the boundary is off the device."""
    produced: Any = None
    """CUDA event recorded when the boundary's checkpoint began: the copy to the host waits for it."""
    d2h_done: Any = None
    """CUDA event: the copy into ``slot`` is complete."""
    h2d_done: Any = None
    """CUDA event: the copy back into ``device_tensor`` is complete (None on CPU, copies are synchronous)."""
    offloaded: bool = False
    """Whether the boundary went to the host at all (stays True once it is back)."""
    owner: Any = field(default=None, repr=False)

    def __del__(self) -> None:
        # A graph dropped without backward must still give its slot back.
        if self.slot is not None and self.owner is not None:
            owner = self.owner()
            if owner is not None:
                owner._drop(self)


@dataclass(eq=False)
class _Group:
    """Weak references only: the autograd graph alone decides how long a boundary lives."""

    keep_first: bool
    handles: list["weakref.ref[Handle]"] = field(default_factory=list)
    pending: bool = True
    """True until backward has unpacked the group's first boundary."""

    def live(self) -> list[Handle]:
        return [h for h in (r() for r in self.handles) if h is not None]

    def last(self) -> Handle | None:
        return self.handles[-1]() if self.handles else None


def _is_boundary(t: torch.Tensor, x: torch.Tensor) -> bool:
    if t is x:
        return True
    return (t.shape == x.shape and t.dtype == x.dtype and t.device == x.device and t.stride() == x.stride()
            and t.storage_offset() == x.storage_offset()
            and t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())


class BoundaryOffloader:
    """Offloads checkpoint boundaries to ``pool``; see the module docstring for the schedule."""

    def __init__(self, pool: HostPool, *, prefetch: int = 1, log_summary: bool = True) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.pool = pool
        self.prefetch = prefetch
        self._group: _Group | None = None
        self._boundary: torch.Tensor | None = None
        self._produced: Any = None
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._live_groups: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._log_pending = log_summary
        self.packed = 0
        self.offloaded = 0
        self.offloaded_bytes_live = 0
        self.offloaded_bytes_peak = 0
        self.copy_wait_s = 0.0
        """Seconds the compute stream waited for boundaries to come back (GPU-timed), plus host time of
        synchronous copies (CPU device, pageable fallback)."""
        self._stalls: list[tuple[Any, Any]] = []

    # ---- forward side -------------------------------------------------------------------------
    @contextlib.contextmanager
    def group(self, *, keep_first: bool = False) -> Iterator[None]:
        """One forward of one model chunk for one microbatch; its last boundary stays on the device."""
        if self._group is not None:
            raise RuntimeError("BoundaryOffloader.group() does not nest")
        g = _Group(keep_first=keep_first)
        self._group = g
        try:
            yield
        finally:
            self._group = None
            if g.handles:
                self._live_groups.add(g)

    @contextlib.contextmanager
    def boundary(self, x: torch.Tensor) -> Iterator[None]:
        """One checkpoint call whose boundary input is ``x``: offload ``x`` when it is saved."""
        if self._group is None:
            raise RuntimeError("BoundaryOffloader.boundary() must run inside group()")
        if self._boundary is not None:
            raise RuntimeError("BoundaryOffloader.boundary() does not nest")
        self._boundary = x
        # x exists now: its copy may start as soon as the GPU gets here, overlapping the chunk's forward
        self._produced = torch.cuda.current_stream(x.device).record_event() if x.device.type == "cuda" else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._boundary = None
            self._produced = None

    def _pack(self, t: torch.Tensor) -> Any:
        x, g = self._boundary, self._group
        if x is None or g is None or not _is_boundary(t, x):
            return t
        self._boundary = None  # only the first save of x is the boundary
        h = Handle(t.shape, t.dtype, t.device, t.numel() * t.element_size(), g, len(g.handles),
                   device_tensor=t, owner=weakref.ref(self))
        h.produced = self._produced
        prev = g.last()
        if prev is not None:
            self._offload(prev)  # not the last boundary after all
        g.handles.append(weakref.ref(h))
        self.packed += 1
        stats.add(COMPONENT, "boundaries_packed", 1)
        return h

    def _offload(self, h: Handle) -> None:
        """Copy ``h`` to a pool slot and drop its device copy, unless it must stay on the device."""
        t = h.device_tensor
        g = h.group
        if t is None or (g is not None and g.keep_first and h.index == 0) or not t.is_contiguous() or h.nbytes == 0:
            return
        slot = self.pool.acquire(h.nbytes)
        if slot is None:
            return
        h.slot = slot
        if t.device.type == "cuda":
            d2h, _ = self._side_streams(t.device)
            d2h.wait_event(h.produced)
            if slot.ready is not None:
                d2h.wait_event(slot.ready)
            with torch.cuda.stream(d2h):
                slot.view(t.shape, t.dtype).copy_(t, non_blocking=True)
                h.d2h_done = d2h.record_event()
            t.record_stream(d2h)  # the allocator may reuse t's memory only after this copy
        else:
            start = time.perf_counter()
            slot.view(t.shape, t.dtype).copy_(t)
            self.copy_wait_s += time.perf_counter() - start
        h.device_tensor = None
        h.produced = None
        h.offloaded = True
        self.offloaded += 1
        self.offloaded_bytes_live += h.nbytes
        self.offloaded_bytes_peak = max(self.offloaded_bytes_peak, self.offloaded_bytes_live)
        stats.add(COMPONENT, "boundaries_offloaded", 1)
        stats.add(COMPONENT, "bytes_offloaded", h.nbytes)
        stats.peak(COMPONENT, "device_bytes_saved_peak", self.offloaded_bytes_live)
        stats.peak(COMPONENT, "host_bytes", self.pool.reserved)

    def _drop(self, h: Handle) -> None:
        """A handle that dies still offloaded (its graph was dropped without backward)."""
        self.offloaded_bytes_live -= h.nbytes
        self._give_back(h, h.d2h_done)

    # ---- backward side ------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return packed
        h = packed
        if h.device_tensor is None:
            self._fetch(h)
        if h.h2d_done is not None:
            # timing events around the wait measure exactly how long the compute stream stalls on the copy
            compute = torch.cuda.current_stream(h.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(compute)
            compute.wait_event(h.h2d_done)
            after.record(compute)
            self._stalls.append((before, after))
        g = h.group
        if g is not None:
            window = [r() for r in g.handles[max(0, h.index - self.prefetch): h.index]]
            for o in reversed(window):
                if o is not None and o.device_tensor is None and o.slot is not None:
                    self._fetch(o)
            if h.index == 0 and g.pending:
                g.pending = False
                self._drain_stalls(block=False)
                self._maybe_log()
        assert h.device_tensor is not None
        return h.device_tensor

    def _fetch(self, h: Handle) -> None:
        """Issue the copy of an offloaded boundary back to the device; hand its slot back."""
        assert h.slot is not None, "boundary neither on the device nor in the pool"
        src = h.slot.view(h.shape, h.dtype)
        if h.device.type == "cuda":
            compute = torch.cuda.current_stream(h.device)
            _, h2d = self._side_streams(h.device)
            dst = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # allocated in compute-stream order
            h2d.wait_stream(compute)
            if h.d2h_done is not None:
                h2d.wait_event(h.d2h_done)
            with torch.cuda.stream(h2d):
                dst.copy_(src, non_blocking=True)
                h.h2d_done = h2d.record_event()
        else:
            start = time.perf_counter()
            dst = torch.empty(h.shape, dtype=h.dtype, device=h.device)
            dst.copy_(src)
            self.copy_wait_s += time.perf_counter() - start
        h.device_tensor = dst
        self.offloaded_bytes_live -= h.nbytes
        self._give_back(h, h.h2d_done)

    def _give_back(self, h: Handle, ready: Any) -> None:
        slot, h.slot = h.slot, None
        if slot is not None:
            self.pool.release(slot, ready)

    def _side_streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    # ---- reporting ----------------------------------------------------------------------------
    def _drain_stalls(self, *, block: bool) -> None:
        keep = []
        for before, after in self._stalls:
            if block:
                after.synchronize()
            if after.query():
                self.copy_wait_s += before.elapsed_time(after) / 1000.0
            else:
                keep.append((before, after))
        self._stalls = keep

    def summary(self) -> dict[str, Any]:
        """Counters so far (waits for outstanding copy-back timings: call it outside the hot path)."""
        self._drain_stalls(block=True)
        stats.record(COMPONENT, "copy_wait_s", round(self.copy_wait_s, 6))
        return {
            "boundaries_packed": self.packed,
            "boundaries_offloaded": self.offloaded,
            "boundaries_kept_on_device": self.packed - self.offloaded,
            "host_bytes": self.pool.reserved,
            "device_bytes_saved_peak": self.offloaded_bytes_peak,
            "copy_wait_s": round(self.copy_wait_s, 6),
            "pinned": self.pool.pinned,
        }

    def _maybe_log(self) -> None:
        if not self._log_pending or any(g.pending for g in self._live_groups):
            return
        self._log_pending = False
        s = self.summary()
        log.info("peakflat sco (first backward done): %d boundaries packed, %d offloaded, %s on host (%s), "
                 "%s saved on the device at peak, %.4f s waited on copies",
                 s["boundaries_packed"], s["boundaries_offloaded"], format_bytes(s["host_bytes"]),
                 "pinned" if s["pinned"] else "pageable", format_bytes(s["device_bytes_saved_peak"]),
                 s["copy_wait_s"], extra={"per_rank": True})
