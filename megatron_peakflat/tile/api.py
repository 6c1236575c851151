"""The tiled sublayer's entry point: the single-rank schedule, or the context-parallel one under a CP group."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .attention import TiledSelfAttention
from .context_parallel import TiledSelfAttentionCP, group_size
from .ops import TileOps

__all__ = ["tiled_self_attention"]


def tiled_self_attention(x: torch.Tensor, ops: TileOps, tile: int, params: Sequence[torch.Tensor],
                         cp_group: Any = None) -> torch.Tensor:
    """``TiledSelfAttention.apply`` with the parameters deduplicated (a shared parameter is one input). With a
    context-parallel group of more than one rank, x is this rank's share of the sequence in Megatron's
    load-balanced layout and ``context_parallel.TiledSelfAttentionCP`` runs (tiles within each of its two
    chunks, K and V gathered over the group)."""
    if tile < 1:
        raise ValueError(f"tile must be at least 1 token, got {tile}")
    seen: set[int] = set()
    unique = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    if group_size(cp_group) > 1:
        return TiledSelfAttentionCP.apply(x, ops, int(tile), cp_group, *unique)
    return TiledSelfAttention.apply(x, ops, int(tile), *unique)
