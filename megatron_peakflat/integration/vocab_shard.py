"""``--peakflat-vocab-shard-over-ep``: the output layer's rows sharded over the expert-parallel group.

At TP=1 every rank holds the whole [V, H] output layer, its fp32 ``main_grad`` and (with the distributed
optimizer, over the data-parallel ranks) its Adam state. An MoE model's expert-parallel ranks each see
their own tokens, so the layer can be split by rows over that group, as the tensor-parallel group
splits it at TP > 1, and Ring-DTP run over the expert-parallel group (the gather schedule where the
gradients are computed with the loss, as in training; a ring where they are computed in backward): every
rank's tokens meet every shard, and each shard's gradient sums the tokens of the whole group. What each rank holds of the
layer drops to V/EP rows.

The shard is handed to Megatron as an expert-parallel parameter (``allreduce = False``), which is what
its gradient is: distinct on each expert-parallel rank, replicated over the expert data-parallel group,
and already summed over the expert-parallel group's tokens. So DDP reduces it over the expert
data-parallel group with the experts' scaling, the distributed optimizer shards its state there, and
the gradient norm counts each shard once; none of that needs a change. The distributed checkpoint
describes the shard as rows of the global [V, H] tensor (``sharded_state_dict``), so the model's weights
saved with the flag load into a model without it, and the other way round. The distributed optimizer's
state follows only from a checkpoint saved with ``--dist-ckpt-optim-fully-reshardable``: its default
layout fixes each gradient bucket's size, which the flag changes ("Global shape mismatch" at load; or load
with ``--no-load-optim``). ``--ckpt-format torch`` keeps local shapes and cannot cross the flag at all.
``resume.check_resume`` refuses both at start-up.

The model is built whole (the same initialisation as without the flag) and then cut: rank r keeps rows
[r V/EP, (r + 1) V/EP). Only the loss path is sharded: a forward that would hand the logits to Megatron
(no labels: generation, logits for evaluation) raises, naming the flag.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import state
from .logs import info_once

__all__ = ["EpShard", "shard_of", "shard_output_layer", "wrap_gpt_init"]

FLAG = "--peakflat-vocab-shard-over-ep"


@dataclass(frozen=True)
class EpShard:
    """Where this rank's rows of the output layer sit: rows [rank * rows, (rank + 1) * rows) of ``vocab``."""

    group: Any
    rank: int
    size: int
    vocab: int
    expt_dp_rank: int

    @property
    def rows(self) -> int:
        return self.vocab // self.size


def shard_of(output_layer: Any) -> EpShard | None:
    """The layer's shard over the expert-parallel group, or None when it is whole."""
    return getattr(output_layer, "peakflat_ep_shard", None)


def shard_output_layer(output_layer: Any) -> EpShard:
    """Keep this expert-parallel rank's rows of ``output_layer.weight`` (a new Parameter, marked expert
    parallel) and describe them to Megatron's distributed checkpointing as rows of the whole."""
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    size = parallel_state.get_expert_model_parallel_world_size()
    rank = parallel_state.get_expert_model_parallel_rank()
    w = output_layer.weight
    if w.shape[0] % size:
        raise ValueError(f"{FLAG}: the output layer's {w.shape[0]} rows do not split evenly over EP={size}; "
                         f"pass --make-vocab-size-divisible-by a multiple of {size}")
    shard = EpShard(group, rank, size, w.shape[0], parallel_state.get_expert_data_parallel_rank())
    part = torch.nn.Parameter(w.detach()[rank * shard.rows:(rank + 1) * shard.rows].clone(),
                              requires_grad=w.requires_grad)
    # Megatron's tags carry over: the tensor-parallel layout, is_embedding_or_output_parameter (--decoupled-lr,
    # optimizer grouping), MuP's is_embedding_parameter, ...
    for attr, value in vars(w).items():
        setattr(part, attr, value)
    part.allreduce = False  # an expert-parallel parameter: reduced over the expert data-parallel group
    output_layer.weight = part
    output_layer.peakflat_ep_shard = shard
    output_layer.sharded_state_dict = types.MethodType(_sharded_state_dict(type(output_layer).sharded_state_dict),
                                                       output_layer)
    info_once("peakflat vocab: output layer sharded over the expert-parallel group (EP=%d): %d of %d rows here",
              size, shard.rows, shard.vocab, per_rank=True)
    return shard


def _sharded_state_dict(original: Callable[..., dict]) -> Callable[..., dict]:
    def sharded_state_dict(self: Any, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        out = original(self, prefix, sharded_offsets, metadata)
        shard: EpShard = self.peakflat_ep_shard
        key = f"{prefix}weight"
        out[key] = ShardedTensor.from_rank_offsets(key, self.weight, *sharded_offsets,
                                                   (len(sharded_offsets), shard.rank, shard.size),
                                                   replica_id=(0, 0, shard.expt_dp_rank),
                                                   prepend_axis_num=len(sharded_offsets))
        return out

    return sharded_state_dict


def wrap_gpt_init(original_init: Callable[..., None]) -> Callable[..., None]:
    """``GPTModel.__init__``, then, under ``--peakflat-vocab-shard-over-ep``, the output layer cut to this
    expert-parallel rank's rows."""

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        cfg = state.get()
        if cfg is None or cfg.vocab.impl != "ring-dtp" or not cfg.vocab.shard_over_ep:
            return
        if getattr(self, "share_embeddings_and_output_weights", False):
            raise ValueError(f"{FLAG}: the output layer is tied to the input embedding; pass "
                             "--untie-embeddings-and-output-weights or drop the flag")
        if getattr(self, "post_process", False):
            shard_output_layer(self.output_layer)

    return __init__
