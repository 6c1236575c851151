"""SCO, selective checkpoint offload: full-recompute boundaries kept in a host pool until backward."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "build_offloader": ".api",
    "checkpoint_chunks": ".api",
    "BoundaryOffloader": ".offload",
    **{name: ".pool" for name in ("HostPool", "HostSlot", "NativeHostPool", "TorchHostPool", "make_pool",
                                   "resolve_budget")},
})
