"""Weight gradients straight into Megatron DDP's fp32 ``main_grad``, as gradient-accumulation fusion does.

Megatron's DDP gives each parameter an fp32 ``main_grad`` view of its gradient buffer and adds
``param.grad`` into it from a hook, unless ``param.grad_added_to_main_grad`` is set. A kernel that adds
its weight gradient into ``main_grad`` itself (in fp32, no rounding to the parameter's dtype) then
needs no gradient tensor or fp32 accumulator of its own; it hands autograd a placeholder, so the hook
still fires once (DDP counts every parameter's gradient before it reduces a bucket, and asserts that
``param.grad`` is set) and adds nothing.

The placeholder allocates nothing: it is ``main_grad``'s own storage seen in the parameter's dtype and
shape. It has the parameter's strides, so AccumulateGrad takes it as ``param.grad`` without a copy,
and DDP's hook drops it unread (``grad_added_to_main_grad``). Megatron's gradient-accumulation fusion
hands over an ``empty`` dummy of the weight's size instead, one transient weight-sized allocation per
parameter at the start of backward. Where the placeholder could be read (``param.grad`` already set,
or ``zero_out_wgrad``) it is a stride-0 zero tensor, which AccumulateGrad densifies into zeros.

A parameter that also receives gradients through autograd elsewhere (an output layer tied to the
input embedding, on the stage that also looks tokens up) must keep DDP's hook adding those: the kernel
adds its share into ``main_grad`` and returns no gradient for it (``None``), leaving the flag unset, so
the hook adds ``param.grad``, which holds only the other uses' gradients (``release``).
"""

from __future__ import annotations

import torch

__all__ = ["main_grad_of", "handed_to_main_grad", "release"]


def main_grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """Megatron DDP's fp32 gradient buffer of ``p``, when it has one and its hook honours ``grad_added_to_main_grad``."""
    if hasattr(p, "grad_added_to_main_grad"):
        return getattr(p, "main_grad", None)
    return None


def handed_to_main_grad(p: torch.Tensor) -> torch.Tensor:
    """Mark ``p``'s gradient as already in ``main_grad``; returns the placeholder to give autograd
    (see the module docstring): a no-allocation view of ``main_grad`` when nothing will read it."""
    p.grad_added_to_main_grad = True
    mg = p.main_grad
    unread = p.grad is None and not getattr(p, "zero_out_wgrad", False)
    if (unread and mg.is_contiguous() and p.is_contiguous() and mg.element_size() >= p.element_size()
            and mg.element_size() % p.element_size() == 0):
        # one view op less per parameter than flatten/reinterpret/slice/reshape: this runs for every expert
        # weight at the end of each MoE backward, while the GPU waits
        return mg.view(p.dtype).as_strided(p.shape, p.stride(), mg.storage_offset() * (mg.element_size() // p.element_size()))
    return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)


def release(p: torch.Tensor, shared: bool) -> torch.Tensor | None:
    """What a backward returns for ``p`` after adding its own gradient into ``p.main_grad``: nothing when
    ``shared`` (``p`` also gets gradients through autograd elsewhere, which DDP's hook must still add),
    else the placeholder of ``handed_to_main_grad``."""
    return None if shared else handed_to_main_grad(p)
