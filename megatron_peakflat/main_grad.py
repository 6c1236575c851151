"""Weight gradients straight into Megatron DDP's fp32 ``main_grad``, as gradient-accumulation fusion does.

Megatron's DDP gives each parameter an fp32 ``main_grad`` view of its gradient buffer and adds
``param.grad`` into it from a hook, unless ``param.grad_added_to_main_grad`` is set. A kernel that adds
its weight gradient into ``main_grad`` itself (in fp32, no rounding to the parameter's dtype) then
needs no gradient tensor or fp32 accumulator of its own; it hands autograd a zero placeholder, so the
hook still fires once (DDP counts every parameter's gradient before it reduces a bucket) and adds
nothing. (Autograd's AccumulateGrad densifies the placeholder into one zero tensor of the weight's
size and dtype, which the hook frees at once, as with the dummy of Megatron's own gradient-
accumulation fusion.)

Only for parameters whose whole gradient comes from that kernel: a parameter that also receives a
gradient through autograd elsewhere (a tied embedding) would lose that part.
"""

from __future__ import annotations

import torch

__all__ = ["main_grad_of", "handed_to_main_grad"]


def main_grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """Megatron DDP's fp32 gradient buffer of ``p``, when it has one and its hook honours ``grad_added_to_main_grad``."""
    if hasattr(p, "grad_added_to_main_grad"):
        return getattr(p, "main_grad", None)
    return None


def handed_to_main_grad(p: torch.Tensor) -> torch.Tensor:
    """Mark ``p``'s gradient as already in ``main_grad``; returns the zero placeholder to give autograd."""
    p.grad_added_to_main_grad = True
    return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
