"""How far a result is from its reference, the one measure every exactness test uses."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["max_rel_error", "loss_and_grad_errors"]


def max_rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp64 and detached (the floor 1e-30 keeps an all-zero reference finite);
    0 for two empty tensors of the same shape (a rank with no tokens)."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} against the reference's {tuple(b.shape)}")
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def loss_and_grad_errors(out: torch.Tensor, ref: torch.Tensor, inputs: Sequence[torch.Tensor],
                         grad_output: torch.Tensor | None = None) -> list[float]:
    """``max_rel_error`` of ``out`` against ``ref``, then of the gradients of each of ``inputs`` through
    them for the same ``grad_output`` (None: of their sums)."""
    errs = [max_rel_error(out, ref)]
    if grad_output is None:
        out, ref = out.sum(), ref.sum()
    got = torch.autograd.grad(out, tuple(inputs), grad_output)
    want = torch.autograd.grad(ref, tuple(inputs), grad_output)
    return errs + [max_rel_error(a, b) for a, b in zip(got, want)]
