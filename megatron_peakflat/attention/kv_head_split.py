"""One attention over grouped K/V heads as one call per K/V head group (``calls.kv_head_calls``), for a core
attention that takes sbhd operands and returns [s, b, heads x head_dim]: the tiled sublayer's calls into Transformer
Engine's attention.

cuDNN's attention backward (TE's fused attention), like flash's, holds dK and dV at every query head of a call over
all its keys before summing them to the K/V heads (``planner/te_limits.gqa_expansion_bytes``). Each query head
attends only to its own K/V head, so ``calls`` calls of heads / calls query heads each compute the same output, and
one call's expansion is alive at a time in backward: a ``calls``-th of it. Plain torch; no Megatron import.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["attend_per_kv_head"]

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend_per_kv_head(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: int) -> torch.Tensor:
    """``attend`` over ``q`` [sq, b, heads, d], ``k``, ``v`` [sk, b, groups, d] as ``calls`` calls, each on a
    contiguous copy of its heads (``groups`` / ``calls`` K/V heads and their query heads); the outputs, each
    [sq, b, heads / calls x d], joined in head order into [sq, b, heads x d]. Equal to one call of ``attend`` where
    query head j uses K/V head j // (heads / groups), the grouping of Megatron and of Transformer Engine. ``split``,
    not slicing: one autograd node gathers the calls' dQ, dK and dV (a slice's backward zero-fills a whole one)."""
    heads, groups = q.shape[2], k.shape[2]
    if calls < 1 or groups % calls or heads % groups or v.shape[2] != groups:
        raise ValueError(f"{calls} calls over {heads} query heads and {groups} K/V heads (key {tuple(k.shape)}, "
                         f"value {tuple(v.shape)}): the calls must divide the K/V heads, which divide the query heads")
    if calls == 1:
        return attend(q, k, v).flatten(2)
    outs = [attend(qg.contiguous(), kg.contiguous(), vg.contiguous()).flatten(2)
            for qg, kg, vg in zip(q.split(heads // calls, dim=2), k.split(groups // calls, dim=2),
                                  v.split(groups // calls, dim=2))]
    return torch.cat(outs, dim=-1)
