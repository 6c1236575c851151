"""Several per-row tensors in one buffer, so that one all-to-all moves what several would.

A chunk's dispatch sends each token-expert pair's hidden row, its probability and (in the fused
backward) its output-gradient row to the same rank with the same splits; the combine sends back its
dX, dprob and output rows. Each all-to-all pays a fixed cost (measured on 2 H200s at EP=2: 36 NCCL
send/recv kernels for 4 chunks took 28-30 ms against 21-23 ms for the 9 of one chunk), so the pieces
travel as the columns of one [rows, width] buffer of the first piece's dtype: a wider dtype (fp32
probs beside bf16 rows) occupies whole columns through a dtype view, bit for bit. Each piece starts
16-byte aligned, and so does every row (the width is padded), as NCCL and the GEMMs prefer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["RowLayout", "row_layout"]

RowSpec = tuple[tuple[int, ...], torch.dtype]
"""One piece's shape per row (() for one value per row) and dtype."""

_ALIGN = 16


@dataclass(frozen=True)
class RowLayout:
    """Where each piece of a packed row lives: columns [start, start + cols) of a ``dtype`` buffer."""

    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    """Each piece's shape per row (() for one value per row)."""
    dtypes: tuple[torch.dtype, ...]
    starts: tuple[int, ...]
    cols: tuple[int, ...]
    width: int

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty((rows, self.width), dtype=self.dtype, device=device)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each piece as a view of ``buf`` [rows, width]: [rows, *shape] in its own dtype (strided rows)."""
        rows = buf.shape[0]
        out = []
        for shape, dt, a, c in zip(self.shapes, self.dtypes, self.starts, self.cols):
            v = buf[:, a:a + c]
            if dt != self.dtype:
                v = v.view(dt)
            out.append(v.reshape(rows, *shape) if shape else v.reshape(rows))
        return out


def row_layout(specs: Sequence[RowSpec]) -> RowLayout | None:
    """The packed layout of pieces with these per-row ``specs``, in the first one's dtype; None when a
    piece's row is not a whole number of that dtype's elements (then the pieces travel separately)."""
    base = specs[0][1]
    es = base.itemsize
    shapes, dtypes, starts, cols = [], [], [], []
    at = 0
    for shape, dt in specs:
        pes = dt.itemsize
        row_bytes = math.prod(shape) * pes
        if row_bytes % es or pes > _ALIGN or dt.is_complex:
            return None
        at = -(-at * es // _ALIGN) * _ALIGN // es
        shapes.append(tuple(shape))
        dtypes.append(dt)
        starts.append(at)
        cols.append(row_bytes // es)
        at += row_bytes // es
    width = -(-at * es // _ALIGN) * _ALIGN // es
    return RowLayout(base, tuple(shapes), tuple(dtypes), tuple(starts), tuple(cols), width)
