"""One rank's work on one vocabulary shard, a block of ``block_size`` rows at a time.

``fold_shard`` is the forward step (matmul + online log-sum-exp); ``grad_shard`` is the backward
step (recompute the block, its softmax gradient, then dX and dW by matmul). The working set is one
block of logits, ``n x block_size``, whatever the shard size: the [n, v_p] logits never exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..matmul import accumulate_mm
from .block_torch import fold_grad_logits_torch, fold_logits_torch, grad_logits_torch

__all__ = ["BlockOps", "block_ops", "fold_shard", "fold_argmax", "grad_shard"]


@dataclass(frozen=True)
class BlockOps:
    """The block kernels of one implementation (``block_torch.py`` or ``block_triton.py``): fold, grad,
    and both at once for a block whose rows hold their whole vocabulary (``fold_grad``)."""

    name: str
    fold: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    fold_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]


def block_ops(kernel: str, device: torch.device) -> BlockOps:
    """Resolve ``kernel`` ('auto' | 'triton' | 'torch') for tensors on ``device``."""
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel={kernel!r}: use 'auto', 'triton' or 'torch'")
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return BlockOps("torch", fold_logits_torch, grad_logits_torch, fold_grad_logits_torch)
    if device.type != "cuda":
        raise ValueError(f"kernel='triton' needs CUDA tensors, got {device}; use kernel='torch' or 'auto'")
    from .block_triton import fold_grad_logits_triton, fold_logits_triton, grad_logits_triton

    return BlockOps("triton", fold_logits_triton, grad_logits_triton, fold_grad_logits_triton)


def fold_shard(x: torch.Tensor, w: torch.Tensor, vocab_start: int, labels: torch.Tensor, state: torch.Tensor,
               block_size: int, ops: BlockOps) -> None:
    """Fold the logits ``x @ w.T`` of shard rows [vocab_start, vocab_start + len(w)) into ``state``; a
    [6, n] state (``ring.new_state(argmax=True)``) also keeps each token's argmax (``fold_argmax``)."""
    lse_state = state[:4]  # the kernels' [4, n] rows (a contiguous view: the argmax rows follow them)
    for b0 in range(0, w.shape[0], block_size):
        wb = w[b0:b0 + block_size]
        z = x @ wb.t()
        ops.fold(z, labels - (vocab_start + b0), lse_state)
        if state.shape[0] > 4:
            fold_argmax(z, vocab_start + b0, state)
        del z


def fold_argmax(z: torch.Tensor, start: int, state: torch.Tensor) -> None:
    """Merge block ``z`` [n, b] (vocabulary ids from ``start``) into the (largest logit, its id) rows 4-5 of
    ``state``. Ties go to the lowest id, whatever order the blocks come in, which is what ``torch.argmax``
    over the whole row (the first maximal value) and Megatron's vocab-parallel argmax (lowest rank) give."""
    idx = z.argmax(dim=1)
    val = z.gather(1, idx[:, None]).squeeze(1).float()
    ids = (idx + start).float()  # exact below 2**24 ids
    best, best_id = state[4], state[5]
    take = (val > best) | ((val == best) & (ids < best_id))
    best.copy_(torch.where(take, val, best))
    best_id.copy_(torch.where(take, ids, best_id))


BlockHook = Optional[Callable[[int, int], None]]
"""Called with a block's rows [start, end) of the shard (``grad_shard``'s ``before_dw`` and ``dw_done``)."""


def grad_shard(x: torch.Tensor, w: torch.Tensor, vocab_start: int, labels: torch.Tensor, coef: torch.Tensor,
               dx_acc: torch.Tensor, dw: torch.Tensor, *, accumulate: bool, block_size: int, ops: BlockOps,
               before_dw: BlockHook = None, dw_done: BlockHook = None) -> None:
    """Add this shard's contribution to ``dx_acc`` [n, h] and write (or add, ``accumulate``) ``dw`` [v, h].

    Each block of logits is recomputed, turned into its gradient in place, then used by two matmuls.
    Without ``accumulate`` dW is written once per block by one GEMM over all n tokens (fp32 inside).
    ``before_dw(b0, b1)`` runs before a block's rows of ``dw`` are first touched (a ring waits there for them
    to arrive), ``dw_done(b0, b1)`` once they are final (a ring sends them on); neither changes the arithmetic.
    """
    for b0 in range(0, w.shape[0], block_size):
        wb = w[b0:b0 + block_size]
        b1 = b0 + wb.shape[0]
        d = ops.grad(x @ wb.t(), labels - (vocab_start + b0), coef)
        accumulate_mm(dx_acc, d, wb)
        if before_dw is not None:
            before_dw(b0, b1)
        rows = dw[b0:b1]
        if accumulate:
            accumulate_mm(rows, d.t(), x)
        else:
            torch.mm(d.t(), x, out=rows)
        del d
        if dw_done is not None:
            dw_done(b0, b1)
