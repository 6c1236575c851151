"""Ring-DTP: vocabulary projection + cross-entropy without [tokens, vocab] logits (no Megatron import).

Names load on first use, so importing ``megatron_peakflat.vocab.config`` (the flags) costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ring_linear_cross_entropy": ".api",
    "resolve_schedule": ".api",
    "reference_linear_cross_entropy": ".reference",
    "VocabConfig": ".config",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
