"""``TransformerLayer._forward_attention`` over query tiles (``--peakflat-tile``): ``tile.TiledSelfAttention``
bound to the layer's own modules.

The ops are Megatron's: ``input_layernorm`` then ``self_attention.get_query_key_value_tensors`` (the QKV
projection, with the norm fused into ``linear_qkv`` on Transformer Engine, qk-layernorm and grouped K/V heads),
``apply_rotary_pos_emb`` with the rotary table cut to the tile's positions, ``self_attention.core_attention``
with ``AttnMaskType.causal_bottom_right`` (plain ``causal`` when the tile's queries are all the keys; Transformer
Engine's, with grouped K/V heads at long key lengths, as one call per K/V head: ``te_kv_head_calls``),
``self_attention.linear_proj`` and ``self_attn_bda``. The parameters of the norm and the attention are the
Function's inputs, so each gets its gradient once per step (DDP's hooks, overlapped reduction included).

Under context parallelism (``--context-parallel-size`` > 1) the layer's input is the rank's two chunks of the
sequence (Megatron's load-balanced layout) and ``tile.context_parallel`` runs: tiles within each chunk, K and V
all-gathered over the CP group and dK, dV reduce-scattered by the sublayer itself, so the core attention runs each
call with no CP group of its own (its ``cp_group`` cleared for the call: SDPAttention then takes the bottom-right
mask, Transformer Engine's attention sees a group of one), whatever ``--cp-comm-type`` says. The rotary table
Megatron passes is already the rank's rows (``get_pos_emb_on_this_cp_rank``).

Where a layer's call is not plain causal self-attention over the whole local sequence (a mask or bias, packed
sequences, inference, cross-attention, dropout in training, sequence parallelism, an output gate,
fine-grained activation offloading, sliding windows, other softmaxes, another core attention), Megatron's own
``_forward_attention`` runs, with one log line per reason. The start-up check refuses the flags behind most of
these (``TileConfig.check_against_megatron``). The pre-MLP norm, the router and the MLP run as before, over the whole sequence.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import torch

from .. import stats
from ..attention import calls as calls_module
from ..attention.kv_head_split import attend_per_kv_head
from ..tile.api import tiled_self_attention
from ..tile.ops import TileOps
from ..tile.context_parallel import group_size
from . import state
from .logs import info_once

__all__ = ["wrap_forward_attention", "unsupported_reason", "layer_ops", "layer_params", "cp_group",
           "te_kv_head_calls"]


def wrap_forward_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``TransformerLayer._forward_attention``: the tiled sublayer where it applies."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _forward_attention(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = state.get()
        if cfg is None or not cfg.tile.enabled:
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs).arguments
        reason = unsupported_reason(self, call)
        if reason is not None:
            info_once(f"peakflat tile: Megatron's own attention sublayer runs where {reason}")
            stats.add("tile", "untiled_calls", 1)
            return original(self, *args, **kwargs)
        hidden_states = call["hidden_states"]
        group = cp_group(self)
        cp = group_size(group)
        n = hidden_states.shape[0]
        tile = cfg.tile.tile_tokens(n, cp)
        if cp > 1:
            info_once(f"peakflat tile: attention sublayer over tiles of {tile} tokens within each of the rank's two "
                      f"chunks of {n // 2} tokens (context parallelism {cp}: K and V all-gathered, dK and dV "
                      "reduce-scattered by the sublayer)")
        else:
            info_once(f"peakflat tile: attention sublayer over tiles of {tile} of {n} tokens")
        stats.add("tile", "tiled_calls", 1)
        stats.record("tile", "tile_tokens", tile)
        out = tiled_self_attention(hidden_states, layer_ops(self, call.get("rotary_pos_emb")), tile,
                                   layer_params(self), group)
        return out, call.get("context")

    return _forward_attention


def unsupported_reason(layer: Any, call: dict[str, Any]) -> str | None:
    """Why this call of ``layer._forward_attention`` (its bound arguments) must run Megatron's own sublayer, or
    None when the tiled one computes the same thing."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp

    for name, what in (("attention_mask", "an explicit attention mask is given"),
                       ("attention_bias", "an attention bias is given"),
                       ("packed_seq_params", "sequences are packed"),
                       ("inference_context", "it runs inference"), ("inference_params", "it runs inference"),
                       ("rotary_pos_cos", "RoPE comes as cos/sin tables"),
                       ("rotary_pos_sin", "RoPE comes as cos/sin tables"),
                       ("rotary_pos_cos_sin", "RoPE comes as cos/sin tables")):
        if call.get(name) is not None:
            return what
    cfg = layer.config
    sa = layer.self_attention
    if not isinstance(sa, SelfAttention):
        return f"the attention is {type(sa).__name__}, not SelfAttention"
    if not (isinstance(layer.pre_cross_attn_layernorm, IdentityOp) and isinstance(layer.cross_attention, IdentityOp)):
        return "the layer has cross-attention"
    if sa.attn_mask_type != AttnMaskType.causal:
        return f"the mask type is {sa.attn_mask_type.name}, not causal"
    if layer.training and (layer.hidden_dropout > 0 or cfg.attention_dropout > 0):
        return "dropout is on in training (backward recomputes each tile)"
    if cfg.sequence_parallel:
        return "sequence parallelism splits the sequence"
    if cfg.fp32_residual_connection:
        return "the residual is kept in fp32"
    if getattr(cfg, "attention_output_gate", False):
        return "the attention has an output gate"
    if getattr(cfg, "delay_wgrad_compute", False):
        return "weight gradients are delayed"
    if any(getattr(obj, name, False) for obj, name in ((layer, "offload_attn_norm"), (sa, "offload_qkv_linear"),
                                                        (sa, "offload_core_attention"), (sa, "offload_attn_proj"))):
        return "fine-grained activation offloading covers the attention"
    if getattr(cfg, "window_size", None) is not None:
        return "sliding-window attention is on"
    if (getattr(cfg, "softmax_type", "vanilla") or "vanilla") != "vanilla":
        return f"the softmax is {cfg.softmax_type}"
    return _core_attention_reason(sa.core_attention)


def _core_attention_reason(core: Any) -> str | None:
    """The core attentions that take a bottom-right causal mask: this package's SDPA one, and Transformer
    Engine's where it passes the mask type on to TE at each call."""
    from .attention import sdpa_core_attention_class

    if isinstance(core, sdpa_core_attention_class()):
        return None
    if _is_te_attention(core):
        if getattr(core, "te_forward_mask_type", False):
            return None
        return "Transformer Engine's attention is too old to take the mask type at each call"
    return (f"the core attention is {type(core).__name__}, which takes no bottom-right causal mask "
            "(--peakflat-attention sdpa runs one)")


def _is_te_attention(core: Any) -> bool:
    """Whether ``core`` is Megatron's wrapper of Transformer Engine's attention (by name: TE may be absent)."""
    return type(core).__name__ == "TEDotProductAttention"


def layer_ops(layer: Any, rotary_pos_emb: Any) -> TileOps:
    """``TileOps`` on ``layer``'s modules; ``rotary_pos_emb``: the call's table [s, 1, 1, d] (or a pair for q, k)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.enums import AttnMaskType

    cfg = layer.config
    sa = layer.self_attention
    if cfg.no_rope_freq and cfg.no_rope_freq[sa.layer_number - 1]:
        rotary_pos_emb = None
    if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
    mscale = getattr(sa, "_yarn_concentration_factor", 1.0)
    group = getattr(getattr(sa, "pg_collection", None), "cp", None)
    gathered = group_size(cp_group(layer)) > 1  # the sublayer passes the gathered sequence's keys

    def rope(t: torch.Tensor, freqs: Any, start: int) -> torch.Tensor:
        if freqs is None:
            return t
        kw = {"mscale": mscale} if mscale != 1.0 else {}
        return apply_rotary_pos_emb(t, freqs[start:start + t.shape[0]], config=cfg, cu_seqlens=None,
                                    cp_group=group, **kw)

    def qkv(x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed = layer.input_layernorm(x)
        if isinstance(normed, tuple):  # (output, residual): the residual is x here (no fp32 residual)
            normed = normed[0]
        q, k, v = sa.get_query_key_value_tensors(normed, None, output_gate=False, split_qkv=True)
        if rotary_pos_emb is not None:
            q, k = rope(q, rotary_pos_emb[0], start), rope(k, rotary_pos_emb[1], start)
        return q, k, v

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = AttnMaskType.causal if q.shape[0] == k.shape[0] else AttnMaskType.causal_bottom_right
        core = sa.core_attention

        def call(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            return core(qc, kc, vc, None, attn_mask_type=mask, attention_bias=None, packed_seq_params=None)

        calls = te_kv_head_calls(layer, q, k)
        with _without_cp_group(core) if gathered else contextlib.nullcontext():
            if calls == 1:
                return call(q, k, v)
            keys, first = k.shape[0] * k.shape[1], calls_module.GROUPED_CALL_MIN_KEYS
            info_once(f"peakflat tile: Transformer Engine's attention runs as {calls} calls of {q.shape[2] // calls} "
                      f"query heads each from {first} keys on ({keys} here), so cuDNN's backward expands dK and dV "
                      "for one K/V head group at a time")
            stats.add("tile", "te_kv_head_calls", calls)
            with _kv_heads_per_call(core, k.shape[2] // calls):
                return attend_per_kv_head(call, q, k, v, calls)

    def project(o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return layer.self_attn_bda(layer.training, cfg.bias_dropout_fusion)(sa.linear_proj(o), x, layer.hidden_dropout)

    return TileOps(qkv=qkv, attend=attend, project=project)


def te_kv_head_calls(layer: Any, q: torch.Tensor, k: torch.Tensor) -> int:
    """The calls the tiled sublayer runs one attention of ``layer``'s Transformer Engine core attention as
    (``attention.calls.kv_head_calls`` on this call's heads and keys): one per K/V head where the heads are grouped
    and the keys are long, else 1; also 1 on another core attention (the SDPA one splits its own calls), and where
    the attention reports per-head logit maxima (``--qk-clip``, ``--log-max-attention-logit``), which the calls
    would each report for their own heads."""
    if not _is_te_attention(layer.self_attention.core_attention):
        return 1
    cfg = layer.config
    if getattr(cfg, "qk_clip", False) or getattr(cfg, "log_max_attention_logit", False):
        return 1
    return calls_module.kv_head_calls(q.shape[2], k.shape[2], k.shape[0] * k.shape[1])


@contextlib.contextmanager
def _kv_heads_per_call(core: Any, groups: int) -> Iterator[None]:
    """Transformer Engine's ``DotProductAttention`` taking ``groups`` K/V heads per call, the one count its forward
    checks the keys against (``num_gqa_groups_per_partition``); the query heads it reads from the query's shape."""
    saved = core.num_gqa_groups_per_partition
    core.num_gqa_groups_per_partition = groups
    try:
        yield
    finally:
        core.num_gqa_groups_per_partition = saved


def cp_group(layer: Any) -> Any:
    """The layer's context-parallel group where ``--context-parallel-size`` > 1, else None."""
    if (layer.config.context_parallel_size or 1) <= 1:
        return None
    group = getattr(getattr(layer.self_attention, "pg_collection", None), "cp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


@contextlib.contextmanager
def _without_cp_group(core: Any) -> Iterator[None]:
    """``core`` (SDPAttention or Transformer Engine's DotProductAttention, each of which runs context parallelism
    only through its ``cp_group``) with no CP group for one call: the tiled sublayer gathers K and V itself."""
    saved = core.cp_group
    core.cp_group = None
    try:
        yield
    finally:
        core.cp_group = saved


def layer_params(layer: Any) -> list[torch.Tensor]:
    """Every parameter the ops read: the input norm's and the self-attention's (norm fused into its QKV
    projection, qk-layernorm and the core attention's included)."""
    return [*layer.input_layernorm.parameters(), *layer.self_attention.parameters()]
