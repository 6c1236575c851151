"""What both tiled schedules share: the sublayer's three parts (``TileOps``), the tiles' starts, and the
parameters' gradients summed over the tiles in fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["TileOps", "tile_starts", "add_param_grads", "param_grads"]


@dataclass(frozen=True)
class TileOps:
    """The three parts of a self-attention sublayer, on tiles of the sequence (dim 0 of [s, b, ...]).

    - ``qkv(x_tile, start) -> (q [t, b, nq, d], k [t, b, nkv, d], v [t, b, nkv, d])``: input norm, QKV
      projection and RoPE for rows start .. start + t - 1 of x (their positions; under context parallelism
      the rows of the rank's share, whose rotary table Megatron has cut to them);
    - ``attend(q, k, v) -> o [t, b, nq * d]``: the queries are the last t positions of k and v; causal,
      aligned bottom right;
    - ``project(o, x_tile) -> y_tile``: output projection, bias and residual add (x_tile is the residual).

    Each must be deterministic given its inputs (no dropout in training): backward recomputes them.
    """

    qkv: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def tile_starts(seq: int, tile: int) -> list[int]:
    """The first position of each tile of ``tile`` tokens over ``seq`` tokens (the last one may be shorter)."""
    if tile < 1:
        raise ValueError(f"tile must be at least 1 token, got {tile}")
    return list(range(0, seq, tile))


def add_param_grads(params: Sequence[torch.Tensor], want: Sequence[int], got: Sequence[torch.Tensor | None],
                    sums: list[torch.Tensor | None], placeholder: list[torch.Tensor | None]) -> None:
    """Add one tile's gradients ``got`` of ``params[i] for i in want`` to their fp32 ``sums``; a parameter whose
    gradient the op wrote into ``main_grad`` itself (``grad_added_to_main_grad``) keeps the op's placeholder."""
    for i, g in zip(want, got):
        if g is None:
            continue
        if getattr(params[i], "grad_added_to_main_grad", False):
            placeholder[i] = g  # the op accumulated into main_grad itself; g is its placeholder
        elif sums[i] is None:
            sums[i] = g.to(torch.float32, copy=True)
        else:
            sums[i].add_(g)


def param_grads(params: Sequence[torch.Tensor], sums: Sequence[torch.Tensor | None],
                placeholder: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each parameter's gradient as backward returns it: its fp32 sum cast once to its dtype, or the placeholder."""
    return [acc.to(p.dtype) if acc is not None else ph for p, acc, ph in zip(params, sums, placeholder)]
