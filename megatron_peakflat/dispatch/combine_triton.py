"""Triton kernel of ``combine.gather_sum``. Imported lazily: only on CUDA (or under TRITON_INTERPRET)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_sum_triton"]

_BLOCK = 1024


@triton.jit
def _gather_sum_kernel(rows_ptr, perm_ptr, token_ptr, count_ptr, out_ptr, H, stride_rows, stride_out,
                       BLOCK: tl.constexpr):
    e = tl.program_id(0)
    n = tl.load(count_ptr + e)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (cols < H) & (n > 0)
    t = tl.load(token_ptr + e).to(tl.int64)
    optr = out_ptr + t * stride_out + cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(n):
        r = tl.load(perm_ptr + e + s).to(tl.int64)
        acc += tl.load(rows_ptr + r * stride_rows + cols, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(optr, mask=m, other=0.0).to(tl.float32)
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=m)


def gather_sum_triton(rows: torch.Tensor, perm: torch.Tensor, token: torch.Tensor, count: torch.Tensor,
                      out: torch.Tensor) -> None:
    """``combine.gather_sum`` in one kernel: a program per (entry, block of columns); entries that do
    not start a token's run load one count and store nothing."""
    if rows.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"rows and out need unit column stride, got {rows.stride()} and {out.stride()}")
    H = out.shape[1]
    grid = (perm.numel(), triton.cdiv(H, _BLOCK))
    _gather_sum_kernel[grid](rows, perm.contiguous(), token.contiguous(), count.contiguous(), out, H,
                             rows.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4)
