"""User-facing Ring-DTP: ``ring_linear_cross_entropy``."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import stats
from .blocks import block_ops
from .in_forward import InForwardLinearCrossEntropy, chunk_rows
from .ring import RingLinearCrossEntropy, RingPlan, auto_ring_schedule, comm_device, max_over_ring
from .sizes import AUTO_BLOCK_BYTES, AUTO_CHUNK_BYTES, auto_block_size, auto_chunk_tokens

__all__ = ["ring_linear_cross_entropy", "resolve_schedule", "schedule_reason", "SCHEDULES", "auto_block_size", "auto_chunk_tokens",
           "AUTO_BLOCK_BYTES", "AUTO_CHUNK_BYTES"]

log = logging.getLogger("megatron_peakflat")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


SCHEDULES = ("auto", "gather", "activations", "weights")
"""``schedule`` values: 'gather' is the in-forward gradients' collective schedule (``in_forward.py``), 'activations'
and 'weights' the rings of point-to-point sends (``ring.py``)."""


def resolve_schedule(schedule: str, max_tokens: int, vocab_size: int, ring_size: int, in_forward: bool = False) -> str:
    """The schedule that runs on a ring of ``ring_size`` > 1 ranks. With the gradients computed in the forward
    pass (``in_forward``): 'gather' (all-gathers of each chunk's tokens and of the log-sum-exp state, a
    reduce-scatter of dX; 'auto' and 'gather' take it, a ring schedule is refused). Otherwise a ring: 'auto'
    (and 'gather', whose loss-only pass has no gather form) -> 'activations' when the tokens per rank are no
    more than V/P (they are the smaller thing to move), else 'weights'."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {', '.join(repr(s) for s in SCHEDULES)}")
    if in_forward:
        if schedule in ("activations", "weights"):
            raise ValueError(f"schedule={schedule!r} with gradients computed with the loss: those run the 'gather' "
                             f"schedule; pass schedule='gather' (or 'auto'), or grad='recompute' for the {schedule} ring")
        return "gather"
    if schedule in ("activations", "weights"):
        return schedule
    return auto_ring_schedule(max_tokens, vocab_size, ring_size)


def schedule_reason(schedule: str, resolved: str, max_tokens: int, vocab_size: int, ring_size: int) -> str:
    """Why ``resolve_schedule`` (or a single rank) gave ``resolved`` for the requested ``schedule``: one
    clause for the log line that says which schedule ran."""
    if resolved == "single":
        return "one rank holds the whole vocabulary, nothing is exchanged"
    what = {"gather": "each chunk's hidden states and labels all-gathered, the log-sum-exp state all-gathered, "
                      "dX reduce-scattered",
            "activations": "tokens travel a ring of point-to-point sends, gradients in backward",
            "weights": "weight shards travel a ring of point-to-point sends, gradients in backward"}[resolved]
    if schedule == resolved:
        return f"as asked ({what})"
    if resolved == "gather":
        return f"auto: the gradients are computed with the loss ({what})"
    cmp = "<=" if resolved == "activations" else ">"
    why = f"{max_tokens} tokens per rank x {ring_size} {cmp} V={vocab_size}"
    if schedule == "gather":
        return f"gather asked, but the gradients are not computed with the loss here, so the ring auto picks: {why} ({what})"
    return f"auto: {why} ({what})"


def ring_linear_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group: object | None = None,
    *,
    schedule: str = "auto",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "none",
    block_size: int = 0,
    kernel: str = "auto",
    accumulate: str = "fp32",
    vocab_size: int | None = None,
    check_labels: bool = False,
    dw_into_main_grad: bool = False,
    weight_shared: bool = False,
    grad: str = "recompute",
    grad_hint: float | torch.Tensor | None = None,
    chunk_tokens: int = 0,
    return_argmax: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ W.T`` where W's rows are sharded over ``group``; the logits never exist.

    - ``hidden`` [n, h]: this rank's tokens (n may differ between ranks).
    - ``weight_shard`` [v_p, h]: rows [sum of lower ranks' v_p, + v_p) of the vocabulary (Megatron's
      vocab-parallel layout; shard sizes may differ).
    - ``labels`` [n]: global vocabulary ids or ``ignore_index``.
    - ``group``: the ring; None or a 1-rank group is the single-device path.
    - ``schedule``: how the ranks meet every token (``resolve_schedule``): 'activations' or 'weights' travel
      a ring of point-to-point sends (gradients in backward); 'gather' is the in-forward gradients' schedule
      of collectives; 'auto' picks. ``stats`` records the one that ran and why (``schedule_reason``).

    Returns the loss per token (fp32, 0 for ignored tokens) for ``reduction='none'``, else its sum or
    its mean over non-ignored tokens. The result equals ``F.cross_entropy(hidden @ W.T, labels, ...)``
    (PyTorch's label-smoothing definition) and so do the gradients of ``hidden`` and ``weight_shard``,
    up to the summation order. The working set is ``n x block_size`` logits plus O(n) state per step.

    ``block_size`` rows of the shard are folded at a time (0: rows such that one block of logits is
    about ``AUTO_BLOCK_BYTES``). ``accumulate='fp32'`` sums dX over vocabulary blocks (and dW over ring
    steps) in fp32; ``'input'`` sums in the gradients' dtype, one rounding per block, which keeps bf16
    training at the gradient floor (no fp32 copy of dX) at a small cost in bf16 rounding.

    ``dw_into_main_grad``: when ``weight_shard`` is a parameter that Megatron's DDP gave a ``main_grad``
    (``main_grad.py``), dW is added into it and the returned weight gradient is a placeholder (no memory):
    no fp32 dW accumulator nor a dW in the weight's dtype is built. Only for a weight whose whole
    gradient is this loss's, unless ``weight_shared``: the weight also gets gradients through autograd
    elsewhere (an embedding tied to it); then dW is added into ``main_grad`` and no weight gradient is
    returned, so DDP's hook still adds the others (``main_grad.release``). Without ``main_grad`` neither
    changes anything.

    ``grad='in-forward'`` (``in_forward.py``) computes dX and dW in the forward pass, a chunk of
    ``chunk_tokens`` tokens (over the whole ring; 0: ``sizes.auto_chunk_tokens``, at most h tokens, 2 GiB
    of logits and 1/8 of the tokens) at a time: 6NHV instead of the recompute's 8NHV, one [chunk, V/P] block of logits instead of an
    [n, block_size] one. It needs the gradient that the result will receive, ``grad_hint``: a number,
    or [n] per token for ``reduction='none'`` (default 1.0: the result is summed, or is the scalar loss).
    Backward checks the hint (one host sync) and adds the difference by recomputing when it was wrong,
    so the gradients are always those of the real upstream gradient. Without autograd (``no_grad`` or
    nothing requiring grad) only the loss is computed. dW goes into ``main_grad`` with
    ``dw_into_main_grad``, else into an accumulator in ``accumulate``'s dtype, held from forward to backward.

    ``return_argmax``: also return each token's argmax vocabulary id [n] (int64; ties to the lowest id, as
    ``torch.argmax`` of the whole logits row), kept while the recompute schedule folds the blocks, at the
    cost of one more read of each block; returns ``(loss, argmax)``. Needs ``grad='recompute'``.

    ``vocab_size`` (optional) is checked against the sum of the shards, to catch a ``group`` that does
    not match the weight sharding. ``check_labels`` checks every label (one host sync, collective).
    Labels outside [0, V) are otherwise not detected: they behave as if their target logit were 0.
    """
    _check_arguments(hidden, weight_shard, labels, schedule=schedule, reduction=reduction, label_smoothing=label_smoothing,
                     block_size=block_size, accumulate=accumulate, grad=grad, chunk_tokens=chunk_tokens,
                     return_argmax=return_argmax, grad_hint=grad_hint)
    size = 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)
    rank = 0 if size == 1 else dist.get_rank(group)
    labels = labels.long().contiguous()
    valid = labels != ignore_index
    tokens, shard_rows = _ring_layout(hidden, weight_shard, group, size)
    V = sum(shard_rows)
    if vocab_size is not None and V != vocab_size:
        raise ValueError(f"the {size} shards of group hold {V} vocabulary rows ({list(shard_rows)}), not "
                         f"vocab_size={vocab_size}: the group does not match the weight sharding")
    if check_labels:
        _check_label_range(labels, valid, V, ignore_index, group if size > 1 else None, hidden.device)

    if block_size == 0:
        block_size = auto_block_size(max(tokens), hidden.element_size())
    in_forward = grad == "in-forward" and torch.is_grad_enabled() and (hidden.requires_grad or weight_shard.requires_grad)
    if in_forward and chunk_tokens == 0:
        chunk_tokens = auto_chunk_tokens(max(shard_rows), hidden.element_size(), size, sum(tokens), hidden.shape[1])
    resolved = resolve_schedule(schedule, max(tokens), V, size, in_forward) if size > 1 else "single"
    plan = RingPlan(
        group=group if size > 1 else None, rank=rank, size=size, tokens=tokens, shard_rows=shard_rows,
        schedule=resolved,
        block_size=block_size, ignore_index=ignore_index, label_smoothing=float(label_smoothing),
        ops=block_ops(kernel, hidden.device), acc_dtype_fp32=accumulate == "fp32",
        dw_into_main_grad=dw_into_main_grad, weight_shared=weight_shared, chunk_rows=chunk_rows(chunk_tokens, size) if in_forward else 0,
        argmax=return_argmax,
    )
    stats.record("vocab", "schedule", plan.schedule)
    stats.record("vocab", "schedule_reason", schedule_reason(schedule, plan.schedule, max(tokens), V, size))
    stats.record("vocab", "kernel", plan.ops.name)
    stats.record("vocab", "grad", "in-forward" if in_forward else "recompute")
    if in_forward:
        # a chunk takes up to chunk_rows tokens of each ring rank, never more than the rank has
        stats.peak("vocab", "block_logits_bytes", sum(min(plan.chunk_rows, t) for t in tokens) * shard_rows[rank] * 4)
    else:
        folded_tokens = max(tokens) if plan.schedule == "activations" else hidden.shape[0]  # visitors, or own
        stats.peak("vocab", "block_logits_bytes", folded_tokens * min(block_size, max(shard_rows)) * 4)
    stats.add("vocab", "calls", 1)

    eff_labels = torch.where(valid, labels, torch.full_like(labels, -1))
    if in_forward:
        hint = _per_token_hint(grad_hint, reduction, valid)
        loss = InForwardLinearCrossEntropy.apply(hidden.contiguous(), weight_shard.contiguous(), eff_labels, valid,
                                                 hint, plan)
    else:
        loss = RingLinearCrossEntropy.apply(hidden.contiguous(), weight_shard.contiguous(), eff_labels, valid, plan)
    pred = None
    if return_argmax:
        loss, pred = loss
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum()
    return loss if pred is None else (loss, pred)


def _check_arguments(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor, *, schedule: str, reduction: str,
                     label_smoothing: float, block_size: int, accumulate: str, grad: str, chunk_tokens: int,
                     return_argmax: bool, grad_hint: float | torch.Tensor | None) -> None:
    """Raise ValueError, naming the argument and the fix, for anything ``ring_linear_cross_entropy`` refuses
    on this rank alone (before any collective)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [n, h], got shape {tuple(hidden.shape)}")
    if weight_shard.dim() != 2 or weight_shard.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight_shard must be [v_p, h={hidden.shape[1]}], got {tuple(weight_shard.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [n={hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer class ids, got {labels.dtype}")
    if hidden.dtype != weight_shard.dtype or hidden.dtype not in _DTYPES:
        raise ValueError(f"hidden ({hidden.dtype}) and weight_shard ({weight_shard.dtype}) must share one float dtype")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction={reduction!r}: use 'none', 'sum' or 'mean'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: must lie in [0, 1]")
    if block_size < 0:
        raise ValueError(f"block_size={block_size}: must be positive (or 0 for automatic)")
    if accumulate not in ("fp32", "input"):
        raise ValueError(f"accumulate={accumulate!r}: use 'fp32' or 'input'")
    if grad not in ("recompute", "in-forward"):
        raise ValueError(f"grad={grad!r}: use 'recompute' or 'in-forward'")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {', '.join(repr(s) for s in SCHEDULES)}")
    if grad == "in-forward" and schedule in ("activations", "weights"):
        raise ValueError(f"schedule={schedule!r} with grad='in-forward': the in-forward gradients run the 'gather' "
                         f"schedule; pass schedule='gather' (or 'auto'), or grad='recompute' for the {schedule} ring")
    if grad == "recompute" and schedule == "gather":
        raise ValueError("schedule='gather' with grad='recompute': the gather schedule computes the gradients with "
                         "the loss; pass grad='in-forward', or schedule='auto', 'activations' or 'weights'")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be positive (or 0 for automatic)")
    if return_argmax and grad != "recompute":
        raise ValueError("return_argmax=True needs grad='recompute' (the in-forward schedule does not keep argmaxes)")
    if isinstance(grad_hint, torch.Tensor) and grad_hint.numel() != 1 and (
            reduction != "none" or grad_hint.shape != labels.shape):
        raise ValueError(f"grad_hint of shape {tuple(grad_hint.shape)}: give a number, or one value per token "
                         f"([n={labels.shape[0]}]) with reduction='none'")


def _ring_layout(hidden: torch.Tensor, weight_shard: torch.Tensor, group: object | None,
                 size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tokens, vocabulary rows) of every ring rank, from one all-gather of each rank's shapes; raises when the
    ranks disagree on the hidden size or dtype, which would otherwise hang or corrupt the ring's exchanges."""
    meta = torch.tensor([hidden.shape[0], hidden.shape[1], _DTYPES.index(hidden.dtype), weight_shard.shape[0]],
                        dtype=torch.long)
    if size > 1:
        dev = comm_device(hidden.device, group)
        gathered = [torch.empty_like(meta, device=dev) for _ in range(size)]
        dist.all_gather(gathered, meta.to(dev), group=group)
        rows = [t.cpu().tolist() for t in gathered]
    else:
        rows = [meta.tolist()]
    if len({r[1] for r in rows}) > 1 or len({r[2] for r in rows}) > 1:
        raise ValueError("ring ranks disagree on the hidden size or dtype: "
                         + ", ".join(f"rank {i}: h={r[1]} {_DTYPES[r[2]]}" for i, r in enumerate(rows))
                         + "; every rank of the ring group must pass hidden states of the same model")
    return tuple(r[0] for r in rows), tuple(r[3] for r in rows)


def _check_label_range(labels: torch.Tensor, valid: torch.Tensor, V: int, ignore_index: int,
                       group: object | None, device: torch.device) -> None:
    """Raise on any label outside [0, V) that is not ``ignore_index``, on every ring rank if any rank has one
    (one host sync and one all-reduce)."""
    bad = valid & ((labels < 0) | (labels >= V))
    local = int(bad.sum())
    example = int(labels[bad][0]) if local else None
    if max_over_ring(torch.tensor(local), group, device):
        where = f"{local} here, e.g. {example}" if local else "on another ring rank"
        raise ValueError(f"labels outside [0, {V}) that are not ignore_index={ignore_index} ({where}); "
                         "fix the data or the vocabulary size")


def _per_token_hint(grad_hint: float | torch.Tensor | None, reduction: str, valid: torch.Tensor) -> torch.Tensor:
    """The gradient each token's loss will get, [n] fp32, from the gradient the result will get."""
    hint = torch.as_tensor(1.0 if grad_hint is None else grad_hint, dtype=torch.float32, device=valid.device)
    if reduction == "mean":
        hint = hint / valid.sum()
    return hint.expand(valid.shape).contiguous() if hint.numel() == 1 else hint.reshape(valid.shape).contiguous()
