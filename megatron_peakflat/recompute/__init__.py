"""SCO, selective checkpoint offload: full-recompute boundaries kept in a host pool until backward."""

from .api import build_offloader, checkpoint_chunks
from .offload import BoundaryOffloader
from .pool import HostPool, HostSlot, NativeHostPool, TorchHostPool, make_pool, resolve_budget

__all__ = ["build_offloader", "checkpoint_chunks", "BoundaryOffloader", "HostPool", "HostSlot", "TorchHostPool",
           "NativeHostPool", "make_pool", "resolve_budget"]
