"""Transformer Engine's limits that decide whether a training line runs, read without importing TE or torch.

Read from Transformer Engine's source at 2.20.0.dev0 (main, d0067d0), the nearest to 2.20 that was at hand; the
lines quoted below are the same in release_v2.19. Each rule names the kernel, the lines that make the limit, and
what Megatron-Core's TE layers (``--transformer-impl transformer_engine``, Megatron's default) hand it:

* Fused RoPE (``--apply-rope-fusion``, Megatron's default; ``--no-rope-fusion`` turns it off). TE's
  ``fused_rope_forward_kernel`` (transformer_engine/common/fused_rope/fused_rope.cu) computes each element's
  ``offset = s_id * stride_s + b_id * stride_b + h * stride_h + d`` in 32-bit int and keeps the input's strides.
  Megatron's ``key`` is a view of the fused QKV output, whose stride_s is b x (np + 2 ng) x hn / TP, so the kernel
  addresses ``tokens x micro_batch x (heads + 2 kv_heads) x head_dim / TP`` elements, which must stay within
  2**31 - 1 (gpt-oss-20b: 5120 elements a token, 419,430 tokens at TP 1; past it the kernel reads out of bounds:
  an illegal memory access in fused_rope.cu). ``tokens`` is the length RoPE is applied to at once: seq / CP, or
  the tile length where the tiled attention layer (``--peakflat-tile``) applies RoPE per tile. Action: auto adds
  ``--no-rope-fusion``. (``fused_qkv_rope_forward_kernel`` in the same file forms ``s_id * b * h * total_d`` in int,
  the same bound; Megatron-Core 0.19 exposes no flag for it.)
  Multi-latent attention rotates a separate ``k_pos_emb`` tensor, not a view of the QKV output: not bound here.
* Normalization (``TENorm``: the pre-MLP norm of MoE layers, the final norm, MTP norms, ``--qk-layernorm``'s query
  and key norms; ``TELayerNormColumnParallelLinear``: the input norm, a dense layer's pre-MLP norm). TE's
  ``rmsnorm_fwd_general_kernel`` / ``rmsnorm_bwd_general_kernel`` (normalization/rmsnorm/rmsnorm_fwd_kernels.cuh,
  rmsnorm_bwd_kernels.cuh) and ``ln_fwd_general_kernel`` / ``ln_bwd_general_kernel`` (normalization/layernorm/)
  load and store at ``row * params.cols + col``, where ``KernelParamsBase`` (normalization/kernel_params.h) holds
  ``int rows, cols`` and ``row`` is an int: the product is a 32-bit int and a row past 2**31 / hidden wraps
  negative (out of bounds). The tuned kernels (``*_tuned_kernel``, same files) form ``index_t idx = row *
  Ktraits::VEC_COLS + c`` in int, counting vectors of BYTES_PER_LDG bytes; TE picks them only for the hidden sizes
  registered in ``*_cuda_kernel.cu`` (``TUNED_NORM_LOAD_BYTES``) and a row count that is a multiple of 4
  (``is_tuned = is_aligned && (batch_size % 4 == 0)``, normalization/common.cpp; ``is_ptr_aligned``: 16 bytes,
  which Megatron's parameter buffer gives the norm weight under --use-distributed-optimizer, each parameter
  starting on 64 elements; without it the planner takes the general kernel). So ``rows x hidden`` (general) or
  ``rows x hidden / elements per load`` (tuned) must stay within 2**31 - 1. Rows: the whole sequence on the rank
  for the pre-MLP and final norms (seq / CP x micro-batch, / TP under sequence parallelism) whatever the tile
  does, since they run outside the attention sublayer; the attention's tokens x micro-batch x heads / TP for the
  query norm of --qk-layernorm (per tile under --peakflat-tile). The input norm runs over no more rows than the
  pre-MLP norm, and MLA's latent norms over fewer columns: both bounded by the first. gpt-oss-20b (RMSNorm, 2880,
  no tuned kernel): 745,654 tokens per rank. No Megatron flag runs these norms outside TE on TE's layers
  (``TESpecProvider.layer_norm`` returns TENorm for both --normalization choices). With --peakflat-tile on, the
  pre-MLP, final and MTP norms run in row slices within the limit (``tile.rows``, ``integration.norm_rows``;
  ``norm_slice_rows`` gives the slice), so the line runs; without it start-up refuses, naming --peakflat-tile,
  then --context-parallel-size, as the fix (for the query norm: --peakflat-tile, whose tiles bound its rows).
* Fused router (``--moe-router-fusion``). ``fused_topk_with_score_function_forward_kernel_launcher``
  (fused_router/fused_topk_with_score_function.cu) and its aux-loss twin (fused_score_for_moe_aux_loss.cu) check
  ``static_cast<int64_t>(num_tokens) * num_experts <= INT_MAX`` ("kernel uses int offsets"): the router's tokens
  (seq / CP x micro-batch, / TP under sequence parallelism; PipelinedLLEP keeps Megatron's router) times the
  experts. Past it the first forward stops with that error. Start-up refuses; the fix drops the flag.
* Fused permutation (``--moe-permute-fusion``, on Megatron's own dispatcher; PipelinedLLEP permutes with its own
  code and never calls it). ``make_row_id_map`` (transformer_engine/pytorch/triton/permutation.py) launches
  ``_row_id_map_pass_1_kernel`` on a grid (experts, ceil(tokens / 1024)) and ``_row_id_map_pass_2_kernel`` with the
  compile-time width ``triton.next_power_of_2(num_experts * triton.cdiv(num_tokens, block_size))``, which the
  kernel passes to ``tl.arange`` (transformer_engine/common/triton/permutation.py): Triton refuses a block of
  more than 2**20 elements (TRITON_MAX_TENSOR_NUMEL) and CUDA a grid y above 65535. Tokens: the alltoall
  dispatcher's local tokens, the allgather dispatcher's tokens gathered over TP x EP. The token rows themselves
  are addressed in int64 (``src_row = pid_t.to(tl.int64)``): no tokens x topk x hidden limit. Start-up refuses;
  the fix drops the flag or runs PipelinedLLEP.
* The attention backend. TE's ``DotProductAttention`` falls back to its unfused backend, which materialises
  [b, heads / TP, s_q, s_k] scores and their softmax, where neither flash nor cuDNN's fused attention takes the
  line: fp32 data; a head dimension that is not a multiple of 8 or above 256; a ``--softmax-type`` other than
  vanilla under ``--deterministic-mode``, or under context parallelism unless ``--cp-comm-type a2a``.
* cuDNN's deterministic attention backward. Under ``--deterministic-mode`` Megatron sets
  NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and TE hands cuDNN ``set_deterministic_algorithm(true)``
  (fused_attn_f16_arbitrary_seqlen.cu, from cuDNN 9.0). cudnn-frontend's SDPA backward node
  (scaled_dot_product_flash_attention.h, ``use_dp_workspace``) then always takes its dP-workspace path: no fp32 dQ
  accumulator, but dP for every query against every key in the plan's workspace, b x heads / TP x s_q x s_kv (each
  padded to 64) x 2 bytes for one attention call, allocated whole by TE (pytorch/csrc/extensions/attention.cpp) for
  the call's backward. 32 heads at 640K tokens: 25,600 GiB. The non-deterministic path holds an fp32 dQ
  accumulator instead, linear in s. (cudnn-frontend's later linear deterministic path on Hopper, for cuDNN 9.25, is
  not taken as present.) The planner counts it in the 'attention scores' row; start-up, ``peakflat-check`` and
  ``--peakflat auto`` refuse a line whose plan with it does not fit, naming ``--deterministic-mode``.
* cuDNN's attention backward with grouped K/V heads. Its workspace holds dK and dV at the query heads, [b,
  heads / TP, s_kv, head dim] each in the data type, which it then sums to the K/V heads; the non-deterministic path
  adds its fp32 dQ accumulator. Measured on one H100 with TE 2.20.2 (docs/evidence/gpu_tile_te_h100.txt): a 16K
  tile of 64 heads against 1M keys of 8 K/V heads holds 18.51 GiB beyond its inputs, and a 1M-token run asked for
  one 16.26 GiB workspace in ``fused_attn_bwd`` (16 GiB of expanded dK and dV, 0.25 GiB of the tile's dQ
  accumulator). The planner counts it in the attention backward (``gqa_expansion_bytes``), linear in the keys.

Checked and not a length limit, so that nobody has to read them again:

* cuDNN fused attention (fused_attn/fused_attn.cpp ``nvte_get_fused_attn_backend``): the F16 arbitrary-seqlen
  backend has no sequence-length cap; ``causal_bottom_right`` (the tiled layer's tiles) needs s_q <= s_kv and cuDNN
  9.3 (9.3 to 9.6 also s_q and s_kv multiples of 64; 9.7 drops that). TE hands cuDNN int64_t dimensions and
  strides (``generateMatrixStrides``, fused_attn_f16_arbitrary_seqlen.cu); its int32 cu_seqlens and offsets serve
  padding and THD only. On Hopper TE prefers it to flash attention (``get_attention_backend``, utils.py). cuDNN's
  own kernels are not TE source.
* flash_attn.cu's ``prepare_kernel_fwd/bwd`` (QKV repacking for flash attention): size_t offsets; the warp id
  (one warp per token and sample) comes from a 32-bit thread index, which bounds tokens x micro-batch below 2**27
  (134M). context_parallel.py calls TE kernels (``tex.thd_*``) for THD only.
* cuBLASLt GEMM (gemm/cublaslt_gemm.cu ``cublas_gemm``): ``int m, n, k`` per dimension, so one dimension (tokens x
  micro-batch) below 2**31; the matrix layouts are cuBLASLt's uint64. Grouped GEMM (cublaslt_grouped_gemm.cu):
  int64 dimensions and offsets, and PipelinedLLEP's experts run torch._grouped_mm, not TE's GroupedLinear.
* Gated activations (util/vectorized_pointwise.h ``gated_act_kernel``, ``dgated_act_kernel``): size_t; reached only
  with --use-te-activation-func. Cast and transpose kernels serve fp8 only: a bf16 line's bias gradient is fused
  into the weight-gradient GEMM (module/base.py ``grad_output_preprocess``).
* Cross-entropy (common/triton/cross_entropy.py): int64 row offsets (``tl.program_id(0).to(tl.int64)``); Ring-DTP
  replaces it, and the output layer is Megatron's own ColumnParallelLinear (TE's only under MXFP8), so nothing of
  TE touches [tokens, vocab] in a bf16 line. The index-map permutation kernels (permutation/permutation.cu) serve
  ``map_type="index"``, which Megatron does not use.
"""

from __future__ import annotations

from typing import Any

from ..config_base import PeakflatConfigError, format_bytes

__all__ = ["TE_VERSION", "INT32_MAX", "ROPE_KERNEL", "UNFUSED_BACKEND", "fused_rope_elements", "fused_rope_fits",
           "fused_rope_max_tokens", "rope_applies", "rope_fusion_applies", "torch_rope_dim", "packed_qkv_freed", "rope_kernel_tokens",
           "fused_rope_refusal",
           "NO_ROPE_FUSION", "unfused_attention_condition", "unfused_cp_refusal", "attention_call_shape", "unfused_scores_bytes", "unfused_refusal", "attention_head_dim",
           "DETERMINISTIC_BACKWARD", "fused_attention_runs", "deterministic_workspace_applies",
           "deterministic_workspace_bytes",
           "gqa_expansion_applies", "gqa_expansion_bytes",
           "scores_refusal", "scores_cause",
           "te_run_fields", "line_refusal", "rope_line_refusal", "TUNED_NORM_LOAD_BYTES", "norm_kernel",
           "norm_elements_per_offset", "norm_offsets", "norm_fits", "norm_max_rows", "norm_slice_rows", "te_norm_applies",
           "norm_sites", "TILE_FLAG", "tile_prerequisites",
           "norm_refusal", "ROUTER_KERNEL", "router_fusion_refusal", "PERMUTE_KERNEL", "TRITON_MAX_TENSOR_NUMEL",
           "GRID_Y_MAX", "permute_row_id_map_width", "permute_fusion_refusal", "hard_refusal"]

TE_VERSION = "2.20"
"""The Transformer Engine release whose kernels these limits were read from."""
INT32_MAX = 2**31 - 1
ROPE_KERNEL = f"Transformer Engine {TE_VERSION}'s fused_rope_forward_kernel (fused_rope.cu)"
UNFUSED_BACKEND = f"Transformer Engine {TE_VERSION}'s unfused attention backend (UnfusedDotProductAttention)"
NO_ROPE_FUSION = "--no-rope-fusion"
TILE_FLAG = "--peakflat-tile"
"""The tiled attention sublayer's flag: with it on, the whole-sequence norms run in row slices within TE's limit."""


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


def rope_applies(args: Any, *, preset: bool = False) -> bool:
    """Whether the line uses RoPE: ``--position-embedding-type rope`` or the legacy
    ``--use-rotary-position-embeddings``. ``preset``: the line is a planner preset (a RoPE model) with at most a few
    flags beside it, so RoPE is taken as on."""
    return _get(args, "position_embedding_type", "rope" if preset else "learned_absolute") == "rope" \
        or bool(getattr(args, "use_rotary_position_embeddings", False))


def rope_fusion_applies(args: Any, *, preset: bool = False) -> bool:
    """Whether the line runs TE's fused RoPE kernel: RoPE (``rope_applies``; Megatron's validate_args turns fusion
    off for every other type, yarn included) with fusion on (Megatron's default), and no multi-latent attention.
    On the local spec as on TE's layers: Megatron's attention rotates through ``rope_utils.apply_rotary_pos_emb``,
    which calls TE's kernel whenever fusion is on, and refuses a line with fusion on where TE is absent
    (TransformerConfig: "apply_rope_fusion is not available"); ``python -m megatron_peakflat.pretrain`` adds
    ``--no-rope-fusion`` there before the planner reads the line."""
    return (rope_applies(args, preset=preset) and bool(_get(args, "apply_rope_fusion", True))
            and not getattr(args, "multi_latent_attention", False))


def torch_rope_dim(shape: Any, args: Any, *, preset: bool = False) -> int:
    """The dimensions per head that torch's RoPE rotates for this line: RoPE with fusion off (``--no-rope-fusion``),
    head dim x ``--rotary-percent``; 0 where TE's fused kernel rotates, there is no RoPE, or multi-latent attention
    (its rotated parts are planned apart)."""
    if getattr(shape, "mla", None) is not None or not rope_applies(args, preset=preset) \
            or rope_fusion_applies(args, preset=preset):
        return 0
    return int(int(shape.head_dim) * float(_get(args, "rotary_percent", 1.0)))


def packed_qkv_freed(shape: Any, args: Any, *, preset: bool = False) -> bool:
    """Whether nothing attention saves for backward is a view of the layer's packed QKV projection output, so that
    its q and k parts are not alive in attention's backward:
    - RoPE on TE's layers, fused or torch's (``--no-rope-fusion``): RoPE writes q and k into fresh tensors, and TE's
      layout detection (dot_product_attention/utils.py ``get_qkv_layout``) finds no layout for two contiguous
      tensors and a strided v, so it copies v too. Measured on one H100: with the buffer's q and k counted, TE's
      rows read +1.4% to +5.6% with fused RoPE (48K-384K) and +5.8% without (512K); without, -0.5% to +0.8% and
      -0.7%. Without RoPE the buffer stays counted (not measured).
    - The local spec with peakflat's SDPA attention, which copies any view into a larger storage before it attends
      (``integration/attention.py`` ``own_storage``; traced on CPU, tests/test_te_limits.py). Megatron's own
      DotProductAttention (``--peakflat-attention local``) keeps the views.
    No multi-latent attention: its rotated parts are planned apart."""
    if getattr(shape, "mla", None) is not None:
        return False
    if _get(args, "transformer_impl", "transformer_engine") == "local":
        return _get(args, "peakflat_attention", "auto") != "local"
    return rope_applies(args, preset=preset)


def rope_kernel_tokens(seq_len: int, cp: int, args: Any) -> int:
    """The length RoPE is applied to at once: the tile length where ``--peakflat-tile`` is on, else seq / CP."""
    if getattr(args, "peakflat_tile_enabled", None):
        from ..tile.config import TileConfig

        return TileConfig(tokens=getattr(args, "peakflat_tile_tokens", None)).tile_tokens(seq_len // cp, cp)
    return seq_len // cp


def _kernel_where(tokens: int, seq_len: int, cp: int) -> str:
    """What a kernel's length is: a tile, the sequence, or the sequence / CP."""
    return "tile" if tokens != seq_len // cp else ("sequence" if cp == 1 else f"sequence / CP {cp}")


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
    where = _kernel_where(tokens, seq_len, cp)
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


def attention_call_shape(*, heads: int, seq_len: int, cp: int, cp_comm: Any) -> tuple[float, float, float]:
    """(heads, queries, keys) of TE's largest attention call on a rank, before tensor parallelism: under CP with
    a2a, heads / CP over the whole sequence; otherwise (the p2p ring) a local block of s / CP queries against
    s / CP keys at a time."""
    comm = cp_comm if isinstance(cp_comm, (list, tuple)) else [cp_comm or "p2p"]
    if cp > 1 and all(c == "a2a" for c in comm):
        return heads / cp, seq_len, seq_len
    return heads, seq_len / cp, seq_len / cp


SOFTMAX_KERNEL_MAX_KEYS = 16384
"""TE's fused masked softmax (``FusedScaleMaskSoftmax.is_kernel_available``) takes fewer keys than this."""


def fused_softmax_runs(*, micro_batch: int, heads: float, q: float, k: float, bytes_per_element: int) -> bool:
    """Whether TE's unfused backend runs its fused masked-softmax kernel (``is_kernel_available``, causal self-
    attention): fp16/bf16 data, 16 < s_k < 16384 keys, a multiple of 8, as many queries as keys, s_q and b x heads
    multiples of 4, s_q a multiple of the kernel's batches per block. Otherwise it runs torch's softmax in fp32."""
    q, k, batches = int(q), int(k), int(micro_batch * heads)
    if bytes_per_element != 2 or not 16 < k < SOFTMAX_KERNEL_MAX_KEYS or k % 8 or q != k or q % 4 or batches % 4:
        return False
    pow2 = 1 << (k - 1).bit_length()
    warp = min(pow2, 32)
    return q % ((128 // warp) * (2 if pow2 <= 128 else 1)) == 0


def unfused_scores_bytes(*, micro_batch: int, heads: int, tp: int, seq_len: int, cp: int, cp_comm: Any,
                         bytes_per_element: int, saved: bool = False) -> float:
    """What TE's unfused backend (``UnfusedDotProductAttention``) holds for one layer's attention call
    (``attention_call_shape``), per element of its [b, heads / TP, s_q, s_k] scores, from its code path:

    - torch's softmax in fp32 (fp32 data, or past the fused kernel's limits, ``fused_softmax_runs``): the scores
      (cast to fp32 where the data is half) and the fp32 probabilities in forward; it saves the fp32 probabilities
      (and their cast to the data's dtype for the value GEMM); in backward the saved probabilities, their gradient
      and the softmax's input gradient are alive together: 3 fp32 elements (12 bytes), in half data too;
    - the fused kernel (half data): probabilities saved in the data's dtype; in backward the probabilities, their
      gradient and the kernel's input gradient: 3 elements of the data's dtype.

    ``saved``: what a layer keeps from forward to backward (where its core attention is not recomputed) instead
    of the backward's peak."""
    h, q, k = attention_call_shape(heads=heads, seq_len=seq_len, cp=cp, cp_comm=cp_comm)
    elements = micro_batch * h / tp * q * k
    w = bytes_per_element
    if fused_softmax_runs(micro_batch=micro_batch, heads=h / tp, q=q, k=k, bytes_per_element=w):
        return elements * (w if saved else 3 * w)
    return elements * ((4 + (w if w != 4 else 0)) if saved else 3 * 4)


def unfused_refusal(condition: str, scores: float, hbm_bytes: float) -> PeakflatConfigError:
    """The start-up error where the unfused backend's scores do not fit: the backend and the condition to change."""
    return PeakflatConfigError(
        "--transformer-impl", "transformer_engine",
        f"{UNFUSED_BACKEND} runs this line and holds [b, heads/TP, s, s] scores, softmax and their gradients: "
        f"{format_bytes(scores)} per layer, and the run's plan with them does not fit {format_bytes(hbm_bytes)}",
        f"change what sends it there: {condition}")


DETERMINISTIC_BACKWARD = (f"cuDNN's deterministic attention backward (Transformer Engine {TE_VERSION}'s fused "
                          "attention under --deterministic-mode)")
DETERMINISTIC_FIX = ("drop --deterministic-mode (the non-deterministic backward holds an fp32 dQ accumulator, linear in "
                     "the sequence), or run Megatron's local spec (--transformer-impl local --peakflat-attention sdpa), "
                     "whose deterministic flash backward is linear in the sequence too, or turn on --peakflat-tile "
                     "(each call then takes one tile of queries; peakflat-check sizes it)")


def fused_attention_runs(run: Any) -> bool:
    """Whether TE's fused (cuDNN) attention runs this line's attention: TE's layers, not its unfused backend."""
    return run.transformer_impl == "transformer_engine" and not run.unfused_attention


def deterministic_workspace_applies(run: Any) -> bool:
    """Whether cuDNN's deterministic attention backward runs this line's attention: TE's fused attention
    (``fused_attention_runs``) under ``--deterministic-mode``."""
    return fused_attention_runs(run) and bool(run.deterministic)


def deterministic_workspace_bytes(*, micro_batch: int, heads: float, tp: int, q_tokens: float,
                                  kv_tokens: float) -> float:
    """The dP workspace of one attention call's deterministic cuDNN backward: [b, heads / TP, s_q, s_kv] in bf16,
    s_q and s_kv padded to 64."""
    def pad(n: float) -> float:
        return -(-n // 64) * 64
    return micro_batch * heads / tp * pad(q_tokens) * pad(kv_tokens) * 2


def gqa_expansion_applies(run: Any, *, heads: int, kv_heads: int, mla: bool) -> bool:
    """Whether cuDNN's attention backward (TE's fused attention) expands dK and dV to the query heads: TE's fused
    attention (``fused_attention_runs``), grouped K/V heads (fewer K/V heads than query heads, no multi-latent
    attention)."""
    return fused_attention_runs(run) and not mla and kv_heads != heads


def gqa_expansion_bytes(*, micro_batch: int, heads: float, tp: int, kv_tokens: float, head_dim: int,
                        bytes_per_element: float) -> float:
    """dK and dV at the query heads in one attention call's cuDNN backward workspace: 2 x [b, heads / TP, s_kv,
    head dim] in the data type."""
    return 2 * micro_batch * heads / tp * kv_tokens * head_dim * bytes_per_element


def deterministic_refusal(workspace: float, hbm_bytes: float) -> PeakflatConfigError:
    """The start-up error where cuDNN's deterministic backward's dP workspace does not fit."""
    return PeakflatConfigError(
        "--deterministic-mode", True,
        f"{DETERMINISTIC_BACKWARD} takes a [b, heads/TP, s_q, s_kv] bf16 dP workspace: {format_bytes(workspace)} per "
        f"attention call, and the run's plan with it does not fit {format_bytes(hbm_bytes)}", DETERMINISTIC_FIX)


def scores_cause(run: Any) -> str:
    """What makes the plan's 'attention scores' row, and what to change: TE's unfused backend or cuDNN's
    deterministic backward."""
    if run.unfused_attention:
        return f"Transformer Engine runs its unfused attention backend here: {run.unfused_attention}"
    return f"{DETERMINISTIC_BACKWARD} holds an s_q x s_kv workspace: {DETERMINISTIC_FIX}"


def scores_refusal(run: Any, scores: float) -> PeakflatConfigError:
    """The start-up error for a plan that its 'attention scores' row puts past the GPU, naming its cause's flag."""
    if run.unfused_attention:
        return unfused_refusal(run.unfused_attention, scores, run.hbm_bytes)
    return deterministic_refusal(scores, run.hbm_bytes)


def attention_head_dim(shape: Any) -> int:
    """The head dimension TE's attention sees: --kv-channels, or MLA's larger of q/k (with its rotary part) and v."""
    mla = getattr(shape, "mla", None)
    if mla is None:
        return int(shape.head_dim)
    return max(mla.qk_head_dim + mla.qk_pos_emb_head_dim, mla.v_head_dim)


def te_run_fields(shape: Any, args: Any, *, precision: str, cp: int, preset: bool = False) -> dict[str, Any]:
    """The planner's RunConfig fields that say what Transformer Engine runs for this line: ``transformer_impl``,
    ``unfused_attention`` (the condition, or None), ``cp_comm_type``, ``qkv_buffer_freed`` (``packed_qkv_freed``)
    and ``torch_rope_dim``."""
    comm = _get(args, "cp_comm_type", ["p2p"])
    return {"transformer_impl": _get(args, "transformer_impl", "transformer_engine"),
            "unfused_attention": unfused_attention_condition(args, precision=precision,
                                                             head_dim=attention_head_dim(shape), cp=cp),
            "cp_comm_type": tuple(comm if isinstance(comm, (list, tuple)) else [comm]),
            "qkv_buffer_freed": packed_qkv_freed(shape, args, preset=preset),
            "torch_rope_dim": torch_rope_dim(shape, args, preset=preset)}


# ---- normalization ------------------------------------------------------------------------------------

TUNED_NORM_LOAD_BYTES: dict[tuple[str, int], dict[int, int]] = {
    ("RMSNorm", 2): {512: 16, 768: 16, 1024: 16, 2048: 16, 4096: 16, 8192: 16},
    ("RMSNorm", 4): {512: 16, 768: 16, 1024: 16, 2048: 16, 4096: 16, 8192: 16},
    ("LayerNorm", 2): {768: 16, 1024: 16, 1536: 8, 2048: 16, 2304: 4, 3072: 16, 3840: 4, 4096: 16, 5120: 16,
                       6144: 16, 8192: 16, 10240: 16, 12288: 16, 12800: 4, 15360: 4, 16384: 16, 18432: 8,
                       20480: 16, 24576: 16, 25600: 8, 30720: 4, 32768: 16, 40960: 16, 49152: 16, 65536: 16},
    ("LayerNorm", 4): {768: 16, 1024: 16, 1536: 16, 2048: 16, 2304: 8, 3072: 16, 3840: 4, 4096: 16, 5120: 16,
                       6144: 16, 8192: 16, 10240: 16, 12288: 16, 12800: 4, 15360: 8, 16384: 16, 18432: 16,
                       20480: 16, 24576: 16, 25600: 4, 30720: 4, 32768: 16, 40960: 16, 49152: 16, 65536: 16},
}
"""The hidden sizes with a tuned TE norm kernel, by (normalization, element bytes), and the smaller BYTES_PER_LDG of
its forward and backward registrations (``REGISTER_NORM_LAUNCHER(..., tuned, HIDDEN, w, i, o, fp32, ...)`` with
w = i = o in normalization/{rmsnorm/rmsnorm,layernorm/ln}_{fwd,bwd_semi}_cuda_kernel.cu; bf16 and fp16 register
the same). Every other hidden size runs the general kernel."""
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_NORM_FILES = {"RMSNorm": ("rmsnorm", "normalization/rmsnorm/rmsnorm_{fwd,bwd}_kernels.cuh"),
               "LayerNorm": ("ln", "normalization/layernorm/ln_{fwd,bwd}_kernels.cuh")}


def norm_kernel(normalization: str, precision: str, hidden: int, rows: int, aligned: bool = True) -> str:
    """The TE kernels that normalize ``rows`` rows of ``hidden``: the tuned pair where this hidden size has one, the
    rows are a multiple of 4 and the pointers ``aligned`` (normalization/common.cpp ``is_tuned``), else the general
    pair."""
    prefix, where = _NORM_FILES[normalization]
    kind = "tuned" if norm_elements_per_offset(normalization, precision, hidden, rows, aligned) > 1 else "general"
    return (f"Transformer Engine {TE_VERSION}'s {prefix}_fwd_{kind}_kernel and {prefix}_bwd_{kind}_kernel "
            f"({where})")


def norm_elements_per_offset(normalization: str, precision: str, hidden: int, rows: int, aligned: bool = True) -> int:
    """Elements per unit of the kernel's 32-bit offset: 1 for the general kernels (``row * params.cols + col``),
    BYTES_PER_LDG / element size for a tuned one (``row * Ktraits::VEC_COLS + c`` counts vectors)."""
    size = _DTYPE_BYTES.get(precision, 2)
    load = TUNED_NORM_LOAD_BYTES.get((normalization, size), {}).get(hidden)
    return 1 if load is None or rows % 4 or not aligned else load // size


def norm_offsets(rows: int, hidden: int, normalization: str, precision: str, aligned: bool = True) -> int:
    """The largest offset the norm kernels form for ``rows`` x ``hidden``, plus one, in their units."""
    return rows * hidden // norm_elements_per_offset(normalization, precision, hidden, rows, aligned)


def norm_fits(rows: int, hidden: int, normalization: str, precision: str, aligned: bool = True) -> bool:
    """Whether TE's norm kernels address every element of [rows, hidden] in 32-bit int."""
    return norm_offsets(rows, hidden, normalization, precision, aligned) <= INT32_MAX


def norm_max_rows(hidden: int, normalization: str, precision: str, *, tuned: bool = False) -> int:
    """The most rows the norm kernels take at once: the general kernels', or with ``tuned`` (a tuned hidden size
    and rows a multiple of 4) the tuned kernels'."""
    elements = norm_elements_per_offset(normalization, precision, hidden, 4) if tuned else 1
    most = INT32_MAX * elements // hidden
    return most - most % 4 if elements > 1 else most


def norm_slice_rows(rows: int, hidden: int, normalization: str, precision: str, aligned: bool = True) -> int | None:
    """None where TE's norm kernels take [rows, hidden] at once (``norm_fits``: the tuned kernels' count where TE
    picks them); else the most rows a slice may hold: the general kernels' limit, which holds whichever kernel TE
    picks for a slice (a last slice whose rows are no multiple of 4 runs the general one). The one rule that the
    start-up checks and the sliced norms (``--peakflat-tile``, ``integration.norm_rows``) both read."""
    if norm_fits(rows, hidden, normalization, precision, aligned):
        return None
    return norm_max_rows(hidden, normalization, precision)


def te_norm_applies(args: Any) -> bool:
    """Whether the line's norms are Transformer Engine's: its layers (Megatron's default)."""
    return _get(args, "transformer_impl", "transformer_engine") == "transformer_engine"


def _normalization(args: Any, preset: bool) -> str:
    """--normalization: Megatron's default LayerNorm for a command line; a preset is an RMSNorm model (all are)."""
    return str(_get(args, "normalization", "RMSNorm" if preset else "LayerNorm"))


def _sequence_parallel(run: Any) -> bool:
    sp = getattr(run, "sequence_parallel", None)
    return bool(run.tp > 1 if sp is None else sp)


def _rank_tokens(run: Any) -> int:
    """Tokens a rank's MoE layer, router and whole-sequence norms see at once: seq / CP x micro-batch, / TP under
    sequence parallelism."""
    return _whole_rows(run, run.cp)


def _where(run: Any) -> str:
    parts = ["sequence" if run.cp == 1 else f"sequence / CP {run.cp}", f"x micro-batch {run.micro_batch}"]
    if _sequence_parallel(run) and run.tp > 1:
        parts.append(f"/ TP {run.tp} (sequence parallel)")
    return " ".join(parts)


def norm_sites(shape: Any, run: Any, args: Any) -> list[tuple[str, int, int, str]]:
    """(what, rows, columns, the columns' name) of the largest TE norm calls of the line: the whole-sequence norms
    over the hidden size, and with --qk-layernorm the query norm over the head dimension (per tile under
    --peakflat-tile)."""
    whole = _rank_tokens(run)
    sites = [(f"the pre-MLP and final norms run over {whole:,} rows ({_where(run)})", whole, int(shape.hidden),
              "hidden")]
    if getattr(args, "qk_layernorm", False) and getattr(shape, "mla", None) is None:
        tokens = rope_kernel_tokens(run.seq_len, run.cp, args)
        rows = tokens * run.micro_batch * max(1, shape.heads // run.tp)
        sites.append((f"the --qk-layernorm query norm runs over {rows:,} rows ({tokens:,} tokens "
                      f"({_kernel_where(tokens, run.seq_len, run.cp)}) x micro-batch {run.micro_batch} x heads "
                      f"{shape.heads} / TP {run.tp})", rows, int(shape.head_dim), "head dim"))
    return sites


def _whole_rows(run: Any, cp: int) -> int:
    return run.seq_len // cp * run.micro_batch // (run.tp if _sequence_parallel(run) else 1)


def _cp_that_fits(run: Any, hidden: int, normalization: str, precision: str, aligned: bool) -> int | None:
    """The smallest --context-parallel-size above the line's at which the whole-sequence norms fit (None: none
    within reach)."""
    tuned = aligned and hidden in TUNED_NORM_LOAD_BYTES.get((normalization, _DTYPE_BYTES.get(precision, 2)), {})
    most = norm_max_rows(hidden, normalization, precision, tuned=tuned)
    start = max(run.cp + 1, -(-_whole_rows(run, 1) // max(1, most)))
    return next((cp for cp in range(start, start + 4096)
                 if norm_fits(_whole_rows(run, cp), hidden, normalization, precision, aligned)), None)


def norm_refusal(shape: Any, run: Any, args: Any, *, preset: bool = False) -> PeakflatConfigError | None:
    """The error for a line whose TE norm kernels would address past 2**31 - 1 (naming the kernels, the rows, the
    limit and the fix); None where the norms are not TE's or every call fits."""
    normalization = _normalization(args, preset)
    if not te_norm_applies(args) or normalization not in _NORM_FILES:
        return None
    precision = getattr(run, "precision", "bf16")
    aligned = bool(getattr(run, "distributed_optimizer", True))
    tile = bool(getattr(args, "peakflat_tile_enabled", None))
    for i, (what, rows, hidden, name) in enumerate(norm_sites(shape, run, args)):
        if norm_slice_rows(rows, hidden, normalization, precision, aligned) is None:
            continue
        if i == 0 and tile:  # --peakflat-tile runs the whole-sequence norms in row slices within the limit
            continue
        elements = norm_elements_per_offset(normalization, precision, hidden, rows, aligned)
        limit = norm_max_rows(hidden, normalization, precision, tuned=elements > 1)
        offsets = norm_offsets(rows, hidden, normalization, precision, aligned)
        counted = f"{offsets:,} elements" if elements == 1 else f" / {elements} elements a load = {offsets:,} loads"
        problem = (f"{norm_kernel(normalization, precision, hidden, rows, aligned)} address [rows, hidden] in 32-bit "
                   f"int: {what} x {name} {hidden}{' = ' if elements == 1 else ''}{counted}, past 2**31 - 1 (at most "
                   f"{limit:,} rows at once here); the kernels would address out of bounds (illegal memory access)")
        if i > 0:
            fix = ("lower --peakflat-tile-tokens" if getattr(args, "peakflat_tile_enabled", None)
                   else "add --peakflat-tile (the query norm then runs per tile), or raise --context-parallel-size")
            return PeakflatConfigError("--qk-layernorm", True, problem, fix)
        fixes = [f"add {' '.join([TILE_FLAG, *tile_prerequisites(args)])} (the pre-MLP, final and MTP norms then run "
                 f"in row slices of at most {limit:,} rows)"]
        if not aligned and norm_fits(rows, hidden, normalization, precision, True):
            fixes.append("add --use-distributed-optimizer (its parameter buffer aligns the norm weight to 16 bytes, "
                         "so TE runs its tuned kernels, which count loads)")
        cp = _cp_that_fits(run, hidden, normalization, precision, aligned)
        fixes.append(f"raise --context-parallel-size to {cp} or more" if cp else "raise --context-parallel-size")
        if run.micro_batch > 1:
            fixes.append("lower --micro-batch-size")
        fix = ", or ".join(fixes)
        return PeakflatConfigError("--seq-length", run.seq_len, problem, fix)
    return None


def tile_prerequisites(args: Any) -> list[str]:
    """The flags that the tiled sublayer's start-up check needs beside ``--peakflat-tile`` and the line lacks, at
    Megatron's defaults where it leaves them out (``tile.config.PREREQUISITES``), so that a fix naming the tile names
    them all at once."""
    from ..tile.config import unmet_prerequisites

    return [fix for _, _, _, fix in unmet_prerequisites(args)]


# ---- MoE router and permutation -----------------------------------------------------------------------

ROUTER_KERNEL = (f"Transformer Engine {TE_VERSION}'s fused router (fused_topk_with_score_function.cu, "
                 "fused_score_for_moe_aux_loss.cu)")
PERMUTE_KERNEL = (f"Transformer Engine {TE_VERSION}'s fused permutation (make_row_id_map, "
                  "transformer_engine/pytorch/triton/permutation.py)")
TRITON_MAX_TENSOR_NUMEL = 2**20
"""Triton's largest block (``tl.arange``'s end - start)."""
GRID_Y_MAX = 65535
"""CUDA's largest gridDim.y."""
ROW_ID_MAP_BLOCK = 1024
"""``make_row_id_map``'s ``block_size``: tokens per program of its first two passes."""


def router_fusion_refusal(shape: Any, run: Any, args: Any) -> PeakflatConfigError | None:
    """The error for --moe-router-fusion where the router's tokens x experts passes INT_MAX, which TE's fused router
    checks (and stops on at the first forward); None otherwise."""
    experts = int(getattr(shape, "experts", 0) or 0)
    if not experts or not getattr(args, "moe_router_fusion", False):
        return None
    tokens = _rank_tokens(run)
    if tokens * experts <= INT32_MAX:
        return None
    return PeakflatConfigError(
        "--moe-router-fusion", True,
        f"{ROUTER_KERNEL} requires num_tokens x num_experts <= INT_MAX (its offsets are 32-bit int): the router "
        f"runs over {tokens:,} tokens ({_where(run)}) x {experts} experts = {tokens * experts:,}, past 2**31 - 1 "
        f"(at most {INT32_MAX // experts:,} tokens here); the first forward would stop there",
        "drop --moe-router-fusion (Megatron then routes with torch), or raise --context-parallel-size")


def _permute_tokens(run: Any, args: Any) -> int:
    """Tokens Megatron's dispatcher permutes at once: the alltoall dispatcher's own, the allgather dispatcher's
    gathered over TP x EP."""
    tokens = _rank_tokens(run)
    if _get(args, "moe_token_dispatcher_type", "allgather") == "allgather":
        tokens *= (run.tp if _sequence_parallel(run) else 1) * run.ep
    return tokens


def permute_row_id_map_width(tokens: int, experts: int) -> int:
    """``make_row_id_map``'s pass-2 block: next_power_of_2(experts x ceil(tokens / 1024))."""
    blocks = -(-tokens // ROW_ID_MAP_BLOCK)
    return 1 << max(0, (experts * blocks - 1).bit_length())


def permute_fusion_refusal(shape: Any, run: Any, args: Any) -> PeakflatConfigError | None:
    """The error for --moe-permute-fusion on Megatron's own dispatcher where TE's row-id map cannot be built for
    this many tokens (Triton's block limit or CUDA's grid); None where it can, where the flag is off, or where
    PipelinedLLEP dispatches (it never calls TE's permutation)."""
    experts = int(getattr(shape, "experts", 0) or 0)
    if not experts or not getattr(args, "moe_permute_fusion", False):
        return None
    if _get(args, "peakflat_dispatch_impl", "megatron") == "pipelined-llep":
        return None
    if _get(args, "moe_token_dispatcher_type", "allgather") not in ("alltoall", "allgather"):
        return None
    tokens = _permute_tokens(run, args)
    blocks = -(-tokens // ROW_ID_MAP_BLOCK)
    width = permute_row_id_map_width(tokens, experts)
    if width <= TRITON_MAX_TENSOR_NUMEL and blocks <= GRID_Y_MAX:
        return None
    most = min(TRITON_MAX_TENSOR_NUMEL // experts, GRID_Y_MAX) * ROW_ID_MAP_BLOCK
    if width > TRITON_MAX_TENSOR_NUMEL:
        why = (f"compiles a Triton block of next_power_of_2({experts} experts x ceil({tokens:,} tokens / 1024)) = "
               f"{width:,} elements, past Triton's 2**20")
    else:
        why = f"launches a grid of ceil({tokens:,} tokens / 1024) = {blocks:,} blocks in y, past CUDA's 65535"
    return PeakflatConfigError(
        "--moe-permute-fusion", True,
        f"{PERMUTE_KERNEL} {why} (at most {most:,} tokens at once here; the "
        f"{_get(args, 'moe_token_dispatcher_type', 'allgather')} dispatcher permutes {tokens:,}); the first forward "
        "would fail there",
        "drop --moe-permute-fusion (Megatron then permutes with torch), or add --peakflat-dispatch pipelined-llep "
        "(its own permutation), or raise --context-parallel-size")


# ---- the line ---------------------------------------------------------------------------------------

def rope_line_refusal(shape: Any, run: Any, args: Any, *, preset: bool = False) -> PeakflatConfigError | None:
    """The fused RoPE refusal (``fused_rope_refusal``) for a planner ``shape`` and ``run``: the one limit that
    ``--peakflat auto`` switches off with a flag (``--no-rope-fusion``)."""
    return fused_rope_refusal(args, seq_len=run.seq_len, cp=run.cp, micro_batch=run.micro_batch, heads=shape.heads,
                              kv_heads=shape.kv_heads, head_dim=shape.head_dim, tp=run.tp, preset=preset)


def unfused_cp_refusal(run: Any) -> PeakflatConfigError | None:
    """The error where a line that only TE's unfused backend could run (``run.unfused_attention``) asks for context
    parallelism, which that backend does not support (``get_attention_backend`` disables it under CP): TE then has
    no attention backend for the line and stops at the first step. None otherwise."""
    if not getattr(run, "unfused_attention", None) or run.cp <= 1:
        return None
    return PeakflatConfigError(
        "--context-parallel-size", run.cp,
        f"Transformer Engine {TE_VERSION} runs no attention backend for this line: flash and fused attention do not "
        f"take it ({run.unfused_attention.split(':')[0]}), and its unfused backend does not support context "
        "parallelism; the first step would stop there",
        f"{run.unfused_attention.split(': ', 1)[-1]}, or pass --context-parallel-size 1")


def hard_refusal(shape: Any, run: Any, args: Any, *, preset: bool = False) -> PeakflatConfigError | None:
    """The first limit for which auto adds no Megatron flag: TE's norms, its fused router, its fused permutation
    (``norm_refusal``, ``router_fusion_refusal``, ``permute_fusion_refusal``; the whole-sequence norms are not
    reached where auto turns the tiled sublayer on, nor the permutation where it turns PipelinedLLEP on); None
    where all fit."""
    return (unfused_cp_refusal(run) or norm_refusal(shape, run, args, preset=preset)
            or router_fusion_refusal(shape, run, args) or permute_fusion_refusal(shape, run, args))


def line_refusal(shape: Any, run: Any, args: Any, *, preset: bool = False) -> PeakflatConfigError | None:
    """The first of Transformer Engine's length limits that this line (a planner ``shape`` and ``run`` and its
    flags) passes: fused RoPE, then ``hard_refusal``'s; None where TE runs the line."""
    return rope_line_refusal(shape, run, args, preset=preset) or hard_refusal(shape, run, args, preset=preset)
