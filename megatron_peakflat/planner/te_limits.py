"""Transformer Engine's limits that decide whether a training line runs, read without importing TE or torch.

Two, both of TE 2.20 under Megatron-Core's TE layers (``--transformer-impl transformer_engine``, Megatron's default):

* Fused RoPE (``--apply-rope-fusion``, Megatron's default; ``--no-rope-fusion`` turns it off). TE's
  ``fused_rope_forward_kernel`` (transformer_engine/common/fused_rope/fused_rope.cu) computes each element's
  ``offset = s_id * stride_s + b_id * stride_b + h * stride_h + d`` in 32-bit int and keeps the input's strides.
  Megatron's ``key`` is a view of the fused QKV output, whose stride_s is b x (np + 2 ng) x hn / TP, so the kernel
  addresses ``tokens x micro_batch x (heads + 2 kv_heads) x head_dim / TP`` elements, which must stay within
  2**31 - 1 (gpt-oss-20b: 5120 elements a token, 419,430 tokens at TP 1; past it the kernel reads out of bounds:
  an illegal memory access in fused_rope.cu). ``tokens`` is the length RoPE is applied to at once: seq / CP, or
  the tile length where the tiled attention layer (``--peakflat-tile``) applies RoPE per tile.
  Multi-latent attention rotates a separate ``k_pos_emb`` tensor, not a view of the QKV output: not bound here.
* The attention backend. TE's ``DotProductAttention`` falls back to its unfused backend, which materialises
  [b, heads / TP, s_q, s_k] scores and their softmax, where neither flash nor cuDNN's fused attention takes the
  line: fp32 data; a head dimension that is not a multiple of 8 or above 256; a ``--softmax-type`` other than
  vanilla under ``--deterministic-mode``, or under context parallelism unless ``--cp-comm-type a2a``.
"""

from __future__ import annotations

from typing import Any

from ..config_base import PeakflatConfigError, format_bytes

__all__ = ["TE_VERSION", "INT32_MAX", "ROPE_KERNEL", "UNFUSED_BACKEND", "fused_rope_elements", "fused_rope_fits",
           "fused_rope_max_tokens", "rope_fusion_applies", "rope_kernel_tokens", "fused_rope_refusal",
           "NO_ROPE_FUSION", "unfused_attention_condition", "unfused_scores_bytes", "unfused_refusal", "attention_head_dim",
           "te_run_fields", "line_refusal"]

TE_VERSION = "2.20"
"""The Transformer Engine release whose kernels these limits were read from."""
INT32_MAX = 2**31 - 1
ROPE_KERNEL = f"Transformer Engine {TE_VERSION}'s fused_rope_forward_kernel (fused_rope.cu)"
UNFUSED_BACKEND = f"Transformer Engine {TE_VERSION}'s unfused attention backend (UnfusedDotProductAttention)"
NO_ROPE_FUSION = "--no-rope-fusion"


def fused_rope_elements(tokens_in_kernel: int, micro_batch: int, heads: int, kv_heads: int, head_dim: int,
                        tp: int) -> int:
    """The largest offset the fused RoPE kernel forms for the key view, plus one: its sequence stride times its
    length, in elements."""
    return tokens_in_kernel * micro_batch * (heads + 2 * kv_heads) * head_dim // tp


def fused_rope_fits(tokens_in_kernel: int, micro_batch: int, heads: int, kv_heads: int, head_dim: int,
                    tp: int) -> bool:
    """Whether TE's fused RoPE kernel addresses every element of the key view in 32-bit int."""
    return fused_rope_elements(tokens_in_kernel, micro_batch, heads, kv_heads, head_dim, tp) <= INT32_MAX


def fused_rope_max_tokens(micro_batch: int, heads: int, kv_heads: int, head_dim: int, tp: int) -> int:
    """The longest length the fused RoPE kernel takes at once for these sizes."""
    per_token = fused_rope_elements(1, micro_batch, heads, kv_heads, head_dim, 1)
    return INT32_MAX * tp // per_token


def _get(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def rope_fusion_applies(args: Any, *, preset: bool = False) -> bool:
    """Whether the line runs TE's fused RoPE kernel: RoPE (``--position-embedding-type rope`` or the legacy
    ``--use-rotary-position-embeddings``; Megatron's validate_args turns fusion off for every other type, yarn
    included) with fusion on (Megatron's default) on TE's layers, and no multi-latent attention. ``preset``: the
    line is a planner preset (a RoPE model) with at most a few flags beside it, so RoPE is taken as on."""
    rope = _get(args, "position_embedding_type", "rope" if preset else "learned_absolute") == "rope" \
        or bool(getattr(args, "use_rotary_position_embeddings", False))
    return (rope and bool(_get(args, "apply_rope_fusion", True))
            and _get(args, "transformer_impl", "transformer_engine") == "transformer_engine"
            and not getattr(args, "multi_latent_attention", False))


def rope_kernel_tokens(seq_len: int, cp: int, args: Any) -> int:
    """The length RoPE is applied to at once: the tile length where ``--peakflat-tile`` is on, else seq / CP."""
    if getattr(args, "peakflat_tile_enabled", None):
        from ..tile.config import TileConfig

        return TileConfig(tokens=getattr(args, "peakflat_tile_tokens", None)).tile_tokens(seq_len // cp, cp)
    return seq_len // cp


def fused_rope_refusal(args: Any, *, seq_len: int, cp: int, micro_batch: int, heads: int, kv_heads: int,
                       head_dim: int, tp: int, preset: bool = False) -> PeakflatConfigError | None:
    """The error for a line whose fused RoPE kernel would address past 2**31 - 1 (naming the kernel, the limit
    and the fix ``--no-rope-fusion``); None where fusion is off or the length is within the limit."""
    if not rope_fusion_applies(args, preset=preset):
        return None
    tokens = rope_kernel_tokens(seq_len, cp, args)
    if fused_rope_fits(tokens, micro_batch, heads, kv_heads, head_dim, tp):
        return None
    limit = fused_rope_max_tokens(micro_batch, heads, kv_heads, head_dim, tp)
    where = "tile" if tokens != seq_len // cp else ("sequence" if cp == 1 else f"sequence / CP {cp}")
    return PeakflatConfigError(
        "--apply-rope-fusion", True,
        f"{ROPE_KERNEL} addresses the key in 32-bit int: {tokens:,} tokens ({where}) x micro-batch {micro_batch} x "
        f"(heads {heads} + 2 x kv heads {kv_heads}) x head dim {head_dim} / TP {tp} = "
        f"{fused_rope_elements(tokens, micro_batch, heads, kv_heads, head_dim, tp):,} elements, past 2**31 - 1 "
        f"(at most {limit:,} tokens at once here); the kernel would read out of bounds (illegal memory access)",
        f"add {NO_ROPE_FUSION} (Megatron then rotates with torch), or raise --context-parallel-size or "
        "--tensor-model-parallel-size")


def unfused_attention_condition(args: Any, *, precision: str, head_dim: int, cp: int) -> str | None:
    """Why TE would run its unfused attention backend for this line (the condition to change), or None where
    flash or cuDNN's fused attention takes it. Only on TE's layers."""
    if _get(args, "transformer_impl", "transformer_engine") != "transformer_engine":
        return None
    if precision == "fp32":
        return "fp32 data (flash and fused attention take bf16 and fp16): add --bf16"
    if head_dim % 8:
        return f"head dim {head_dim} is not a multiple of 8: choose --kv-channels a multiple of 8"
    if head_dim > 256:
        return f"head dim {head_dim} is above 256: choose --kv-channels of 256 or less"
    softmax = _get(args, "softmax_type", "vanilla")
    if softmax != "vanilla":
        if getattr(args, "deterministic_mode", False):
            return f"--softmax-type {softmax} under --deterministic-mode: drop one of them"
        comm = _get(args, "cp_comm_type", ["p2p"])
        comm = comm if isinstance(comm, (list, tuple)) else [comm]
        if cp > 1 and any(c != "a2a" for c in comm):
            return (f"--softmax-type {softmax} under context parallelism with --cp-comm-type {' '.join(comm)}: "
                    "pass --cp-comm-type a2a, or --softmax-type vanilla")
    return None


def unfused_scores_bytes(*, micro_batch: int, heads: int, tp: int, seq_len: int, cp: int, cp_comm: Any,
                         bytes_per_element: int) -> float:
    """What the unfused backend holds for one layer's attention: the [b, heads / TP, s_q, s_k] scores and the
    softmax probabilities saved for backward. Under CP with a2a each rank takes heads / CP of the whole sequence;
    otherwise (the p2p ring) a local block of s / CP queries against s / CP keys at a time."""
    comm = cp_comm if isinstance(cp_comm, (list, tuple)) else [cp_comm or "p2p"]
    if cp > 1 and all(c == "a2a" for c in comm):
        one = micro_batch * heads / (tp * cp) * seq_len * seq_len
    else:
        one = micro_batch * heads / tp * (seq_len / cp) ** 2
    return 2 * one * bytes_per_element


def unfused_refusal(condition: str, scores: float, hbm_bytes: float) -> PeakflatConfigError:
    """The start-up error where the unfused backend's scores do not fit: the backend and the condition to change."""
    return PeakflatConfigError(
        "--transformer-impl", "transformer_engine",
        f"{UNFUSED_BACKEND} runs this line and holds its [b, heads/TP, s, s] scores and softmax: "
        f"{format_bytes(scores)} per layer, and the run's plan with them does not fit {format_bytes(hbm_bytes)}",
        f"change what sends it there: {condition}")


def attention_head_dim(shape: Any) -> int:
    """The head dimension TE's attention sees: --kv-channels, or MLA's larger of q/k (with its rotary part) and v."""
    mla = getattr(shape, "mla", None)
    if mla is None:
        return int(shape.head_dim)
    return max(mla.qk_head_dim + mla.qk_pos_emb_head_dim, mla.v_head_dim)


def te_run_fields(shape: Any, args: Any, *, precision: str, cp: int) -> dict[str, Any]:
    """The planner's RunConfig fields that say what Transformer Engine runs for this line: ``transformer_impl``,
    ``unfused_attention`` (the condition, or None) and ``cp_comm_type``."""
    comm = _get(args, "cp_comm_type", ["p2p"])
    return {"transformer_impl": _get(args, "transformer_impl", "transformer_engine"),
            "unfused_attention": unfused_attention_condition(args, precision=precision,
                                                             head_dim=attention_head_dim(shape), cp=cp),
            "cp_comm_type": tuple(comm if isinstance(comm, (list, tuple)) else [comm])}


def line_refusal(shape: Any, run: Any, args: Any, *, preset: bool = False) -> PeakflatConfigError | None:
    """The fused RoPE refusal (``fused_rope_refusal``) for a planner ``shape`` and ``run``."""
    return fused_rope_refusal(args, seq_len=run.seq_len, cp=run.cp, micro_batch=run.micro_batch, heads=shape.heads,
                              kv_heads=shape.kv_heads, head_dim=shape.head_dim, tp=run.tp, preset=preset)
