"""Drop the per-forward state that Megatron's token dispatchers keep after they combine a MoE layer's tokens.

``MoEAlltoAllTokenDispatcher`` stores the router's probabilities (``self.probs``), and ``MoEAllGatherTokenDispatcher``
their local slice (``self.local_probs``); both store the routing map and the permutation map. Nothing clears them:
they live until the layer's next forward. The probabilities carry their autograd graph. Under recompute (full, or
``--recompute-modules moe``) that graph is the checkpoint's recomputed one, and it ends in the checkpoint's
detached inputs, which hold their gradients once backward has run. So after each MoE layer's backward, its
checkpoint input and that input's gradient ([tokens, hidden] each) stay alive through the backward of every layer
below it, through the optimizer step and into the next iteration (measured on CPU with Megatron's GPTModel, and in
the allocator trace of an H200 run with an MTP layer: docs/known-gaps.md, "MTP layers"). The maps ([tokens,
experts] and [tokens x top-k]) add up over the layers too, in every regime.

The replacement of ``combine_postprocess``, the last step of a dispatch that reads them, drops these references
when it returns. Autograd keeps its own references to what backward needs, so the loss and every gradient are
unchanged. Under CUDA graphs Megatron carries these attributes in and out of its graphs (``cudagraph_attrs``), and
they are left as they are.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ..config import cuda_graph_flag

__all__ = ["PER_FORWARD", "release_after_combine"]

PER_FORWARD = ("probs", "local_probs", "routing_map", "local_map", "reversed_local_input_permutation_mapping")
"""The dispatcher attributes set by each dispatch and read no later than its ``combine_postprocess``."""


def release_after_combine(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for a dispatcher's ``combine_postprocess``: the original, then each attribute of
    ``PER_FORWARD`` that is set becomes None (not under CUDA graphs)."""

    @functools.wraps(original)
    def combine_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if not cuda_graph_flag(getattr(self, "config", None)):
            for name in PER_FORWARD:
                if getattr(self, name, None) is not None:
                    setattr(self, name, None)
        return out

    return combine_postprocess
