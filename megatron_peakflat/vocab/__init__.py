"""Ring-DTP: vocabulary projection + cross-entropy without [tokens, vocab] logits (no Megatron import)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "ring_linear_cross_entropy": ".api",
    "resolve_schedule": ".api",
    "reference_linear_cross_entropy": ".reference",
    "VocabConfig": ".config",
})
