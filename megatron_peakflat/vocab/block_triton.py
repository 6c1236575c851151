"""Triton block kernels: the same two operations as ``block_torch.py`` in one pass over the block.

The logits block itself comes from a cuBLAS matmul (fp32 accumulation inside the GEMM); these
kernels read it once (fold) or read and overwrite it in place with its gradient (grad), so a block
costs one extra HBM round trip and no fp32 copy. Imported lazily: only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fold_logits_triton", "grad_logits_triton"]

_COLS = 1024


@triton.jit
def _fold_kernel(z_ptr, stride_z, lab_ptr, state_ptr, n, ncols, COLS: tl.constexpr):
    row = tl.program_id(0)
    zrow = z_ptr + row.to(tl.int64) * stride_z
    lab = tl.load(lab_ptr + row)
    m_vec = tl.full([COLS], float("-inf"), tl.float32)
    s_vec = tl.zeros([COLS], tl.float32)
    zs_vec = tl.zeros([COLS], tl.float32)
    for c0 in range(0, ncols, COLS):
        cols = c0 + tl.arange(0, COLS)
        msk = cols < ncols
        z = tl.load(zrow + cols, mask=msk, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, z)
        scale = tl.where(m_vec == m_new, 1.0, tl.exp(m_vec - m_new))
        s_vec = s_vec * scale + tl.where(msk, tl.exp(z - m_new), 0.0)
        m_vec = m_new
        zs_vec += tl.where(msk, z, 0.0)
    bm = tl.max(m_vec, axis=0)
    bs = tl.sum(tl.where(m_vec == float("-inf"), 0.0, s_vec * tl.exp(m_vec - bm)), axis=0)
    m_old = tl.load(state_ptr + row)
    s_old = tl.load(state_ptr + n + row)
    m_all = tl.maximum(m_old, bm)
    s_all = tl.where(m_old == float("-inf"), 0.0, s_old * tl.exp(m_old - m_all)) + bs * tl.exp(bm - m_all)
    tl.store(state_ptr + row, m_all)
    tl.store(state_ptr + n + row, s_all)
    inb = (lab >= 0) & (lab < ncols)
    tz = tl.load(zrow + tl.where(inb, lab, 0)).to(tl.float32)
    t_old = tl.load(state_ptr + 2 * n + row)
    tl.store(state_ptr + 2 * n + row, t_old + tl.where(inb, tz, 0.0))
    zs_old = tl.load(state_ptr + 3 * n + row)
    tl.store(state_ptr + 3 * n + row, zs_old + tl.sum(zs_vec, axis=0))


@triton.jit
def _grad_kernel(z_ptr, stride_z, lab_ptr, coef_ptr, n, ncols, COLS: tl.constexpr):
    row = tl.program_id(0)
    zrow = z_ptr + row.to(tl.int64) * stride_z
    lab = tl.load(lab_ptr + row)
    lse = tl.load(coef_ptr + row)
    a = tl.load(coef_ptr + n + row)
    b = tl.load(coef_ptr + 2 * n + row)
    c = tl.load(coef_ptr + 3 * n + row)
    for c0 in range(0, ncols, COLS):
        cols = c0 + tl.arange(0, COLS)
        msk = cols < ncols
        z = tl.load(zrow + cols, mask=msk, other=0.0).to(tl.float32)
        d = a * tl.exp(z - lse) - c - tl.where(cols == lab, b, 0.0)
        tl.store(zrow + cols, d.to(z_ptr.dtype.element_ty), mask=msk)


def _check(z: torch.Tensor, local_labels: torch.Tensor, side: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"z must be a row-major 2-D block, got shape {tuple(z.shape)} strides {z.stride()}")
    n = z.shape[0]
    if local_labels.shape != (n,) or side.shape != (4, n) or side.dtype != torch.float32 or not side.is_contiguous():
        raise ValueError(f"labels {tuple(local_labels.shape)} / state {tuple(side.shape)} {side.dtype} do not match z {tuple(z.shape)}")


def fold_logits_triton(z: torch.Tensor, local_labels: torch.Tensor, state: torch.Tensor) -> None:
    """Triton twin of ``fold_logits_torch`` (same contract)."""
    _check(z, local_labels, state)
    if z.shape[0] == 0:
        return
    _fold_kernel[(z.shape[0],)](z, z.stride(0), local_labels.contiguous(), state, z.shape[0], z.shape[1],
                                COLS=_COLS, num_warps=4)


def grad_logits_triton(z: torch.Tensor, local_labels: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``grad_logits_torch``; overwrites ``z`` with the gradient and returns it."""
    _check(z, local_labels, coef)
    if z.shape[0] == 0:
        return z
    _grad_kernel[(z.shape[0],)](z, z.stride(0), local_labels.contiguous(), coef, z.shape[0], z.shape[1],
                                COLS=_COLS, num_warps=4)
    return z
