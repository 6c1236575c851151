"""The host engine's AdamW on flat fp32 buffers: the native kernel, or torch's fused CPU AdamW.

Both compute ATen's fused AdamW arithmetic (decoupled weight decay, bias correction, amsgrad off) and
agree bitwise except on a few elements per call, by an ulp, where the two builds fuse a multiply-add
differently; which buffer and elements depends on the CPU's vector width (on an AVX-512 CPU:
``exp_avg_sq`` in ATen's scalar tail, the last n mod 16 elements of a call).
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal

import torch

__all__ = ["host_adamw_"]


def host_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                param_out: torch.Tensor | None, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, threads: int | None,
                ext: ModuleType | None, impl: Literal["auto", "native", "torch"] = "auto") -> None:
    """One AdamW step in place on contiguous 1-D CPU tensors; ``param_out`` (optional) gets the new param.

    ``step`` is the step number after increment (1 on the first step), as torch.optim.AdamW uses it.
    """
    if impl == "native" and ext is None:
        raise RuntimeError("host_adamw_(impl='native') needs megatron_peakflat._C (see megatron_peakflat._ext)")
    if ext is not None and impl != "torch":
        ext.adamw_step(param, grad, exp_avg, exp_avg_sq, param_out, float(lr), float(beta1), float(beta2),
                       float(eps), float(weight_decay), float(step), int(threads or 0))
        return
    g = grad if grad.dtype == torch.float32 else grad.float()
    torch._fused_adamw_([param], [g], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=float(lr),
                        beta1=float(beta1), beta2=float(beta2), weight_decay=float(weight_decay), eps=float(eps),
                        amsgrad=False, maximize=False)
    if param_out is not None:
        param_out.copy_(param)
