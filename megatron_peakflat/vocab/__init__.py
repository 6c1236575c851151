"""Ring-DTP: vocabulary projection + cross-entropy without [tokens, vocab] logits (no Megatron import)."""

from .api import resolve_schedule, ring_linear_cross_entropy
from .config import VocabConfig
from .reference import reference_linear_cross_entropy

__all__ = ["ring_linear_cross_entropy", "resolve_schedule", "reference_linear_cross_entropy", "VocabConfig"]
