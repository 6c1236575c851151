"""Plain-PyTorch twin of Ring-DTP: the full logits and ``F.cross_entropy``.

This builds the whole [n, V] logits on purpose; it is the ground truth the tests compare against,
never a training path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["reference_linear_cross_entropy"]


def reference_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "none",
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels)`` with the full vocabulary ``weight`` [V, h]."""
    logits = hidden @ weight.t()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)
