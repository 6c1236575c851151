"""A row-wise function applied over slices of rows (dim 0), written into one output, autograd intact.

Transformer Engine's norm kernels address [rows, hidden] with 32-bit int offsets (``planner.te_limits``); a norm
is row-wise, so running it on slices of the rows changes no value, and the weight and bias gradients, sums over
rows, are summed across the slices by autograd. ``row_sliced`` keeps the forward peak at the output plus one
slice's output (no ``torch.cat`` of every slice), and its backward hands each slice's rows of the output gradient
to that slice's own backward, so the norm's backward kernel also runs per slice.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["row_sliced", "slice_length"]


class _WriteRows(torch.autograd.Function):
    """``out[start:stop] = y`` in place on ``out`` (marked dirty). Backward passes the output gradient on to the
    earlier writes unchanged (no copy: each write reads only its own rows of it, and the rows are disjoint) and
    its rows to ``y``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, y: torch.Tensor, start: int) -> torch.Tensor:  # noqa: ANN001
        ctx.start, ctx.stop = start, start + y.shape[0]
        ctx.out_needs_grad = out.requires_grad
        out[ctx.start:ctx.stop].copy_(y)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, None]:  # noqa: ANN001
        return (grad if ctx.out_needs_grad else None), grad[ctx.start:ctx.stop], None


def slice_length(batch: int, max_rows: int) -> int:
    """The sequence positions per slice of an [s, b, ...] input such that positions x ``batch`` <= ``max_rows``."""
    if max_rows < batch:
        raise ValueError(f"a slice of one position holds {batch} rows, past the {max_rows} rows allowed at once")
    return max_rows // batch


def row_sliced(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` (each row of the output depends on the same row of ``x`` alone), computed
    over slices of dim 0 with at most ``max_rows`` rows each, where a row is one index of every dim but the last
    (x [s, b, h]: slices of s, slice x b <= ``max_rows``). Equal to ``fn(x)``, gradients included; the output is
    allocated once and each slice written into it, so the forward holds the output and one slice's output."""
    rows_per_position = 1
    for d in x.shape[1:-1]:
        rows_per_position *= d
    step = slice_length(rows_per_position, max_rows)
    n = x.shape[0]
    out: torch.Tensor | None = None
    for start in range(0, n, step):
        y = fn(x[start:start + step])
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"row_sliced needs a function returning one tensor, got {type(y).__name__}")
        if y.shape[0] != min(step, n - start):
            raise ValueError(f"row_sliced needs a row-wise function: {tuple(y.shape)} from {min(step, n - start)} rows")
        if out is None:
            out = torch.empty((n, *y.shape[1:]), dtype=y.dtype, device=y.device)
        out = _WriteRows.apply(out, y, start)
    assert out is not None, "row_sliced of an empty input"
    return out
