"""One host region, mapped once and pinned with one registration, carved into tensors: the memory of
OffloadStreamAdamW's state (``optimizer.host_memory.HostRegion``) and of SCO's native boundary pool
(``recompute.pool.NativeHostPool``).

The region is the compiled extension's ``HostPool`` (one mmap, one ``cudaHostRegister``) when a module is
given, else one torch byte tensor. A C++-only build of the extension cannot register memory itself, and torch's
tensor is not registered at all: either is pinned through torch's binding of the CUDA runtime
(``_ext.register_host_memory``), the whole region in one call, and unregistered when the region goes. One
registration for the whole region matters: torch's caching host allocator would round a 42 GB request up to
64 GB. Carves start at multiples of ``_ext.CARVE_ALIGN`` bytes from the region's start, whichever backend.

Nothing is logged here: a region that could not be pinned says why in ``pin_error``, and its owner says what
that costs it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .._ext import carve_end, register_host_memory, unregister_host_memory

__all__ = ["PinnedRegion"]


class PinnedRegion:
    """``nbytes`` of zeroed host memory, pinned when ``pin`` and possible (``pinned``; else ``pin_error``
    says why, empty where pinning was not tried), carved into 1-D tensors until it is full.

    ``ext`` is the compiled extension (its ``HostPool`` maps the region) or None (a torch tensor does). A torch
    region is registered only where CUDA is available; a native one asks its own pool to pin, and is registered
    through torch where the pool cannot (a build without CUDA) and CUDA is available.
    """

    backend: str
    """'native HostPool' or 'torch'."""

    def __init__(self, nbytes: int, *, pin: bool, ext: ModuleType | None):
        self.nbytes = int(nbytes)
        self.pinned = False
        self.pin_error = ""
        self._pool = None
        self._bytes: torch.Tensor | None = None
        self._used = 0
        self._registered_ptr = 0
        if ext is not None:
            self._pool = ext.HostPool(self.nbytes, bool(pin))
            self.pinned, self.pin_error = bool(self._pool.pinned), str(self._pool.pin_error)
            self.backend = "native HostPool"
            if pin and not self.pinned and torch.cuda.is_available() and not getattr(ext, "with_cuda", False):
                self._register(int(self._pool.base_address), int(self._pool.capacity))
        else:
            self._bytes = torch.zeros(self.nbytes, dtype=torch.uint8)
            self.backend = "torch"
            if pin and torch.cuda.is_available():
                self._register(self._bytes.data_ptr(), self.nbytes)

    def _register(self, ptr: int, nbytes: int) -> None:
        """One cudaHostRegister of the whole region."""
        self.pin_error = register_host_memory(ptr, nbytes)
        if not self.pin_error:
            self.pinned, self._registered_ptr = True, ptr

    @property
    def used(self) -> int:
        """Bytes from the region's start to the end of its last carve."""
        return int(self._pool.used) if self._pool is not None else self._used

    @property
    def capacity(self) -> int:
        """Bytes the region holds."""
        return int(self._pool.capacity) if self._pool is not None else self.nbytes

    def fits(self, nbytes: int) -> bool:
        """Whether a carve of ``nbytes`` more, at the next aligned offset, ends inside the region."""
        return carve_end(self.used, nbytes) <= self.capacity

    def carve(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D tensor of ``numel`` elements inside the region, at a multiple of 256 bytes from
        its start (the native pool's region starts on a page; torch's allocation on at least 64 bytes).

        A negative ``numel`` is a ValueError and a carve past the end a MemoryError naming both sizes, whichever
        backend: both are checked here before the native pool, whose own checks raise RuntimeErrors."""
        name = type(self).__name__
        if numel < 0:
            raise ValueError(f"{name}.carve: numel must be >= 0, got {numel}")
        off = carve_end(self.used, 0)
        end = off + numel * dtype.itemsize
        capacity = self.capacity
        if end > capacity:
            raise MemoryError(f"{name}: {end} bytes needed, {capacity} reserved")
        if self._pool is not None:
            return self._pool.carve(int(numel), dtype)
        self._used = end
        assert self._bytes is not None
        return self._bytes[off:end].view(dtype)

    def __del__(self) -> None:
        if getattr(self, "_registered_ptr", 0):
            unregister_host_memory(self._registered_ptr)
