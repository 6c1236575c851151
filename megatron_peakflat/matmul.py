"""``acc += a @ b`` in place, accumulating in the accumulator's precision (shared by the vocabulary
projection's dX/dW and the dispatch's expert weight gradients into fp32 ``main_grad``).

With an fp32 accumulator and bf16 inputs, one cuBLAS GEMM with beta=1 and an fp32 output adds the
product unrounded (what Megatron's gradient-accumulation fusion does), rather than a bf16 product and
a separate add: one pass over the accumulator instead of three, and no bf16 rounding of the product.
"""

from __future__ import annotations

import torch

from . import stats

__all__ = ["accumulate_mm"]


def _acc_via_addmm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)


def _acc_via_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc.add_(torch.mm(a, b, out_dtype=acc.dtype))


def _acc_via_round(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc.add_(a @ b)


_CUDA_ACC_WAYS = {"addmm": _acc_via_addmm, "mm": _acc_via_mm, "round": _acc_via_round}
_CUDA_ACC_WAY: str | None = None
"""The first of ``_CUDA_ACC_WAYS`` that this torch supports, found by the first call."""


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place. Same dtypes: one GEMM with beta=1 (fp32 inside, one rounding to acc's
    dtype). An fp32 ``acc`` with low-precision inputs: the GEMM's fp32 result is added unrounded
    (``out_dtype`` on CUDA, upcast on CPU); only a torch without ``out_dtype`` rounds each block.
    Errors (out of memory included) propagate: a block is never skipped."""
    global _CUDA_ACC_WAY
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if not a.is_cuda:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
        return
    if _CUDA_ACC_WAY is None:
        for way in ("addmm", "mm"):
            try:
                _CUDA_ACC_WAYS[way](acc, a, b)
            except torch.OutOfMemoryError:
                raise
            except (TypeError, RuntimeError, NotImplementedError):  # no out_dtype for these dtypes here
                continue
            _CUDA_ACC_WAY = way
            break
        else:
            _acc_via_round(acc, a, b)
            _CUDA_ACC_WAY = "round"
        stats.record("matmul", "fp32_accumulate_via", _CUDA_ACC_WAY)
        return
    _CUDA_ACC_WAYS[_CUDA_ACC_WAY](acc, a, b)
