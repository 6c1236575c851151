"""Triton kernel of ``combine.gather_sum``. Imported lazily: only on CUDA (or under TRITON_INTERPRET)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_sum_triton"]

_BLOCK = 1024


@triton.jit
def _gather_sum_kernel(rows_ptr, slots_ptr, out_ptr, H, stride_rows, stride_out, KK: tl.constexpr,
                       BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    optr = out_ptr + t.to(tl.int64) * stride_out + cols
    acc = tl.load(optr, mask=m, other=0.0).to(tl.float32)
    for s in tl.static_range(KK):
        r = tl.load(slots_ptr + t.to(tl.int64) * KK + s).to(tl.int64)
        acc += tl.load(rows_ptr + r * stride_rows + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=m)


def gather_sum_triton(rows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """``combine.gather_sum`` in one kernel: a program per (token, block of columns)."""
    if rows.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"rows and out need unit column stride, got {rows.stride()} and {out.stride()}")
    slots = slots.contiguous()
    T, H = out.shape
    grid = (T, triton.cdiv(H, _BLOCK))
    _gather_sum_kernel[grid](rows, slots, out, H, rows.stride(0), out.stride(0), KK=slots.shape[1], BLOCK=_BLOCK,
                             num_warps=4)
