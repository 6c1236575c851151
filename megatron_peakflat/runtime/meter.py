"""Measured peak of each component's region, for ``--peakflat-report-peaks``.

Components wrap their region in ``component_region(name)``::

    with component_region("dispatch"):
        out = pipelined_llep(...)

When the report is off (the default) ``component_region`` returns one shared no-op context: the
cost is a global lookup, a bool test and an empty ``with``. When it is on, the region records
``peak allocated inside - allocated at entry`` (the component's transient working set, the quantity
the planner's dispatch / vocab / optimizer rows predict) and the absolute peak, through
``torch.cuda.memory_allocated`` / ``max_memory_allocated``.

Nesting: ``reset_peak_memory_stats`` is global, so on every entry the running peak is first folded
into every open region (and into the process peak kept here, ``process_peak()``), then reset. Each
region's peak is therefore the true maximum over its whole extent, even around inner regions.
Only one thread may run regions (Megatron's training loop). Those resets also hide the process's
peak from anyone reading ``max_memory_allocated`` (Megatron's memory report): ``lifetime_peak()`` keeps
it, and ``allocator_reports_lifetime_peak()`` shows it to such readers.

The allocator backend is pluggable (``set_backend``) so the bookkeeping is testable on CPU. torch
is imported only when a region runs with the report on.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

__all__ = ["add_resident", "allocator_reports_lifetime_peak", "component_region", "enable", "enabled", "set_backend",
           "measured", "reset", "process_peak", "lifetime_peak", "RegionPeak"]

_ENABLED = False
_NULL: ContextManager[None] = contextlib.nullcontext()


@dataclass
class RegionPeak:
    """Peaks of one component since the last ``reset()``."""

    delta: int = 0
    """max over calls of (peak allocated inside the region - allocated at entry), bytes."""
    absolute: int = 0
    """max over calls of the peak allocated inside the region, bytes."""
    calls: int = 0


@dataclass
class _Backend:
    allocated: Callable[[], int]
    max_allocated: Callable[[], int]
    reset_peak: Callable[[], None]


@dataclass
class _Frame:
    name: str
    base: int
    top: int
    resident: int = 0


@dataclass
class _State:
    backend: _Backend | None = None
    stack: list[_Frame] = field(default_factory=list)
    peaks: dict[str, RegionPeak] = field(default_factory=dict)
    process_peak: int = 0
    lifetime_peak: int = 0


_S = _State()


def enable(on: bool = True) -> None:
    """Turn the measurement on or off (``--peakflat-report-peaks``)."""
    global _ENABLED
    _ENABLED = bool(on)


def enabled() -> bool:
    return _ENABLED


def set_backend(allocated: Callable[[], int] | None, max_allocated: Callable[[], int] | None = None,
                reset_peak: Callable[[], None] | None = None) -> None:
    """Use these allocator probes instead of torch.cuda's (tests); ``None`` restores torch.cuda."""
    _S.backend = None if allocated is None else _Backend(allocated, max_allocated, reset_peak)  # type: ignore[arg-type]
    _S.lifetime_peak = 0  # another allocator: its own lifetime


def _backend() -> _Backend | None:
    if _S.backend is None:
        import torch

        if not torch.cuda.is_available():
            return None
        _S.backend = _Backend(torch.cuda.memory_allocated, torch.cuda.max_memory_allocated,
                              torch.cuda.reset_peak_memory_stats)
    return _S.backend


def _fold_process_peak(running: int) -> None:
    _S.process_peak = max(_S.process_peak, running)
    _S.lifetime_peak = max(_S.lifetime_peak, running)


@contextlib.contextmanager
def _measure(name: str):  # noqa: ANN202
    be = _backend()
    if be is None:
        yield
        return
    running = be.max_allocated()
    for f in _S.stack:
        f.top = max(f.top, running)
    _fold_process_peak(running)
    be.reset_peak()
    base = be.allocated()
    frame = _Frame(name, base, base)
    _S.stack.append(frame)
    try:
        yield
    finally:
        running = be.max_allocated()
        _S.stack.pop()
        frame.top = max(frame.top, running)
        for f in _S.stack:
            f.top = max(f.top, running)
        _fold_process_peak(running)
        p = _S.peaks.setdefault(name, RegionPeak())
        p.delta = max(p.delta, frame.top - frame.base + frame.resident)
        p.absolute = max(p.absolute, frame.top)
        p.calls += 1


def add_resident(name: str, nbytes: int) -> None:
    """Count ``nbytes`` the component already held at its region's entry (buffers it keeps across calls,
    such as the optimizer's staging slots) in the innermost open region ``name``: its measured peak is
    what it holds, not only what it allocates in this call."""
    for f in reversed(_S.stack):
        if f.name == name:
            f.resident += int(nbytes)
            return


def component_region(name: str) -> ContextManager[None]:
    """Context manager measuring ``name``'s peak when the report is on; a shared no-op otherwise."""
    if not _ENABLED:
        return _NULL
    return _measure(name)


def region(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator form of ``component_region``: the whole call is measured as ``name``'s region."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def measured_call(*args: Any, **kwargs: Any) -> Any:
            with component_region(name):
                return fn(*args, **kwargs)

        return measured_call

    return wrap


def measured() -> dict[str, RegionPeak]:
    """Peaks per component since the last ``reset()``."""
    return {k: RegionPeak(v.delta, v.absolute, v.calls) for k, v in _S.peaks.items()}


def process_peak() -> int:
    """The process's peak allocated bytes since the last ``reset()``, regions' resets included."""
    be = _backend()
    return max(_S.process_peak, be.max_allocated() if be is not None else 0)


def lifetime_peak() -> int:
    """The process's peak allocated bytes since it started (``reset()`` does not clear it), regions' resets
    included: what ``max_memory_allocated`` would say had no region reset it."""
    be = _backend()
    return max(_S.lifetime_peak, be.max_allocated() if be is not None else 0)


@contextlib.contextmanager
def allocator_reports_lifetime_peak():  # noqa: ANN201
    """While open (and the report is on), ``torch.cuda.max_memory_allocated()`` returns ``lifetime_peak()``,
    so that a reader such as Megatron's ``report_memory`` logs the process's peak, not the peak since the
    last region's reset. A no-op when the report is off: nothing was reset."""
    if not _ENABLED or _backend() is None:
        yield
        return
    import torch

    real = torch.cuda.max_memory_allocated
    torch.cuda.max_memory_allocated = lambda device=None: lifetime_peak()  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.max_memory_allocated = real  # type: ignore[assignment]


def reset() -> None:
    """Start a new reporting interval."""
    _S.peaks.clear()
    _S.process_peak = 0
    if _S.backend is not None and not _S.stack:
        _S.backend.reset_peak()
