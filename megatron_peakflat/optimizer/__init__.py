"""OffloadStreamAdamW: fp32 master weights and Adam moments in pinned host buckets, streamed through
GPU staging slots and/or updated by a host AdamW kernel. No Megatron import here."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {"OffloadStreamAdamW": ".api", "HostMemoryError": ".host_memory"})
