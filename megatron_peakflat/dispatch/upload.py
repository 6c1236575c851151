"""Host integers to the device without stalling the stream.

A copy from pageable host memory to a CUDA device synchronises the stream first (CUDA's documented
behaviour for pageable transfers), so every small index array a schedule uploads would wait for
all queued kernels. Staged in pinned memory the copy is queued like a kernel instead; PyTorch's
pinned-memory allocator keeps the staging block until the copy has run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["to_device"]


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.as_tensor(values, dtype).to(device)``, queued on the current stream without a sync on CUDA."""
    t = torch.as_tensor(np.ascontiguousarray(values), dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
