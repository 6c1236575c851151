"""Triton block kernels: the operations of ``block_torch.py``, each in one pass over the block.

The logits block itself comes from a cuBLAS matmul (fp32 accumulation inside the GEMM); these
kernels read it once (fold), read and overwrite it in place with its gradient (grad), or do both for
a block whose row state is complete once it is folded (fold_grad: a single rank's whole vocabulary).
No fp32 copy of a block is made. Imported lazily: only on CUDA.

The fold keeps one running max per row, raised once per column chunk, so each logit costs one
``exp`` (a per-element running max costs two, and the exponentials, not the memory, then bound the
pass). Launch shapes: ``tools/probes/vocab_kernels.py`` (results in docs/evidence/probes/vocab_kernels.json).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["KernelShape", "SHAPES", "fold_logits_triton", "grad_logits_triton", "fold_grad_logits_triton"]


@dataclass(frozen=True)
class KernelShape:
    """Columns per step and warps per row-program of one kernel."""

    cols: int
    warps: int


SHAPES: dict[str, KernelShape] = {
    "fold": KernelShape(2048, 4),
    "grad": KernelShape(4096, 8),
    "fold_grad": KernelShape(2048, 4),
}
"""Per-kernel launch shapes, the fastest measured on an H200 for a [4096, 201088] bf16 block."""


@triton.jit
def _fold_row(zrow, lab, ncols, COLS: tl.constexpr):
    """(max, sum of exp(z - max), target logit, sum of logits) of one row; one exp per element."""
    m = tl.full([], float("-inf"), tl.float32)
    s_vec = tl.zeros([COLS], tl.float32)
    zs_vec = tl.zeros([COLS], tl.float32)
    for c0 in range(0, ncols, COLS):
        cols = c0 + tl.arange(0, COLS)
        msk = cols < ncols
        z = tl.load(zrow + cols, mask=msk, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m - ref) + tl.exp(z - ref)
        m = m_new
        zs_vec += tl.where(msk, z, 0.0)
    s = tl.sum(s_vec, axis=0)
    inb = (lab >= 0) & (lab < ncols)
    t = tl.where(inb, tl.load(zrow + tl.where(inb, lab, 0)).to(tl.float32), 0.0)
    return m, s, t, tl.sum(zs_vec, axis=0)


@triton.jit
def _fold_kernel(z_ptr, stride_z, lab_ptr, state_ptr, n, ncols, COLS: tl.constexpr):
    row = tl.program_id(0)
    zrow = z_ptr + row.to(tl.int64) * stride_z
    bm, bs, bt, bzs = _fold_row(zrow, tl.load(lab_ptr + row), ncols, COLS)
    m_old = tl.load(state_ptr + row)
    s_old = tl.load(state_ptr + n + row)
    m_all = tl.maximum(m_old, bm)
    s_all = (tl.where(m_old == float("-inf"), 0.0, s_old * tl.exp(m_old - m_all))
             + tl.where(bm == float("-inf"), 0.0, bs * tl.exp(bm - m_all)))
    tl.store(state_ptr + row, m_all)
    tl.store(state_ptr + n + row, s_all)
    tl.store(state_ptr + 2 * n + row, tl.load(state_ptr + 2 * n + row) + bt)
    tl.store(state_ptr + 3 * n + row, tl.load(state_ptr + 3 * n + row) + bzs)


@triton.jit
def _grad_row(zrow, lab, lse, a, b, c, ncols, COLS: tl.constexpr, BACKWARD: tl.constexpr):
    steps = tl.cdiv(ncols, COLS)
    for i in range(0, steps):
        if BACKWARD:
            cols = (steps - 1 - i) * COLS + tl.arange(0, COLS)
        else:
            cols = i * COLS + tl.arange(0, COLS)
        msk = cols < ncols
        z = tl.load(zrow + cols, mask=msk, other=0.0).to(tl.float32)
        d = a * tl.exp(z - lse) - c - tl.where(cols == lab, b, 0.0)
        tl.store(zrow + cols, d.to(zrow.dtype.element_ty), mask=msk)


@triton.jit
def _grad_kernel(z_ptr, stride_z, lab_ptr, coef_ptr, n, ncols, COLS: tl.constexpr):
    row = tl.program_id(0)
    zrow = z_ptr + row.to(tl.int64) * stride_z
    _grad_row(zrow, tl.load(lab_ptr + row), tl.load(coef_ptr + row), tl.load(coef_ptr + n + row),
              tl.load(coef_ptr + 2 * n + row), tl.load(coef_ptr + 3 * n + row), ncols, COLS, False)


@triton.jit
def _fold_grad_row(z_ptr, stride_z, lab_ptr, ws_ptr, state_ptr, n, ncols, keep, spread, row, COLS: tl.constexpr,
                   BACKWARD: tl.constexpr):
    zrow = z_ptr + row.to(tl.int64) * stride_z
    lab = tl.load(lab_ptr + row)
    m, s, t, zs = _fold_row(zrow, lab, ncols, COLS)
    tl.store(state_ptr + row, m)
    tl.store(state_ptr + n + row, s)
    tl.store(state_ptr + 2 * n + row, t)
    tl.store(state_ptr + 3 * n + row, zs)
    g = tl.load(ws_ptr + row)
    _grad_row(zrow, lab, m + tl.log(s), g, g * keep, g * spread, ncols, COLS, BACKWARD)


@triton.jit
def _fold_grad_kernel(z_ptr, stride_z, lab_ptr, ws_ptr, state_ptr, n, ncols, keep, spread, COLS: tl.constexpr,
                      BACKWARD: tl.constexpr):
    # BACKWARD: the gradient pass starts at the columns the fold read last, the likeliest still in L2. The
    # same bits either way, and no faster: on an H200 the kernel ran 0.997x the forward walk's speed over 7
    # rounds in turn (1.046x in an earlier single round; docs/evidence/probes/vocab_fold_l2_probe.txt), the whole
    # call 0.999x its time (probes/vocab_fold_ab.txt).
    _fold_grad_row(z_ptr, stride_z, lab_ptr, ws_ptr, state_ptr, n, ncols, keep, spread, tl.program_id(0), COLS,
                   BACKWARD)


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
    sh = SHAPES["fold"]
    _fold_kernel[(z.shape[0],)](z, z.stride(0), local_labels.contiguous(), state, z.shape[0], z.shape[1],
                                COLS=sh.cols, num_warps=sh.warps)


def grad_logits_triton(z: torch.Tensor, local_labels: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``grad_logits_torch``; overwrites ``z`` with the gradient and returns it."""
    _check(z, local_labels, coef)
    if z.shape[0] == 0:
        return z
    sh = SHAPES["grad"]
    _grad_kernel[(z.shape[0],)](z, z.stride(0), local_labels.contiguous(), coef, z.shape[0], z.shape[1],
                                COLS=sh.cols, num_warps=sh.warps)
    return z


def fold_grad_logits_triton(z: torch.Tensor, local_labels: torch.Tensor, state: torch.Tensor, ws: torch.Tensor,
                            label_smoothing: float, vocab_size: int, *, backward_walk: bool = True) -> torch.Tensor:
    """Triton twin of ``fold_grad_logits_torch`` (same contract) in one kernel: each row is folded, then
    overwritten by its gradient (one launch, and the row's state never leaves the program).
    ``backward_walk=False`` walks the gradient pass first column to last: the same bits, for A/B timing."""
    _check(z, local_labels, state)
    if ws.shape != local_labels.shape or ws.dtype != torch.float32:
        raise ValueError(f"ws must be fp32 [{z.shape[0]}], got {tuple(ws.shape)} {ws.dtype}")
    if z.shape[0] == 0:
        return z
    sh = SHAPES["fold_grad"]
    _fold_grad_kernel[(z.shape[0],)](z, z.stride(0), local_labels.contiguous(), ws.contiguous(), state, z.shape[0],
                                     z.shape[1], 1.0 - label_smoothing, label_smoothing / vocab_size,
                                     COLS=sh.cols, BACKWARD=backward_walk, num_warps=sh.warps)
    return z
