"""A device-agnostic meter of live tensor storage bytes, for testing memory bounds on CPU.

``LiveBytesMeter`` is a ``TorchDispatchMode``. Every storage that an operator allocates while the
mode is active is counted from the moment it is created until the moment its last reference dies.
Views, in-place ops and ``out=`` ops share a storage that already exists and add nothing. Storages
that existed before the mode was entered are never counted, so a test measures exactly what the
code under test allocates, as ``torch.cuda.max_memory_allocated`` would minus the inputs, but on
any device and without the caching allocator's rounding.

Guarantees:
- ``live`` is the sum of ``nbytes`` of counted storages still alive;
- ``peak`` is the maximum of ``live`` since entry or the last ``reset_peak()``;
- ``device`` (optional) restricts counting to storages on that device type, e.g. to ignore
  pinned host copies when measuring what stays on the compute device.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

__all__ = ["LiveBytesMeter"]


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    """The storages of the tensors in ``tree``, in pytree order. An operator's arguments and results are tensors,
    scalars and lists, tuples or dicts of them: walked here directly (pytree's generic walk was most of the meter's
    own cost); anything else goes through pytree."""
    out: list[torch.UntypedStorage] = []
    _walk(tree, out)
    return out


_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _walk(x: Any, out: list[torch.UntypedStorage]) -> None:
    # a module-level function, not a closure: a closure calling itself is a reference cycle, which would keep
    # ``out`` and its storages alive until a garbage collection
    if isinstance(x, torch.Tensor):
        try:
            out.append(x.untyped_storage())
        except (RuntimeError, NotImplementedError):
            pass
    elif type(x) in (list, tuple):
        for y in x:
            _walk(y, out)
    elif type(x) is dict:
        for y in x.values():
            _walk(y, out)
    elif not isinstance(x, _LEAVES):  # a namedtuple, a registered container, or a leaf (tree_iter yields it)
        for y in tree_iter(x):
            if isinstance(y, torch.Tensor):
                _walk(y, out)


class LiveBytesMeter(TorchDispatchMode):
    """Counts live and peak storage bytes allocated by ops run under it."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.device_type = device
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self._tracked: dict[int, tuple[int, int]] = {}
        """storage key -> (bytes, its count in ``allocations``)"""

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak = self.live

    def live_since(self, allocations: int) -> dict[int, int]:
        """The live storages counted after the first ``allocations`` (a past value of ``allocations``), as
        storage key (``UntypedStorage._cdata``) -> bytes. By count, not by key: a freed storage's key can
        come back on a new one."""
        return {k: nbytes for k, (nbytes, born) in self._tracked.items() if born > allocations}

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Poll ``condition`` (a count over this meter) until it holds or ``timeout_s`` passes; return it.

        gloo's worker thread drops its references to a collective's tensors a moment after the caller's
        ``wait()`` returns, so a storage that the code under test let go of can die late, on that thread. A
        count taken right after a collective waits for that here; a storage that really is kept stays counted.
        The default wait is long for a machine whose cores other processes keep busy: a condition that holds
        returns at once (every wait of test_moe_release's 305 did on the first check).
        """
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
            gc.collect()
        return True

    def _release(self, key: int) -> None:
        nbytes, _ = self._tracked.pop(key, (0, 0))
        self.live -= nbytes

    def _track(self, st: torch.UntypedStorage) -> None:
        if self.device_type is not None and st.device.type != self.device_type:
            return
        key = st._cdata
        if key in self._tracked or st.nbytes() == 0:
            return
        self.live += st.nbytes()
        self.allocations += 1
        self._tracked[key] = (st.nbytes(), self.allocations)
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        before = {s._cdata for s in _storages((args, kwargs))}
        out = func(*args, **kwargs)
        for st in _storages(out):
            if st._cdata not in before:
                self._track(st)
        return out
