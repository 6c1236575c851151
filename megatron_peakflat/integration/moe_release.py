"""Drop the router probabilities that Megatron's alltoall token dispatcher keeps after its MoE layer's forward.

``MoEAlltoAllTokenDispatcher.dispatch_preprocess`` stores the router's probabilities as ``self.probs`` and
nothing clears them: the reference lives until the layer's next forward. The tensor carries its autograd graph.
Under full recompute that graph is the checkpoint's recomputed one, and it ends in the checkpoint's detached
inputs, which hold their gradients once backward has run. So after each MoE layer's backward, its checkpoint
input and that input's gradient ([tokens, hidden] each) stay alive through the backward of every layer below
it, and into the next iteration (measured on CPU with Megatron's GPTModel, and in the allocator trace of an
H200 run with an MTP layer: docs/known-gaps.md, "MTP layers").

The replacement drops the reference when the layer's forward returns. The probabilities are read only inside
that forward (the permutation, and the combine's dtype at TP > 1), and autograd keeps its own references, so the
loss and every gradient are unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["release_dispatcher_probs"]


def release_dispatcher_probs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``MoELayer.forward``: the original, then ``token_dispatcher.probs = None``."""

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        dispatcher = getattr(self, "token_dispatcher", None)
        if getattr(dispatcher, "probs", None) is not None:
            dispatcher.probs = None
        return out

    return forward
