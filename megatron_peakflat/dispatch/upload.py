"""Host integers to the device without stalling the stream.

A copy from pageable host memory to a CUDA device synchronises the stream first (CUDA's documented
behaviour for pageable transfers), so every small index array a schedule uploads would wait for
all queued kernels. Staged in pinned memory the copy is queued like a kernel instead; PyTorch's
pinned-memory allocator keeps the staging block until the copy has run.

Each staged copy still costs the host a pinned allocation and a launch (tens of microseconds), and a
schedule is built right after its one device-to-host sync, while the GPU waits for the host: so a
schedule gathers its arrays in an ``Uploads`` and sends them in one copy.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

__all__ = ["to_device", "Uploads"]

log = logging.getLogger("megatron_peakflat")


_pinning_failed = False
"""Set once pinning a staging buffer has failed: later uploads go from pageable memory (a stream sync each)."""


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.as_tensor(values, dtype).to(device)``, queued on the current stream without a sync on CUDA.

    If pinned host memory runs out, the copy goes from pageable memory instead (correct, but the stream
    waits for its queued kernels), with one warning for the process."""
    global _pinning_failed
    t = torch.as_tensor(np.ascontiguousarray(values), dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    if not _pinning_failed:
        try:
            return t.pin_memory().to(device, non_blocking=True)
        except RuntimeError as e:
            _pinning_failed = True
            log.warning("peakflat dispatch: pinning a %s-byte schedule upload failed (%s); uploading from pageable "
                        "memory from now on (each upload then waits for the stream)", t.nbytes, str(e).splitlines()[0],
                        extra={"per_rank": True})
    return t.to(device)


class Uploads:
    """Integer arrays bound for one device, sent in one ``to_device`` copy.

    ``add`` returns a slot; after ``send``, ``get(slot)`` is that array on the device (an int64 view of
    the one uploaded buffer, in the array's shape).
    """

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._shapes: list[tuple[int, ...]] = []
        self._buf: torch.Tensor | None = None
        self._starts: list[int] = []

    def add(self, values: Any) -> int:
        a = np.asarray(values, dtype=np.int64)
        self._parts.append(a.reshape(-1))
        self._shapes.append(a.shape)
        return len(self._parts) - 1

    def send(self, device: torch.device) -> None:
        sizes = [p.size for p in self._parts]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).tolist() if sizes else [0]
        flat = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=np.int64)
        self._buf = to_device(flat, device)

    def get(self, slot: int) -> torch.Tensor:
        if self._buf is None:
            raise RuntimeError("Uploads.get before send")
        a, b = self._starts[slot], self._starts[slot + 1]
        return self._buf[a:b].view(self._shapes[slot])
