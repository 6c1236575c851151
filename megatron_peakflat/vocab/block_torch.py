"""The plain-PyTorch block kernels: fold one block of logits into the online log-sum-exp state, and
turn one recomputed block of logits into its gradient. These are the CPU path and the reference the
Triton kernels (``block_triton.py``) are tested against.

State layout (fp32, [4, n]): running max ``m``, running sum of ``exp(z - m)`` ``s``, target logit
``t`` (0 until the shard owning the label is seen) and the sum of all logits ``zsum`` (for label
smoothing). Local labels are ``label - block_start``; anything outside [0, block) is not in this block.
"""

from __future__ import annotations

import torch

__all__ = ["fold_logits_torch", "grad_logits_torch", "fold_grad_logits_torch", "grad_coefficients"]


def fold_logits_torch(z: torch.Tensor, local_labels: torch.Tensor, state: torch.Tensor) -> None:
    """Fold logits ``z`` [n, b] into ``state`` [4, n] in place (exact online log-sum-exp merge)."""
    zf = z.float()
    m, s, t, zs = state[0], state[1], state[2], state[3]
    m_new = torch.maximum(m, zf.amax(dim=1))
    s.mul_(torch.exp(m - m_new)).add_(torch.exp(zf - m_new[:, None]).sum(dim=1))
    m.copy_(m_new)
    inb = (local_labels >= 0) & (local_labels < z.shape[1])
    idx = local_labels.clamp(0, max(z.shape[1] - 1, 0))[:, None]
    t.add_(torch.where(inb, zf.gather(1, idx).squeeze(1), torch.zeros((), dtype=zf.dtype)))
    zs.add_(zf.sum(dim=1))


def grad_logits_torch(z: torch.Tensor, local_labels: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Gradient of the loss w.r.t. logits ``z`` [n, b], in z's dtype.

    ``coef`` [4, n] fp32 holds (lse, a, b, c) per token; the gradient is
    ``a * exp(z - lse) - c - b * [col == label]`` (a = g, b = g (1 - eps), c = g eps / V, all 0 for
    ignored tokens).
    """
    lse, a, b, c = coef[0], coef[1], coef[2], coef[3]
    d = torch.exp(z.float() - lse[:, None]).mul_(a[:, None]).sub_(c[:, None])
    inb = (local_labels >= 0) & (local_labels < z.shape[1])
    rows = torch.nonzero(inb).squeeze(1)
    d[rows, local_labels[rows]] -= b[rows]
    return d.to(z.dtype)


def grad_coefficients(lse: torch.Tensor, g: torch.Tensor, label_smoothing: float, vocab_size: int) -> torch.Tensor:
    """The [4, n] (lse, a, b, c) of ``grad_logits_*`` for the per-token upstream gradient ``g`` (0 where
    ignored): a = g, b = g (1 - eps), c = g eps / V."""
    eps = label_smoothing
    return torch.stack([lse, g, g * (1.0 - eps), g * (eps / vocab_size)]).contiguous()


def fold_grad_logits_torch(z: torch.Tensor, local_labels: torch.Tensor, state: torch.Tensor, ws: torch.Tensor,
                           label_smoothing: float, vocab_size: int) -> torch.Tensor:
    """Fold ``z`` [n, b] into a fresh ``state`` [4, n] (overwritten), then return the gradient of the
    loss for the per-token upstream gradient ``ws`` [n] (fp32, 0 where ignored).

    For a block holding every logit of its rows (one rank's whole vocabulary), whose log-sum-exp is
    therefore complete after the fold: the same numbers as ``fold_logits_torch`` followed by
    ``grad_logits_torch`` with ``grad_coefficients``.
    """
    state[0].fill_(float("-inf"))
    state[1:].zero_()
    fold_logits_torch(z, local_labels, state)
    lse = state[0] + torch.log(state[1])
    return grad_logits_torch(z, local_labels, grad_coefficients(lse, ws, label_smoothing, vocab_size))
