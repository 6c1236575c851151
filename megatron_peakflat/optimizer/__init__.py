"""OffloadStreamAdamW: fp32 master weights and Adam moments in pinned host buckets, streamed through
GPU staging slots and/or updated by a host AdamW kernel. No Megatron import here."""

from .api import OffloadStreamAdamW
from .host_memory import HostMemoryError

__all__ = ["OffloadStreamAdamW", "HostMemoryError"]
