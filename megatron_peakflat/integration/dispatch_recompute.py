"""Under a checkpoint's recompute, give PipelinedLLEP the gradient its output will receive.

Megatron's full recompute (and ``--recompute-modules moe``) re-runs a checkpointed function's
forward inside ``CheckpointFunction.backward``, when the gradient of the function's output is
already known. The last MoE layer inside the function feeds only the residual add that produces
that output, so the MoE output's gradient is the output gradient itself. Given it, PipelinedLLEP
runs each chunk's forward and backward back to back in the recompute (``dispatch.pipelined``)
instead of recomputing its chunks once more in its own backward: one expert forward less per layer.

Two registry entries wrap ``CheckpointFunction.forward`` (note the last PeakflatDispatcher called
inside it, on its autograd context) and ``CheckpointFunction.backward`` (make the output gradient
and that dispatcher current while the recompute runs). The assumption is checked where it matters:
the MoE backward compares the gradient it receives with the one assumed and, if they differ
(dropout after the MoE, a dense layer after the last MoE layer), adds the difference exactly and
stops assuming for that layer, with one log line.

Once a layer's assumed gradient has been found exact, its later recomputes skip the MoE output
itself (``need_output=False``: zeros in its place). The output's values matter to a recompute only
through what reads them inside the checkpointed function; every such reader between the MoE and
the checkpoint's output (a norm, a dropout, a dense layer) would also have changed the gradient, so
an exact match leaves only the residual add, whose result ``CheckpointFunction.backward`` uses as a
root of ``torch.autograd.backward`` and never reads. The match is checked on every call and is the
same on every rank of the expert-parallel group (its comparison is all-reduced there).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import state
from .logs import info_once

__all__ = ["wrap_checkpoint_forward", "wrap_checkpoint_backward", "record_call", "known_output_grad", "disable",
           "in_recompute"]

_recorders: list[list[Any]] = []
_pending: list[list[Any]] = []  # [output gradient, dispatcher it is meant for (None once used)]


def _enabled() -> bool:
    cfg = state.get()
    return cfg is not None and cfg.dispatch.impl == "pipelined-llep" and cfg.dispatch.fuse_recompute


def wrap_checkpoint_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """CheckpointFunction.forward, noting on ``ctx`` the last PeakflatDispatcher that ran inside."""

    @functools.wraps(original)
    def forward(ctx: Any, run_function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
        if not _enabled():
            return original(ctx, run_function, distribute_saved_activations, *args)
        _recorders.append([])
        try:
            outputs = original(ctx, run_function, distribute_saved_activations, *args)
        finally:
            calls = _recorders.pop()
        ctx.peakflat_last_moe = calls[-1] if calls else None
        return outputs

    return forward


def wrap_checkpoint_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    """CheckpointFunction.backward, with its output gradient offered to the last MoE layer of its recompute."""

    @functools.wraps(original)
    def backward(ctx: Any, *grads: Any) -> Any:
        target = getattr(ctx, "peakflat_last_moe", None)
        if target is None or not grads or not torch.is_tensor(grads[0]) or not _enabled():
            return original(ctx, *grads)
        _pending.append([grads[0], target])
        try:
            return original(ctx, *grads)
        finally:
            _pending.pop()

    return backward


def record_call(dispatcher: Any) -> None:
    """Note that ``dispatcher`` ran inside the innermost checkpoint being run forward (if any)."""
    if _recorders:
        _recorders[-1].append(dispatcher)


def in_recompute() -> bool:
    """Whether a checkpoint's recompute that offers its output gradient to a MoE layer is running: the only
    place a fused recompute can happen (without recompute there is none to turn off, or to log)."""
    return bool(_pending)


def known_output_grad(dispatcher: Any, out_like: torch.Tensor) -> torch.Tensor | None:
    """The gradient ``dispatcher``'s output [T, H] will receive, when a recompute knows it; else None.

    Given once per recompute, to the dispatcher the checkpoint's forward saw last, and only while
    that dispatcher has not been found wrong (``disable``).
    """
    if not _pending or getattr(dispatcher, "peakflat_fuse_off", False):
        return None
    entry = _pending[-1]
    grad, target = entry
    if target is not dispatcher or grad.numel() != out_like.numel():
        return None
    entry[1] = None
    return grad.reshape(out_like.shape).to(out_like.dtype)


def disable(dispatcher: Any, why: str) -> None:
    """Stop offering gradients to ``dispatcher`` (its output gradient was not the checkpoint's)."""
    dispatcher.peakflat_fuse_off = True
    info_once(f"peakflat dispatch: fused recompute off for a MoE layer: {why}")
