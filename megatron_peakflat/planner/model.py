"""Analytic per-rank memory model of a Megatron MoE run, with peakflat off and on.

``plan(shape, run, peakflat)`` returns, for the first and the last pipeline stage (and each middle stage
that no earlier one bounds), one ``Row`` per
memory term: parameters, gradients, optimizer state, saved activations, the peaks that the components bound,
each row named for its component (``dispatch``: expert dispatch, ``vocab``: vocabulary projection, ``sco``:
checkpoint boundaries, ``optimizer``: optimizer staging, ``tile``: attention's backward) and a runtime reserve.
Each row holds the baseline bytes (Megatron as flagged), the peakflat bytes (all four components
on, with the knobs given), the bound that the component guarantees whatever the routing or token
count, the pinned host bytes, and the source of the formula.

Notation (per rank, per micro-batch): ``w`` bytes per element of params/activations (2 for
bf16/fp16, 4 for fp32); ``T = seq_len * micro_batch / cp`` tokens that each CP rank's layers
see; ``r = T / tp`` with sequence parallelism (the rows of [s, b, h] tensors a rank holds between
layers), else ``T``; ``R = r * topk * skew`` token-expert pairs a rank's experts receive
(balanced routing has ``skew = 1``). ``E_p`` = expert-parallel size.

The total of a stage is ``persistent + max(phase)``, not the sum of every row: the vocabulary
projection (end of forward) and a layer's backward (recompute + dispatch) never overlap.
``persistent`` = parameters + gradients + optimizer + sco (boundaries) + saved activations + reserve.

Calibration: the dispatch and vocabulary baselines reproduce peaks measured on one H200 (Megatron's
alltoall MoE layer 5.1/10.3/20.6 GiB at 16K/32K/64K tokens, H=4096, 64 experts top-8, F=1536; native / fused
cross-entropy 36.8 / 61.4 GiB at N=32768, V=201088) within 5%; tests/test_planner.py holds them as numbers.

No torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

from .. import components
from ..attention.calls import kv_head_calls
from ..config import PeakflatConfig
from ..config_base import PeakflatConfigError
from ..dispatch.bound import (auto_max_foreign, chunk_count, flow_chunk_rows, overlap_on, segment_piece_rows,
                              split_floor, weight_sends_bound, working_set_bound)
from ..dispatch.config import resolve_membership
from ..optimizer.config import fp16_grads_clipped
from ..tile.bound import tiled_attention_peak_bytes
from ..vocab.sizes import auto_block_size, auto_chunk_tokens
from .shapes import ModelShape

__all__ = ["RunConfig", "Row", "StagePlan", "Plan", "plan", "pipeline_split", "padded_vocab", "virtual_stages",
           "chunks_in_flight", "GIB", "COMPONENTS", "experts_have_own_optimizer"]

GIB = 2**30


def experts_have_own_optimizer(ep: int, etp: int, tp: int) -> bool:
    """Whether Megatron chains an optimizer for the expert parameters apart from the dense ones: only on expert
    process groups, EP > 1 or ETP != TP (tensor_parallel/layers.py and TE's layers set ``allreduce = False``
    there, and ``get_megatron_optimizer`` builds one optimizer per reduction group); otherwise one holds both."""
    return ep > 1 or etp != tp
RESERVE_FIXED = 2 * GIB
"""CUDA context, NCCL/gloo buffers and cuBLAS workspaces (measured ~1-2 GiB on H200 nodes)."""
RESERVE_FRACTION = 0.05
"""Caching-allocator fragmentation, as a share of HBM."""
COMPONENTS = components.planner_terms()
"""The rows that a peakflat component bounds (``components.COMPONENTS``' planner terms, each the component's name:
dispatch, vocab, sco, optimizer, tile)."""


@dataclass(frozen=True)
class RunConfig:
    """The Megatron run around a model: sequence, batch, parallel sizes, recompute, precision."""

    seq_len: int
    """--seq-length."""
    micro_batch: int = 1
    """--micro-batch-size."""
    global_batch: int | None = None
    """--global-batch-size; None: ``default_micro_batches`` per DP rank."""
    default_micro_batches: int | None = None
    """Micro-batches per step and DP rank without a global batch: 1 for a Megatron command line (its default
    global batch is micro-batch x DP, arguments.py); None: 2 x PP (1 without PP), what a preset assumes, so
    that 1F1B fills the pipeline."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int = 1
    etp: int = 1
    """--expert-tensor-parallel-size."""
    sequence_parallel: bool | None = None
    """--sequence-parallel; None: on when TP > 1 (Megatron requires it for MoE with TP)."""
    recompute: Literal["none", "selective", "full"] = "full"
    """--recompute-granularity."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """--recompute-modules, read under selective recompute (Megatron's default: core_attn, which with flash
    attention saves nothing the planner counts). Modelled: moe, moe_act, mlp, shared_experts (``recomputes``)."""
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    distributed_optimizer: bool = True
    """--use-distributed-optimizer."""
    grads_fp32: bool | None = None
    """--accumulate-allreduce-grads-in-fp32 (grad buffer in fp32). None: Megatron's default, which is fp32 for
    bf16 training (megatron/training/arguments.py turns the flag on unless --grad-reduce-in-bf16 or
    --main-grads-dtype bf16) and the parameters' dtype otherwise."""
    clip_grad: float = 1.0
    """--clip-grad (Megatron's default 1.0; 0 turns clipping off)."""
    optimizer: str = "adam"
    """--optimizer: Adam's state is planned, and SGD's; another is planned as Adam (and named as not modelled)."""
    sgd_momentum: float = 0.9
    """--sgd-momentum: SGD keeps a momentum buffer unless it is 0."""
    exp_avg_bytes: int = 4
    exp_avg_sq_bytes: int = 4
    main_params_bytes: int = 4
    """Adam's moments and the master weights per parameter (--exp-avg-dtype, --exp-avg-sq-dtype,
    --main-params-dtype under --use-precision-aware-optimizer; fp32 otherwise)."""
    optimizer_offload_fraction: float = 0.0
    """--optimizer-cpu-offload with --optimizer-offload-fraction (Megatron's HybridDeviceOptimizer)."""
    cross_entropy_fusion: bool = False
    """--cross-entropy-loss-fusion (fused_vocab_parallel_cross_entropy)."""
    deterministic: bool = False
    """--deterministic-mode (torch.use_deterministic_algorithms): torch SDPA's backward is then flash attention's
    deterministic one, whose fp32 dQ accumulator has one copy per split (``flash_dq_splits``); on TE's layers cuDNN's
    deterministic one, with an s_q x s_kv workspace (``deterministic_workspace``)."""
    sm_count: int = 132
    """Streaming multiprocessors per GPU (H100/H200: 132), which set that split count."""
    fused_adam: bool = False
    """Megatron's Adam is Transformer Engine's or apex's FusedAdam. Without either Megatron falls back to
    torch.optim.AdamW, whose multi-tensor step allocates one fp32 tensor the size of its shard (the square
    roots of exp_avg_sq): 19.14 GiB for 5.14B parameters on one H200 (pretrain_recommended_16k.json)."""
    transformer_impl: str = "transformer_engine"
    """--transformer-impl: Transformer Engine's layers (Megatron's default) or Megatron's local ones."""
    unfused_attention: str | None = None
    """Why Transformer Engine runs its unfused attention backend for this line (``te_limits``), whose s x s
    scores the plan then counts; None: flash or cuDNN's fused attention, which hold none."""
    cp_comm_type: tuple[str, ...] = ("p2p",)
    """--cp-comm-type (the unfused backend's scores under CP depend on it)."""
    activation_fusion: bool = True
    """Megatron's fused SwiGLU (``--bias-swiglu-fusion``, on unless ``--no-bias-swiglu-fusion``): on the GPU a
    torch.compile'd autograd function (fusions/fused_bias_swiglu.py ``WeightedSwiGLUFunction``) whose forward saves
    only its input and whose backward writes only the input's gradient, so PipelinedLLEP's experts hold none of the
    unfused ops' intermediates (``llep_expected_working_set``)."""
    torch_rope_dim: int = 0
    """The dimensions per head that torch's RoPE rotates (``te_limits.torch_rope_dim``: --no-rope-fusion, head dim x
    --rotary-percent); 0 where TE's fused kernel rotates or there is no RoPE. Torch's saves a cos and a sin table
    for each of q and k (``rope_tables``)."""
    qkv_buffer_freed: bool = False
    """Nothing attention saves is a view of the packed QKV projection output, so its q and k parts are not alive in
    attention's backward (``te_limits.packed_qkv_freed``: RoPE on Transformer Engine's layers, or peakflat's SDPA
    attention on the local spec)."""
    routing_skew: float = 1.0
    """max/mean tokens received per expert-parallel rank (1: balanced)."""
    hbm_bytes: int = 80 * GIB
    host_bytes_per_node: int = 1024 * GIB
    gpus_per_node: int = 8
    first_stage_layers: int | None = None
    """--decoder-first-pipeline-num-layers."""
    last_stage_layers: int | None = None
    """--decoder-last-pipeline-num-layers."""
    embedding_in_split: bool = False
    """--account-for-embedding-in-pipeline-split: the embedding takes one layer's place on the first stage."""
    loss_in_split: bool = False
    """--account-for-loss-in-pipeline-split: the loss takes one layer's place on the last stage."""
    stage_layout: tuple[int, ...] | None = None
    """Decoder layers of each stage of --pipeline-model-parallel-layout, in its order: PP stages, or PP x VPP
    virtual ones (stage i on pipeline rank i mod PP)."""
    stage_layout_mtp: tuple[int, ...] | None = None
    """MTP layers ('m') of each stage of the same layout; None: every MTP layer on the last rank (Megatron's
    rule without a layout)."""
    vocab_divisible_by: int = 128
    """--make-vocab-size-divisible-by: Megatron pads the vocabulary to a multiple of this x TP."""
    vpp: int | None = None
    """Virtual pipeline stages (model chunks) per rank, the interleaved 1F1B schedule: Megatron's
    virtual_pipeline_model_parallel_size or --num-virtual-stages-per-pipeline-rank; None: from the layout or
    ``layers_per_virtual_stage``, else 1."""
    layers_per_virtual_stage: int | None = None
    """--num-layers-per-virtual-pipeline-stage."""
    vp_group: int | None = None
    """--microbatch-group-size-per-virtual-pipeline-stage; None: PP (Megatron's default)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def w(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of DDP's grad buffer (``grads_fp32``; unset: fp32 for bf16, as Megatron does)."""
        fp32 = self.precision == "bf16" if self.grads_fp32 is None else self.grads_fp32
        return 4 if fp32 else self.w

    @property
    def tokens(self) -> float:
        """T: tokens of one micro-batch that each CP rank's layers see."""
        return self.seq_len * self.micro_batch / self.cp

    @property
    def layer_rows(self) -> float:
        """r: rows of the [s, b, h] tensors one rank holds between layers (T / TP under SP, else T)."""
        return self.tokens / self.tp if self.sp else self.tokens

    @property
    def tp_tokens(self) -> float:
        """T / TP: the tokens of one TP rank's share (the vocabulary projection's rows)."""
        return self.tokens / self.tp

    @property
    def expert_dp(self) -> int:
        """Megatron's expert-data-parallel size: world / (PP x ETP x EP)."""
        return max(1, self.tp * self.cp * self.dp // (self.etp * self.ep))

    @property
    def num_micro(self) -> int:
        if self.global_batch is None:
            if self.default_micro_batches is not None:
                return self.default_micro_batches
            return 2 * self.pp if self.pp > 1 else 1
        return max(1, self.global_batch // (self.micro_batch * self.dp))

    @property
    def ranks_per_node(self) -> int:
        return max(1, min(self.world, self.gpus_per_node))

    @property
    def host_bytes_per_rank(self) -> int:
        """90% of the node's host RAM, shared by its local ranks."""
        return int(self.host_bytes_per_node * 0.9) // self.ranks_per_node


@dataclass
class Row:
    """One memory term of one stage, per rank, in bytes."""

    name: str
    baseline: float
    peakflat: float
    bound: float | None = None
    host_baseline: float = 0.0
    host_peakflat: float = 0.0
    phase: Literal["persistent", "layer", "attention", "moe", "mlp", "loss", "build", "step"] = "persistent"
    source: str = ""


@dataclass
class StagePlan:
    stage: str
    layers: int
    moe_layers: int
    inflight: float
    """Micro-batches in flight at the stage's peak, in whole stages' worth (fractional when interleaved)."""
    rows: dict[str, Row]
    notes: list[str] = field(default_factory=list)

    def total(self, which: Literal["baseline", "peakflat"], *, guaranteed: bool = False, build: bool = True) -> float:
        """The largest of the phases' peaks: training's (``training``); the optimizer step's; and the model
        build's (``build``). A step or build phase holds its own rows plus the rows ``ALIVE`` names for it.

        ``guaranteed``: count each bounded peakflat row at its bound when that is larger (dispatch
        under the worst routing), so a fit holds whatever the tokens do."""
        return max(self.phase_totals(which, guaranteed=guaranteed, build=build).values())

    def training(self, which: Literal["baseline", "peakflat"], *, guaranteed: bool = False) -> float:
        """The forward and backward's peak: persistent + the larger of the loss and the layer backward, where
        the layer's saved tensors ('layer') meet either attention's backward or the MoE's, never both."""
        per = self._phases(which, guaranteed)
        return sum(per[p] for p in self._live(per))

    def live_phases(self, which: Literal["baseline", "peakflat"], *, guaranteed: bool = False) -> set[str]:
        """The phases whose rows make the training peak (the rows worth shrinking)."""
        return self._live(self._phases(which, guaranteed))

    @staticmethod
    def _live(per: dict[str, float]) -> set[str]:
        inner = max(("attention", "moe", "mlp"), key=lambda p: per[p])  # one of them at a time
        if per["layer"] + per[inner] >= per["loss"]:
            return {"persistent", "layer", inner}
        return {"persistent", "loss"}

    def phase_totals(self, which: Literal["baseline", "peakflat"], *, guaranteed: bool = False, build: bool = True
                     ) -> dict[str, float]:
        """Each phase's peak: 'training', and 'step' / 'build' where rows of theirs exist."""
        per = self._phases(which, guaranteed)
        out = {"training": sum(per[p] for p in self._live(per))}
        for phase in ("step", "build") if build else ("step",):
            if per[phase]:
                out[phase] = per[phase] + sum(getattr(self.rows[n], which) for n in ALIVE[phase] if n in self.rows)
        return out

    def _phases(self, which: Literal["baseline", "peakflat"], guaranteed: bool = False) -> dict[str, float]:
        per = dict.fromkeys(PHASES, 0.0)
        for row in self.rows.values():
            v = getattr(row, which)
            if guaranteed and which == "peakflat" and row.bound is not None:
                v = max(v, row.bound)
            per[row.phase] += v
        return per

    def host(self, which: Literal["baseline", "peakflat"]) -> float:
        return sum(getattr(r, "host_" + which) for r in self.rows.values())

    def binding(self, which: Literal["baseline", "peakflat"]) -> str:
        """The largest row that counts in the total (the peak to lower next)."""
        totals = self.phase_totals(which)
        phase = max(totals, key=lambda k: totals[k])
        live = self.live_phases(which) if phase == "training" else {phase}
        rows = [r for r in self.rows.values() if r.phase in live and r.name != "reserve"]
        return max(rows, key=lambda r: getattr(r, which)).name


PHASES = ("persistent", "layer", "attention", "moe", "mlp", "loss", "build", "step")
"""When a row is alive: always; through a layer's backward (its saved tensors); in attention's backward; in
the MoE's backward (the dispatch); in the loss; while the model is built; in the optimizer step."""

ALIVE = {"build": ("parameters", "gradients", "reserve"),
         "step": ("parameters", "gradients", "optimizer", "reserve", "dispatcher state")}
"""The persistent rows allocated during the model build (the optimizer's state and every activation come
later) and during the optimizer step (activations and boundaries are gone by then; Megatron's dispatchers keep
their state until the next forward)."""


@dataclass
class Plan:
    shape: ModelShape
    run: RunConfig
    peakflat: PeakflatConfig
    stages: list[StagePlan]
    chunk_cap_effective: int
    vocab_schedule: str
    sco_budget: int
    stage_of: tuple[str, ...] = ()
    """For each pipeline rank, the planned stage whose memory bounds its own (its own label when planned)."""

    def worst(self, which: Literal["baseline", "peakflat"]) -> StagePlan:
        return max(self.stages, key=lambda s: s.total(which))

    def fits(self, which: Literal["baseline", "peakflat"], *, guaranteed: bool = False) -> bool:
        hbm_ok = all(s.total(which, guaranteed=guaranteed) <= self.run.hbm_bytes for s in self.stages)
        host_ok = max(s.host(which) for s in self.stages) <= self.run.host_bytes_per_rank
        return hbm_ok and host_ok


# ----------------------------------------------------------------------------------------------
# Parameter counts. Source: the weights Megatron's local spec allocates per layer
# (megatron/core/transformer/attention.py SelfAttention linear_qkv / linear_proj,
# multi_latent_attention.py, mlp.py linear_fc1 (2 x FFN with --swiglu) / linear_fc2,
# moe/router.py TopKRouter.weight [E, H], moe/experts.py SequentialMLP / GroupedMLP E/EP experts,
# moe/shared_experts.py, models/common/embeddings/language_model_embedding.py, gpt_model.output_layer).
# ----------------------------------------------------------------------------------------------

def attention_params(s: ModelShape, tp: int) -> float:
    """Attention weights of one layer on one TP rank (norms included, replicated)."""
    h = s.hidden
    if s.mla is None:
        qkv = h * (s.heads + 2 * s.kv_heads) * s.head_dim
        proj = s.heads * s.head_dim * h
        return (qkv + proj) / tp + 2 * h
    m = s.mla
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    q = (h * m.q_lora_rank + m.q_lora_rank * s.heads * qk / tp) if m.q_lora_rank else h * s.heads * qk / tp
    kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * s.heads * (m.qk_head_dim + m.v_head_dim) / tp
    proj = s.heads * m.v_head_dim * h / tp
    return q + kv + proj + 2 * h + (m.q_lora_rank or 0) + m.kv_lora_rank


def mlp_params(h: int, ffn: int, gated: bool, tp: int) -> float:
    return (3 if gated else 2) * h * ffn / tp


def stage_params(s: ModelShape, run: RunConfig, n_dense: int, n_moe: int, embedding: bool, output: bool,
                 output_shards: int = 1, mtp: int = 0) -> tuple[float, float]:
    """(dense params, expert params) held by one rank of a stage. ``output_shards`` > 1: the output layer's
    rows are split over the expert-parallel group (``--peakflat-vocab-shard-over-ep``), an expert-parallel
    parameter (integration/vocab_shard.py). ``mtp``: of the layers, how many are MTP layers, each with its
    eh_proj [H, 2H] / TP and three norms (enorm, hnorm, final) beside its transformer layer."""
    dense = (n_dense + n_moe) * attention_params(s, run.tp) + n_dense * mlp_params(s.hidden, s.ffn, s.gated, run.tp)
    dense += mtp * (2 * s.hidden * s.hidden / run.tp + 3 * s.hidden)
    dense += n_moe * (s.hidden * s.experts + mlp_params(s.hidden, s.shared_ffn, s.gated, run.tp))
    expert = n_moe * (s.experts / run.ep) * mlp_params(s.hidden, s.moe_ffn, s.gated, run.etp)
    if embedding:
        dense += s.vocab * s.hidden / run.tp
    if output:
        dense += s.hidden  # the final norm
    if output and not (s.tied_embeddings and embedding):
        if output_shards > 1:
            expert += s.vocab * s.hidden / output_shards
        else:
            dense += s.vocab * s.hidden / run.tp
    return dense, expert


# ----------------------------------------------------------------------------------------------
# Activations saved for backward by one layer, per micro-batch (Korthikanti et al. 2022 counting,
# redone for Megatron-Core's local spec with SDPA/flash core attention, RMSNorm, SwiGLU, no dropout):
#   RMSNorm saves its input (w) and rstd (fp32);   ColumnParallelLinear saves its un-gathered input
#   under SP (tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication);
#   SDPA saves q, k, v, out and a fp32 logsumexp per head; bias_swiglu saves fc1's output;
#   linear_fc2 saves the activation output.
# ----------------------------------------------------------------------------------------------

def attention_activations(s: ModelShape, run: RunConfig) -> float:
    t, w = run.tp, run.w
    T, r = run.tokens, run.layer_rows
    norm = r * s.hidden * (2 * w) + r * 4  # ln input + ln output (qkv input) + rstd
    if s.mla is None:
        qkvo = T / t * ((s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim) * w
    else:
        m = s.mla
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        latent = T * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim) * w
        qkvo = T / t * s.heads * (2 * qk + 2 * m.v_head_dim) * w + latent
    lse = T / t * s.heads * 4
    return norm + qkvo + lse + _repeated_kv(s, run) * w + _concatenated_output(s, run) + rope_tables(run)


def rope_tables(run: RunConfig) -> float:
    """What torch's RoPE saves beyond q and k: Megatron's unfused rotation (rope_utils ``_apply_rotary_pos_emb_bshd``)
    casts cos and sin of the [s, 1, 1, d] frequencies to the model's dtype for each of q and k, and ``t * cos`` and
    ``rotate_half(t) * sin`` save them: four tables of the rank's sequence (seq / CP) by the rotated dims, whatever the
    micro-batch and TP. Traced with saved-tensor hooks (tests/test_planner.py)."""
    return 4 * (run.seq_len // run.cp) * run.torch_rope_dim * run.w


def _concatenated_output(s: ModelShape, run: RunConfig) -> float:
    """Bytes the SDPA attention adds to the saved tensors where it runs one call per K/V head
    (``flash_gqa_calls``): the calls' outputs, which flash saves for backward, and their concatenation, which the
    output projection saves, are two tensors where one call's output is one."""
    if flash_gqa_calls(s, run) == 1:
        return 0.0
    return run.tokens / run.tp * s.heads * s.head_dim * run.w


def _repeated_kv(s: ModelShape, run: RunConfig) -> float:
    """Elements the SDPA attention adds at CP 1 by repeating grouped K and V to the query heads
    (``sdpa_repeats_kv``): saved for backward, and again as their gradients in it. Under CP the gathered K/V
    terms count them."""
    if run.cp > 1:
        return 0.0
    return run.tokens * _kv_rows_per_token(s, run) * (_kernel_kv_factor(s, run) - 1)


def flash_dq_splits(s: ModelShape, run: RunConfig, calls: int = 1) -> int:
    """Copies of the fp32 dQ accumulator in flash attention's backward: one, or under deterministic algorithms
    ceil(SMs / (batch x heads)) (flash_api.cpp mha_bwd), e.g. 5 for 32 heads on an H200; ``calls``: the calls the
    heads are split into (``flash_gqa_calls``), each with its share of the heads. Measured with torch 2.11's SDPA
    at 32K and 128K tokens (docs/evidence/probes/attention_backward_peak.txt): 5.02 units of [s, hidden] bf16
    beside the inputs without, 13.02 with; at 8, 16 and 64 heads 37.02, 21.02 and 9.02 with
    (probes/attention_backward_heads.txt), 3 + 2 x this count each time."""
    if not run.deterministic:
        return 1
    return max(1, -(-run.sm_count // max(1, run.micro_batch * s.heads // run.tp // calls)))


def flash_takes_grouped_heads(s: ModelShape, run: RunConfig) -> bool:
    """Whether the SDPA attention (the local spec's) hands grouped K/V heads to flash attention as they are: grouped
    heads where flash runs (not fp32: ``sdpa_repeats_kv``)."""
    return (run.transformer_impl == "local" and s.mla is None and s.kv_heads != s.heads
            and not sdpa_repeats_kv(s, run))


def _whole_sequence_kv_head_calls(s: ModelShape, run: RunConfig) -> int:
    """attention/calls.py ``kv_head_calls`` for one attention of this TP rank's heads over the keys of the whole
    sequence (under CP the gathered one): one per K/V head at long key lengths, else 1."""
    return kv_head_calls(max(1, s.heads // run.tp), max(1, s.kv_heads // run.tp), run.seq_len * run.micro_batch)


def flash_gqa_calls(s: ModelShape, run: RunConfig) -> int:
    """The SDPA calls one attention of the layer runs as where flash takes grouped heads
    (``_whole_sequence_kv_head_calls``), else 1."""
    return _whole_sequence_kv_head_calls(s, run) if flash_takes_grouped_heads(s, run) else 1


def flash_gqa_expansion(s: ModelShape, run: RunConfig) -> float:
    """Bytes of flash attention's backward dK and dV at the query heads of one call over the whole sequence's keys
    (FlashAttention-2's mha_bwd ``dk_expanded``, ``dv_expanded``, which it then sums to the K/V heads); 0 where
    flash does not take grouped heads."""
    if not flash_takes_grouped_heads(s, run):
        return 0.0
    keys = run.seq_len * run.micro_batch
    return 2 * keys * s.heads / run.tp / flash_gqa_calls(s, run) * s.head_dim * run.w


def te_tile_calls(s: ModelShape, run: RunConfig) -> int:
    """The calls the tiled sublayer runs one Transformer Engine attention over the whole (under CP the gathered)
    sequence's keys as (integration/tile.py ``te_kv_head_calls``): one per K/V head of this TP rank where cuDNN's
    backward would expand grouped heads (``te_limits.gqa_expansion_applies``) and the keys are long, else 1."""
    from .te_limits import gqa_expansion_applies

    applies = gqa_expansion_applies(run, heads=s.heads, kv_heads=s.kv_heads, mla=s.mla is not None)
    return _whole_sequence_kv_head_calls(s, run) if applies else 1


def te_call_shape(s: ModelShape, run: RunConfig, tile: int | None = None) -> tuple[float, float, float]:
    """(heads, queries, keys) of the layer's largest Transformer Engine attention call, before TP:
    ``te_limits.attention_call_shape``'s, or in the tiled sublayer (``tile``: its tokens) one tile of the query
    heads of one call (``te_tile_calls``) against the whole (under CP the gathered) sequence."""
    from .te_limits import attention_call_shape

    if tile is not None:
        return float(s.heads) / te_tile_calls(s, run), float(tile), float(run.seq_len)
    return attention_call_shape(heads=s.heads, seq_len=run.seq_len, cp=run.cp, cp_comm=run.cp_comm_type)


def te_gqa_expansion(s: ModelShape, run: RunConfig, tile: int | None = None) -> float:
    """Bytes of dK and dV at the query heads in cuDNN's backward workspace for the layer's largest TE attention call
    (``te_call_shape``; ``tile``: the tiled sublayer's tokens) (``te_limits.gqa_expansion_bytes``); 0 where TE's
    fused attention does not run or the heads are not grouped."""
    from .te_limits import gqa_expansion_applies, gqa_expansion_bytes

    if not gqa_expansion_applies(run, heads=s.heads, kv_heads=s.kv_heads, mla=s.mla is not None):
        return 0.0
    heads, _, keys = te_call_shape(s, run, tile)
    return gqa_expansion_bytes(micro_batch=run.micro_batch, heads=heads, tp=run.tp, kv_tokens=keys,
                               head_dim=s.head_dim, bytes_per_element=run.w)


def dq_accumulator_bytes(s: ModelShape, run: RunConfig, q_elements: float, calls: int = 1) -> float:
    """The attention backward's fp32 dQ accumulator(s) for ``q_elements`` query elements: one per split
    (``flash_dq_splits``), none in cuDNN's deterministic backward, which keeps dP in its workspace instead
    (``te_limits.deterministic_workspace_applies``; measured: docs/evidence/gpu_tile_te_h100.txt)."""
    from .te_limits import deterministic_workspace_applies

    if deterministic_workspace_applies(run):
        return 0.0
    return q_elements * 4 * flash_dq_splits(s, run, calls)


def attention_backward_transient(s: ModelShape, run: RunConfig) -> float:
    """What core attention's backward holds beside the layer's saved tensors, where a long-context layer
    peaks: dQ, dK, dV, flash attention's fp32 dQ accumulator(s) and dO, plus the rotated copies of q and k
    beside the packed QKV buffer that v's view keeps alive where attention saves that view
    (``RunConfig.qkv_buffer_freed``). Measured at 128K tokens on one H200
    (docs/evidence/memory_peak_128k.txt, under --deterministic-mode): the run's peak sat in this backward."""
    t, w = run.tp, run.w
    T = run.tokens
    if s.mla is None:
        q = T / t * s.heads * s.head_dim
        k = v = T / t * s.kv_heads * s.head_dim
        rotated = 0.0 if run.qkv_buffer_freed else (q + k) * w
    else:
        m = s.mla
        q = k = T / t * s.heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)
        v = T / t * s.heads * m.v_head_dim
        rotated = T / t * (s.heads + 1) * m.qk_pos_emb_head_dim * w
    d_out = T / t * s.heads * (s.head_dim if s.mla is None else s.mla.v_head_dim)
    calls = flash_gqa_calls(s, run)
    # one call's kernel scratch; with several, the split's backward then concatenates the calls' dQ, dK and dV
    kernel = dq_accumulator_bytes(s, run, q / calls, calls) + flash_gqa_expansion(s, run) + te_gqa_expansion(s, run)
    gathered = (q + k + v) * w if calls > 1 else 0.0
    return (q + k + v + _repeated_kv(s, run)) * w + max(kernel, gathered) + d_out * w + rotated


def cp_gathers_kv(run: RunConfig, pf: PeakflatConfig) -> bool:
    """Whether each layer's core attention all-gathers K and V over the context-parallel group: the SDPA core
    attention at CP > 1 (``--peakflat-attention sdpa``). ``auto`` is planned as Transformer Engine's attention,
    whose default ring (``--cp-comm-type p2p``) gathers nothing; where it resolves to SDPA (no Transformer Engine),
    the runtime report plans it as 'sdpa' (integration/peaks.py), and the planner takes ``--peakflat-attention
    sdpa`` for the same."""
    return run.cp > 1 and pf.general.attention == "sdpa"


def sdpa_repeats_kv(s: ModelShape, run: RunConfig) -> bool:
    """Whether the SDPA attention of the tiled sublayer and of CP > 1 (attention/context_parallel.py ``_attend``)
    repeats grouped K/V heads to the query heads: on the local spec in fp32, where flash (the one CUDA kernel that
    takes grouped heads) does not run and the memory-efficient kernel takes only as many K/V heads as queries."""
    return (run.transformer_impl == "local" and run.precision == "fp32" and s.mla is None
            and s.kv_heads != s.heads)


def _kernel_kv_factor(s: ModelShape, run: RunConfig) -> float:
    """How many times the attention kernel's K and V outnumber the model's (``sdpa_repeats_kv``): 1, or
    heads / kv_heads."""
    return s.heads / s.kv_heads if sdpa_repeats_kv(s, run) else 1.0


def _kv_rows_per_token(s: ModelShape, run: RunConfig) -> float:
    """Elements of K plus V per token on one TP rank."""
    if s.mla is None:
        return 2 * s.kv_heads * s.head_dim / run.tp
    m = s.mla
    return s.heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) / run.tp


def cp_gathered_kv(s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> float:
    """Bytes one layer's attention keeps from forward to backward beyond the rank's own K and V under context
    parallelism (``cp_gathers_kv``): the gathered K and V of the whole sequence, [s, b, kv_heads x head_dim / TP]
    each, which SDPA saves for backward (attention/context_parallel.py), less the T tokens' K and V the CP=1
    count (``attention_activations``) already holds."""
    if not cp_gathers_kv(run, pf):
        return 0.0
    whole = run.seq_len * run.micro_batch * _kernel_kv_factor(s, run)  # as SDPA saves them
    return (whole - run.tokens) * _kv_rows_per_token(s, run) * run.w


def cp_gathered_kv_backward(s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> float:
    """What attention's backward builds beside ``attention_backward_transient`` under context parallelism
    (``cp_gathers_kv``): the dK and dV that SDPA returns for the rank's two query chunks, which see the keys up to
    their own ends (s + c tokens together, c = s / 2CP), and what attention/context_parallel.py adds while it
    reduces them onto their owners one chunk at a time (the rank's own 2c and one chunk c), less the rank's own dK
    and dV (2c) the CP=1 count holds: s + 2c = s + s / CP tokens' worth. Causal, no dataloader mask (with one each
    chunk sees every key: s more)."""
    if not cp_gathers_kv(run, pf):
        return 0.0
    whole = run.seq_len * run.micro_batch
    return (whole + whole / run.cp) * _kv_rows_per_token(s, run) * _kernel_kv_factor(s, run) * run.w


def tiles_attention(s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> bool:
    """Whether the tiled attention sublayer (``--peakflat-tile``) runs the layers' self-attention: on, and a
    configuration its start-up check admits (no sequence parallelism, no multi-latent attention; under context
    parallelism it tiles each rank's two chunks)."""
    return bool(pf.enabled.get("tile")) and not run.sp and s.mla is None


def tile_tokens(run: RunConfig, pf: PeakflatConfig) -> int:
    """The tile the sublayer runs with on this rank's sequence (``--peakflat-tile-tokens``, or its 'auto'; under
    CP at most one of the rank's two chunks)."""
    return pf.tile.tile_tokens(run.seq_len // run.cp, run.cp)


def tiled_attention_bytes(s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> float:
    """The tiled sublayer's backward peak of one layer on one rank (``tile.bound.tiled_attention_peak_bytes``):
    whole-sequence K, V and their gradient sums (under CP the gathered sequence's, with the rank's reduce-scattered
    dK and dV and a chunk the collectives' reordering holds), the incoming gradient and dx, and one tile's working
    set, with flash attention's fp32 dQ accumulator counted once per split (``flash_dq_splits``)."""
    seq = run.seq_len // run.cp
    tile = tile_tokens(run, pf)
    tile_q = tile * run.micro_batch * s.heads / run.tp * s.head_dim
    extra_dq = max(0.0, dq_accumulator_bytes(s, run, tile_q) - tile_q * 4)  # the bound counts one accumulator
    # repeated K/V heads (sdpa_repeats_kv): the prefix's repeated K and V, and the kernel's gradients of them
    prefix_kv = run.seq_len * run.micro_batch * _kv_rows_per_token(s, run)  # K plus V over the longest prefix
    repeated = 2 * prefix_kv * _kernel_kv_factor(s, run) * run.w if sdpa_repeats_kv(s, run) else 0
    # flash's (cuDNN's) expanded dK/dV over the prefix for one call; with a call per K/V head, the split's
    # gathered dK/dV of the prefix (with TE: the calls' contiguous K/V copies, which they give up as the gradients
    # arrive), and the tile's output twice (the calls' and their concatenation)
    expanded = flash_gqa_expansion(s, run) + te_gqa_expansion(s, run, tile)
    if flash_gqa_calls(s, run) > 1 or te_tile_calls(s, run) > 1:
        expanded += prefix_kv * run.w + 2 * tile * run.micro_batch * s.heads / run.tp * s.head_dim * run.w
    return tiled_attention_peak_bytes(tile, seq, run.micro_batch, s.hidden, max(1, s.heads // run.tp),
                                      max(1, s.kv_heads // run.tp), s.head_dim, run.w, cp=run.cp,
                                      attention_workspace_bytes=int(repeated + expanded)) + extra_dq


MODELLED_RECOMPUTE_MODULES = ("core_attn", "moe", "moe_act", "mlp", "shared_experts")
"""--recompute-modules the planner models; core_attn saves no s x s scores with flash attention, so it changes
nothing."""


def recomputes(run: RunConfig, module: str) -> bool:
    """Whether the layers' forward leaves ``module`` to be recomputed in backward under selective recompute
    (``--recompute-granularity selective --recompute-modules ...``): its checkpoint saves only its input."""
    return run.recompute == "selective" and module in run.recompute_modules


def mlp_activations(s: ModelShape, run: RunConfig, ffn: int) -> float:
    """Dense MLP: pre-MLP norm (input, output) + fc1 output + activation output (the last two recomputed
    under ``--recompute-modules mlp``, whose checkpoint saves the norm's output)."""
    t, w = run.tp, run.w
    T, r = run.tokens, run.layer_rows
    inner = 0.0 if recomputes(run, "mlp") else T / t * ((2 if s.gated else 1) * ffn + ffn) * w
    return r * s.hidden * 2 * w + r * 4 + inner


def mlp_backward_transient(s: ModelShape, run: RunConfig, ffn: int) -> float:
    """What a dense MLP's backward holds beside the layer's saved tensors (``mlp_activations``), in the model's dtype:
    - the gradient of the activation's output [T, ffn/TP] and of fc1's output [T, f1/TP] (f1: 2 x ffn gated)
      (mlp.py's linear_fc2 and bias_swiglu backward). Traced on CPU with Megatron's SwiGLU as one fused op, the net
      is f1 alone (linear_fc2's backward has released the activation's output by then); on one H100 in fp32 a
      dense tied model's row reads +6.9% with f1 + ffn and -3.9% with f1 (bench/results/planner_calibration.json),
      so f1 + ffn is kept until the compiled SwiGLU's backward is measured;
    - under ``--recompute-modules mlp``, whose checkpoint saves only the MLP's input, also what the recomputed
      forward saves (fc1's and the activation's outputs, f1 + ffn) and the recomputed MLP output [rows, H] that
      the checkpoint's backward holds while it backpropagates (traced on CPU: 12.52 MiB against 13.52 planned, 8.52
      before; docs/evidence/cpu_layer_terms_trace.txt).
    Never alive with attention's backward or a MoE's."""
    f1 = (2 if s.gated else 1) * ffn
    held = run.tokens / run.tp * (f1 + ffn) * run.w
    if recomputes(run, "mlp"):
        return 2 * held + run.layer_rows * s.hidden * run.w
    return held


def moe_nondispatch_activations(s: ModelShape, run: RunConfig) -> float:
    """MoE layer minus the dispatched part: norm, router (fp32 logits + probs, bool map), shared expert. Under
    ``--recompute-modules moe`` the layer's checkpoint saves the norm's output and recomputes the router and
    the shared expert; under ``shared_experts`` the shared expert alone."""
    t, w = run.tp, run.w
    T, r = run.tokens, run.layer_rows
    norm = r * s.hidden * 2 * w + r * 4
    if recomputes(run, "moe"):
        return norm
    shared = T / t * ((2 if s.gated else 1) + 1) * s.shared_ffn * w if s.shared_ffn else 0.0
    return norm + r * s.experts * 9 + (0.0 if recomputes(run, "shared_experts") else shared)


def dispatcher_state(s: ModelShape, run: RunConfig) -> float:
    """Bytes one MoE layer's alltoall dispatcher keeps from its forward until its next one: the router's
    probabilities ([rows, E] in the router's dtype, the activations' by default), the routing map ([rows, E] bool)
    and the permutation map ([rows x top-k] int64) (token_dispatcher.py ``dispatch_preprocess``;
    integration/moe_release.py drops them). The allgather dispatcher keeps only the routed pairs' probabilities,
    so less."""
    r = run.layer_rows
    return r * s.experts * (run.w + 1) + r * s.topk * 8


def routed_pairs(s: ModelShape, run: RunConfig) -> float:
    """R: token-expert pairs one rank's experts receive per MoE layer and micro-batch."""
    return run.layer_rows * s.topk * run.routing_skew


def routed_pairs_worst(s: ModelShape, run: RunConfig) -> float:
    """All EP sources send every token to this rank's experts: E_p x r x min(k, E/E_p)."""
    return run.ep * run.layer_rows * min(s.topk, s.experts // run.ep)


def dispatch_saved_per_layer(s: ModelShape, run: RunConfig, pairs: float) -> float:
    """Saved by Megatron's alltoall path per layer: expert input (fc1 input), fc1 output (2F),
    activation output (F; recomputed under ``--recompute-modules moe_act``), prob-weighted expert output kept
    by unpermute (moe/moe_utils.py)."""
    return pairs * (2 * s.hidden + (2 if recomputes(run, "moe_act") else 3) * s.moe_ffn) * run.w


def dispatch_working_set(s: ModelShape, run: RunConfig, pairs: float) -> float:
    """One MoE layer's dispatch-to-combine bytes: the saved tensors plus the permute/sort copy and
    the combine receive buffer (token_dispatcher.py MoEAlltoAllTokenDispatcher + moe_utils.permute,
    sort_chunks_by_idxs, unpermute): pairs x (4H + 3F) x w, calibrated on the H200 anchor (EP=1). At EP > 1
    the all-to-all receives into a buffer of its own, one [pairs, H] more: bench/results/dispatch.json's
    Megatron rows at EP=2 exceed EP=1's by 2.06 GiB at 32K tokens and H=4096, 3.53 GiB at H=7168 and 4.11 GiB at
    64K (64 experts top-8: 2.0, 3.5 and 4.0 GiB of [pairs, H] bf16)."""
    return pairs * (4 * s.hidden + 3 * s.moe_ffn + (s.hidden if run.ep > 1 else 0)) * run.w


def llep_chunks(s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> tuple[int, int]:
    """(K, c_eff): chunks per layer and pairs per source rank per chunk, as PipelinedLLEP picks them under
    balanced routing with the default ``expert`` membership (dispatch/bound.py chunk_count: the smallest
    K with ceil(T k / K) <= chunk_cap, K <= max_chunks; at EP > 1 a call the cap splits is cut into at
    least min(--peakflat-dispatch-overlap-min-chunks, 2K), bound.split_floor; at the max_chunks cap a chunk grows
    past chunk_cap). The largest source of the group decides K, so skewed routing never makes a chunk
    larger than this."""
    r = int(math.ceil(run.layer_rows))
    k = max(1, s.topk)
    d = pf.dispatch
    K = split_floor(chunk_count(r * k, d.cap(k), d.max_chunks), run.ep, d.overlap_min_chunks,
                    d.max_chunks)
    return K, int(math.ceil(r * k / K))


def llep_hosting(s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> int:
    """The most experts of other ranks one rank hosts per layer call (dispatch/api.py hosting_limit):
    ``--peakflat-dispatch-max-foreign-experts``, or under 'auto' dispatch/bound.py auto_max_foreign at this
    shape (rows of H elements in w bytes, one expert's ``mlp_params`` on this ETP rank, the chunk cap)."""
    d = pf.dispatch
    if d.max_foreign_experts is not None:
        return int(d.max_foreign_experts)
    return auto_max_foreign(ep=run.ep, num_local_experts=max(1, s.experts // run.ep), chunk_cap=d.cap(s.topk),
                            hidden=s.hidden, dtype_bytes=run.w,
                            expert_numel=int(mlp_params(s.hidden, s.moe_ffn, s.gated, run.etp)))


def llep_working_set(s: ModelShape, run: RunConfig, chunk_rows: float, overlap: bool = False,
                     pf: PeakflatConfig | None = None) -> float:
    """PipelinedLLEP's bytes for one layer's forward + backward (dispatch/bound.py working_set_bound):
    per token the output and input gradient (2Hw), probs gradient (4E) and routing metadata (64 B, and
    28 B per token-expert pair); the local experts' weight gradients (2 x expert bytes); the moved experts:
    per hosted foreign expert (``llep_hosting``, under ``pf``'s dispatch flags, the defaults without) its
    weights (later the gradient slice it sends home) and fp32 gradient sum (w + 4 bytes per parameter), and
    per weight copy this rank sends (dispatch/bound.py weight_sends_bound) one expert's bytes; and per
    received row of one chunk w x (12H + 3 x fc1 + 4F) + 64 B (dispatch, combine, expert activations), 8H
    more at EP > 1 with ``overlap`` (``--peakflat-dispatch-overlap``: the next chunk's dispatch and the
    previous one's combine in flight). The component's guarantee (the ``bound`` column), not what a step allocates: see
    ``llep_expected_working_set``."""
    pf = pf if pf is not None else PeakflatConfig()
    e_p = max(1, s.experts // run.ep)
    numel = mlp_params(s.hidden, s.moe_ffn, s.gated, run.etp)
    hosted = llep_hosting(s, run, pf)
    return working_set_bound(num_tokens=run.layer_rows, hidden=s.hidden, ffn=s.moe_ffn, num_experts=s.experts,
                             topk=s.topk, chunk_rows=chunk_rows, expert_param_bytes=(s.experts / run.ep) * numel * run.w,
                             dtype_bytes=run.w, glu=s.gated, ep=run.ep, overlap=overlap, expert_numel=numel,
                             hosted=hosted, sent=weight_sends_bound(run.ep, e_p, hosted))


def llep_grouped(run: RunConfig, pf: PeakflatConfig) -> bool:
    """Whether PipelinedLLEP runs its experts as grouped GEMMs (dispatch/grouped.py grouped_supported:
    ``--peakflat-dispatch-grouped-gemm`` and bf16, the only dtype ``torch._grouped_mm`` takes on CUDA)."""
    return bool(getattr(pf.dispatch, "grouped_gemm", False)) and run.precision == "bf16"


def llep_fused(run: RunConfig, pf: PeakflatConfig) -> bool:
    """Whether PipelinedLLEP runs each chunk's forward and backward together in the checkpoint's recompute
    (``--peakflat-dispatch-fuse-recompute`` under full recompute; integration/dispatch_recompute.py)."""
    return bool(getattr(pf.dispatch, "fuse_recompute", False)) and run.recompute == "full"


def llep_overlaps(s: ModelShape, run: RunConfig, pf: PeakflatConfig, *, worst: bool = False) -> bool:
    """Whether PipelinedLLEP keeps neighbouring chunks' all-to-alls in flight (dispatch/bound.py
    overlap_on): at the balanced-routing K of ``llep_chunks``, or with ``worst`` whenever some call could
    (skewed routing can take more chunks, up to max_chunks), for the bound."""
    d = pf.dispatch
    K = d.max_chunks if worst else llep_chunks(s, run, pf)[0]
    return overlap_on(bool(d.overlap), d.overlap_min_chunks, K, run.ep)


def llep_expected_working_set(s: ModelShape, run: RunConfig, pf: PeakflatConfig, chunk_rows: float) -> float:
    """What one MoE layer's forward + backward allocates with PipelinedLLEP, for ``chunk_rows`` rows per
    chunk (the ``peakflat`` column; ``llep_working_set`` is the guarantee). Megatron's DDP takes the expert
    weight gradients into its grad buffer (the 'gradients' row), so they add no per-layer term.

    Source: the allocations of dispatch/pipelined.py and dispatch/grouped.py, traced with LiveBytesMeter
    on a Megatron MoELayer in bf16 (bench/planner.py --dry-run and tests/test_planner.py: within 5% at
    H 256-1024, top-2 to top-8); bench/planner.py compares it with one H200. Per token: the output and the input gradient ([T, H]), the
    probs gradient ([T, E] in the router's dtype, bf16 by default) and the pair indices of the schedule
    (two int64 per token-expert pair, and the combine's map: three int32). Per row of one chunk, the
    backward holds the dispatched rows and their output gradient ([R, H] each), fc1's output or its
    gradient (f1) and the prob and the prob gradient; on top of that, at the larger of two moments of
    the grouped backward:
    - the activation's backward: its saved tensors (gated: silu(a), b + offset, their product; else
      act(h)), the activation output and its gradient, and two elementwise products (4F);
    - dX's GEMM and fc1's weight gradient: dX ([R, H], the GEMM's result itself).
    Weight gradients go into main_grad by GEMMs with beta=1: no transient. Under full recompute with
    ``--peakflat-dispatch-fuse-recompute`` (``llep_fused``) each chunk's forward runs inside its
    backward, in the checkpoint's recompute: from its fc2 GEMM on, the chunk also holds its output
    ([R, H]) in each layer's first recompute, the run's peak (later ones skip the output once its
    assumed gradient is confirmed, integration/dispatch_recompute.py). At EP > 1 with overlap (``llep_overlaps``) the next chunk's dispatch (rows and output gradient, sent and received) and the
    previous chunk's combine (dX and output, sent and received) are in flight: 8 [R, H] more, from the
    code, not measured on GPUs.
    With Megatron's fused SwiGLU (``run.activation_fusion``, gated experts: its default on the GPU) the compiled
    function saves only its input (fc1's output, already counted) and its backward writes only that input's
    gradient: the grouped backward holds the activation's output, its gradient and fc1's output gradient (4F)
    instead of the unfused ops' saved tensors and products (7F). Measured on one H100 (bench/results/planner.json,
    H 2880, 32 experts top-4, with and without ``,fused_act``): within 0.7% either way.
    The per-expert path (grouped GEMMs off, or not bf16) runs the chunk's segments (one per expert, split from the
    chunk's rows) under autograd, then backward. Every row's dispatched input and output gradient and fc1 output
    are ``rows``; each row's saved activation is 4F unfused gated (silu(a), b + offset, their product, the
    prob-scaled output), F fused (the output) and 2F not gated. The peak is the largest of three moments: the
    forward's end (the segments' fc2 outputs and their concatenation, 2H); the backward of the first segment (the
    concatenation, H, and that segment's transients: the activation-output and elementwise gradients, fc1's output
    gradient and its dX, 7F + H gated, 3F + H not, for one expert call: at most the chunk's rows over the local
    experts, or 256, whatever the routing, since a larger segment runs in pieces, dispatch/bound.py
    ``segment_piece_rows``); and the end, where the segments' dX and their concatenation sit beside the input, output
    gradient and output rows (5H, the activations freed). The fused SwiGLU's backward measured as large as the
    unfused ops' on this path (one H100, H 4096, F 14336: 10.53 GiB at 64K tokens against 10.41 planned so, 9.47
    with the compiled function's 3F + H), so its transients are counted alike; it saves less (F). Traced on CPU
    (LiveBytesMeter: H 256 F 896 with 8 experts, H 384 F 64 with 64) and measured on one H100 (bench/results/
    planner.json, fp32 rows: H 4096 F 14336 with 8 experts top-2, H 1536 F 256 with 256 top-8): the forward's end
    to 0.1%; planned / measured 0.98 to 1.14 with the router's tensors, which the measurement holds (over where one
    chunk takes the layer's rows and backward peaks lower). The grouped rows read 1.00 to 1.003 so.
    Not included: the router's own tensors (the 'layer working set' row) and the weights of experts
    that LLEP spills to this rank at EP > 1 under skew (only in the bound).
    """
    w, h, f, k = run.w, s.hidden, s.moe_ffn, s.topk
    f1 = f * (2 if s.gated else 1)
    R = chunk_rows
    per_token = 2 * h * w + s.experts * w + 28 * k
    rows = 2 * h * w + f1 * w + 2 * w  # dispatched rows, output gradient; fc1 output; prob + its gradient
    rows += 8 * h * w if llep_overlaps(s, run, pf) else 0  # the all-to-alls in flight around this chunk
    fused_act = s.gated and run.activation_fusion
    if llep_grouped(run, pf):
        rows += h * w if llep_fused(run, pf) else 0  # the chunk's output, computed in the same pass
        act = 4 * f if fused_act else (3 if s.gated else 1) * f + 4 * f
        chunk = max(R * (rows + w * act),  # activation backward
                    R * (rows + h * w))    # dX GEMM result and fc1 weight gradient
    else:
        saved = (f if fused_act else 4 * f) if s.gated else 2 * f
        segment = min(R, segment_piece_rows(math.ceil(R), max(1, s.experts // run.ep)))  # whatever the routing
        transient = (7 if s.gated else 3) * f + h  # fused or not: measured alike on this path
        chunk = max(R * (rows + w * (saved + 2 * h)),                       # forward: fc2 outputs, their concatenation
                    R * (rows + w * (saved + h)) + segment * w * transient,  # backward of the first segment
                    R * (rows - f1 * w + 3 * h * w))                         # the segments' dX and their concatenation
    return run.layer_rows * per_token + chunk


def llep_rows(s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> tuple[float, float]:
    """(bound, expected) rows one rank receives in one chunk. Bound, whatever the routing: every one of
    the EP sources sends its c_eff (+k rounding) pairs here; with per-flow chunks (the default) also
    at most the least-loaded plan's largest load over K chunks (dispatch/bound.py flow_chunk_rows), about
    max(alpha, lambda) x c, plus what spills refused by the hosting limit (``llep_hosting``) leave on their
    owner where it can bind, whichever is less. Expected: the rank's whole load
    spread over K chunks; its load is skew x mean under plain EP (skew below the imbalance threshold
    lambda) and at most alpha x mean once LLEP rebalances. That is the most of any chunk too: with the
    default per-flow chunks every flow puts 1/K of its pairs (to one pair) into every chunk."""
    K, c = llep_chunks(s, run, pf)
    d = pf.dispatch
    bound = run.ep * (c + s.topk)
    if resolve_membership(d.membership) == "expert":  # per-flow chunks
        bound = min(bound, flow_chunk_rows(pairs_per_rank=math.ceil(run.layer_rows) * max(1, s.topk), ep=run.ep,
                                           chunk_cap=d.cap(s.topk), max_chunks=d.max_chunks, alpha=d.alpha,
                                           imbalance_threshold=d.imbalance_threshold, min_spill=d.min_spill,
                                           num_local_experts=max(1, s.experts // run.ep),
                                           max_foreign=llep_hosting(s, run, pf)))
    load = run.routing_skew if run.routing_skew < pf.dispatch.imbalance_threshold else pf.dispatch.alpha
    expected = min(bound, load * routed_pairs(s, replace(run, routing_skew=1.0)) / K)
    return bound, expected


# ----------------------------------------------------------------------------------------------
# Vocabulary projection. Megatron: output_layer gathers the SP sequence and writes [T, V/tp] logits
# in w bytes; vocab_parallel_cross_entropy (tensor_parallel/cross_entropy.py) keeps an fp32 softmax
# of the whole logits for backward (+4 bytes); the fused variant keeps an fp32 logits copy as well
# (+4). Anchors: N x V x 6 = 36.8 GiB, N x V x 10 = 61.4 GiB at N=32768, V=201088.
# Ring-DTP (vocab/config.py) in training: dW goes into DDP's main_grad (tied or not), and the gradients are
# computed with the loss (in-forward, vocab_in_forward): dX and one chunk of logits. The recompute schedule
# (vocab_ring_dtp): the dW of the local shard unless in main_grad, the dX accumulator, the larger of the
# block temporaries and the final dX cast, and the travelling ring buffer (send + receive) of activations
# or weight shards (on a ring, the larger of the hops and the end). At TP=2 (N=32768, H=7168,
# bench/results/vocab.json rows tp=2, standalone: dW returned): 4.90 GiB measured / 4.68 predicted,
# accumulate=input 2.00 / 2.13. In the 2-GPU example (TP=1, V=32768, H=1024, 4096 tokens) the runtime
# report read 0.04 GiB, as vocab_in_forward gives. Block temporaries: the Triton kernel (CUDA default)
# holds one [tokens, block] block in the input dtype, the plain-PyTorch kernel three fp32 blocks.
# Measured on one H200 (bench/results/
# vocab.json, N=32768, H=7168, V=201088: 3.9991 GiB; N=16384, H=4096: 1.9108 GiB) this matches to 0.1%.
# ----------------------------------------------------------------------------------------------

BLOCK_TEMPORARIES = 3
"""fp32 [tokens, block] buffers alive at once in the plain-PyTorch block kernel (measured, LiveBytesMeter)."""


def vocab_baseline(s: ModelShape, run: RunConfig) -> float:
    T = run.tokens
    per_elem = run.w + 4 + (4 if run.cross_entropy_fusion else 0)
    return T * s.vocab / run.tp * per_elem


def vocab_saved(s: ModelShape, run: RunConfig) -> float:
    """What one of Megatron's vocab-parallel cross-entropies keeps for its backward once its logits are freed:
    the fp32 softmax (and, fused, its fp32 gradient), T x V/tp x (4 or 8) B. An MTP loss, computed before the
    main one, holds this through the main loss."""
    return run.tokens * s.vocab / run.tp * (4 + (4 if run.cross_entropy_fusion else 0))


def vocab_ep_shards(run: RunConfig, pf: PeakflatConfig) -> int:
    """EP when ``--peakflat-vocab-shard-over-ep`` splits the output layer's rows over the expert-parallel
    group (Ring-DTP at TP=1, EP > 1: integration/vocab_shard.py), else 1."""
    if pf.vocab.impl == "ring-dtp" and pf.vocab.shard_over_ep and run.tp == 1 and run.ep > 1:
        return run.ep
    return 1


def vocab_ring_size(run: RunConfig, pf: PeakflatConfig) -> int:
    """Ranks of Ring-DTP's ring: the tensor-parallel group, or the expert-parallel group when the output
    layer is sharded over it."""
    shards = vocab_ep_shards(run, pf)
    return shards if shards > 1 else run.tp


def vocab_schedule(s: ModelShape, run: RunConfig, pf: PeakflatConfig, main_grad: bool = True) -> str:
    """The ``--peakflat-vocab-schedule`` value that reproduces the run (vocab/api.py resolve_schedule): an
    asked-for ring; 'gather' where the gradients are computed with the loss (vocab_grad); else the ring that
    moves less, activations when the tokens per rank are no more than V/P, weights otherwise."""
    if pf.vocab.schedule in ("activations", "weights"):
        return pf.vocab.schedule
    if vocab_grad(pf, main_grad) == "in-forward":
        return "gather"
    n = run.tp_tokens
    return "activations" if n <= s.vocab / vocab_ring_size(run, pf) else "weights"


def vocab_block(n_tokens: float, w: int, block_size: int) -> int:
    """Rows per block: the flag, or Ring-DTP's automatic choice (vocab/sizes.py auto_block_size: one
    [tokens, rows] block of about 128 MiB, a multiple of 256 rows in [256, 16384])."""
    if block_size:
        return int(block_size)
    return auto_block_size(int(n_tokens), w)


def vocab_grad(pf: PeakflatConfig, main_grad: bool = True) -> str:
    """'in-forward' or 'recompute', as integration/vocab.py resolves ``--peakflat-vocab-grad auto``: in-forward
    with the gather schedule, or when dW goes into DDP's main_grad (in Megatron training, tied output layer or
    not) and the schedule is auto; an asked-for ring (activations, weights) recomputes."""
    if pf.vocab.grad != "auto":
        return pf.vocab.grad
    if pf.vocab.schedule in ("activations", "weights"):
        return "recompute"
    return "in-forward" if main_grad or pf.vocab.schedule == "gather" else "recompute"


def vocab_in_forward(s: ModelShape, run: RunConfig, pf: PeakflatConfig, main_grad: bool = True) -> float:
    """The in-forward schedule (vocab/in_forward.py): this rank's dX (x's dtype) and one chunk: its
    [chunk, V/P] logits (one block in the input dtype with the Triton kernel, fp32 temporaries with the
    plain-PyTorch one) and, on a ring, the gathered hidden states (this chunk's and the next one's in
    flight), the partial dX and the received share of it (two of each: the previous chunk's is still
    reducing). Measured on 2 H200s (bench/results/vocab.json, tp=2, peakflat-fwd-main-grad): 1.4239 GiB
    at N=32768, H=7168 and 0.5713 GiB at N=16384, H=4096, as this gives; 1.9727 GiB at TP=1. dW goes into
    ``main_grad`` or, without one, an accumulator in ``accumulate``'s dtype cast to the weight's dtype at the end."""
    P, n, w = vocab_ring_size(run, pf), run.tp_tokens, run.w
    shard = s.vocab / P
    acc = 4 if pf.vocab.accumulate == "fp32" else w
    chunk = pf.vocab.chunk_tokens or auto_chunk_tokens(math.ceil(shard), w, P, int(n * P), s.hidden)
    rows = min(math.ceil(chunk / P), math.ceil(n))
    c = rows * P
    block = c * shard * (BLOCK_TEMPORARIES * 4 if pf.vocab.kernel == "torch" else w)
    ring = (2 * c * s.hidden * w + 2 * c * s.hidden * acc + 2 * rows * s.hidden * acc) if P > 1 else 0
    dw = 0 if main_grad else shard * s.hidden * acc
    end = 0 if main_grad else shard * s.hidden * w
    return n * s.hidden * w + dw + max(block + ring, end)


def vocab_ring_dtp(s: ModelShape, run: RunConfig, pf: PeakflatConfig, main_grad: bool = True) -> float:
    """Ring-DTP's working set on one rank. ``main_grad``: dW goes into Megatron DDP's fp32 buffer, as in
    training (tied or untied output layer, integration/vocab.py); False: the standalone API, which
    returns dW (the benchmark's ``peakflat`` and ``peakflat-input`` rows)."""
    if vocab_grad(pf, main_grad) == "in-forward":
        return vocab_in_forward(s, run, pf, main_grad)
    P = vocab_ring_size(run, pf)
    n = run.tp_tokens
    shard = s.vocab / P
    block = min(vocab_block(n, run.w, pf.vocab.block_size), shard)
    acc = 4 if pf.vocab.accumulate == "fp32" else run.w
    # Block temporaries: the plain-PyTorch kernel (vocab/block_torch.py: logits, their exp / softmax,
    # the gradient block) keeps three fp32 blocks, the Triton kernel one block in the input dtype.
    # dX is summed over blocks in ``acc`` bytes and cast to w bytes at the end; dW of the local shard
    # is in w bytes at P=1 and in ``acc`` bytes on a ring (vocab/config.py ``accumulate``).
    temps = n * block * (BLOCK_TEMPORARIES * 4 if pf.vocab.kernel == "torch" else run.w)
    final_dx = n * s.hidden * run.w if acc != run.w else 0
    # The larger of two moments. During the blocks (and hops): dW (none when it goes into DDP's
    # main_grad; on a ring otherwise an accumulator), dX's accumulator, the block temporaries and, on a
    # ring, the travelling buffers (send + receive). At the end: dW in the weight's dtype (the cast of
    # the accumulator) beside the accumulator and dX; with main_grad, autograd's placeholder is
    # main_grad's own storage (main_grad.py): nothing.
    if P == 1:
        return (0 if main_grad else shard * s.hidden * run.w) + n * s.hidden * acc + max(temps, final_dx)
    dw_acc = 0 if main_grad else shard * s.hidden * acc
    travelling = n * s.hidden if vocab_schedule(s, run, pf, main_grad=False) == "activations" else shard * s.hidden
    hops = dw_acc + n * s.hidden * acc + max(temps, final_dx) + 2 * travelling * run.w
    dw_out = shard * s.hidden * run.w if (not main_grad and acc != run.w) else 0
    end = dw_acc + dw_out + n * s.hidden * (run.w if main_grad else acc + (run.w if acc != run.w else 0))
    return max(hops, end)


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------

def padded_vocab(vocab: int, run: RunConfig) -> int:
    """The vocabulary Megatron builds: padded to a multiple of --make-vocab-size-divisible-by x TP
    (``vocab_size_with_padding``). Idempotent, so an already padded ``--padded-vocab-size`` stays as it is."""
    multiple = run.vocab_divisible_by * run.tp
    return -(-vocab // multiple) * multiple


def pipeline_split(layers: int, run: RunConfig) -> tuple[int, ...]:
    """Decoder layers of each pipeline rank, as Megatron builds them (transformer_block.py
    ``get_num_layers_to_build``): the layout's counts; else the uneven first and last stages with the rest
    split evenly over the middle ones; else an even split, where the embedding and the loss count as a layer
    each when the account-for flags say so.

    Raises PeakflatConfigError, naming the flag and a split that works, wherever Megatron would refuse it
    (an even split of layers that do not divide, or counts that do not add up to ``layers``)."""
    pp = run.pp
    if run.stage_layout is not None:
        lay = run.stage_layout
        if len(lay) % pp or sum(lay) != layers:
            raise PeakflatConfigError(
                "--pipeline-model-parallel-layout", "|".join("t" * n for n in lay),
                f"has {len(lay)} stages and {sum(lay)} decoder layers; the run has {pp} pipeline ranks and {layers} "
                "layers", "write PP (or a multiple of PP) '|'-separated stages holding --num-layers 't' layers")
        return _per_rank(lay, pp)
    if pp == 1:
        return (layers,)
    q = layers // pp
    works = (f"--decoder-last-pipeline-num-layers {layers - (pp - 1) * q} (the planner reads it in --megatron-args; "
             "the last stage holds one micro-batch in flight, so extra layers cost it the least)")
    first, last = run.first_stage_layers, run.last_stage_layers
    if first is not None or last is not None:
        flag, value = (("--decoder-first-pipeline-num-layers", first) if first is not None
                       else ("--decoder-last-pipeline-num-layers", last))
        if run.embedding_in_split or run.loss_in_split:
            raise PeakflatConfigError(flag, value, "cannot be combined with --account-for-embedding-in-pipeline-"
                                      "split or --account-for-loss-in-pipeline-split (Megatron refuses it)",
                                      "drop one of the two")
        given = [n for n in (first, last) if n is not None]
        rest, stages = layers - sum(given), pp - len(given)
        if min(given) < 0 or rest < 0 or (stages and rest % stages) or (not stages and rest):
            raise PeakflatConfigError(flag, value, f"leaves {rest} of the {layers} layers for {stages} other pipeline "
                                      "stages, which must take an equal whole number each", f"pass {works}")
        mid = rest // stages if stages else 0
        return tuple(first if st == 0 and first is not None else last if st == pp - 1 and last is not None else mid
                     for st in range(pp))
    total = layers + run.embedding_in_split + run.loss_in_split
    if total % pp:
        if total != layers:
            raise PeakflatConfigError("--pipeline-model-parallel-size", pp,
                                      f"does not divide the {layers} layers with the embedding or loss counted as "
                                      f"{total - layers} more", f"choose a PP size that divides {total}, or drop "
                                      "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split")
        raise PeakflatConfigError("--pipeline-model-parallel-size", pp,
                                  f"does not divide the {layers} layers: Megatron splits them evenly unless told "
                                  "otherwise", f"pass {works}, or a PP size that divides them")
    per = total // pp
    return tuple(per - (run.embedding_in_split and st == 0) - (run.loss_in_split and st == pp - 1)
                 for st in range(pp))


def virtual_stages(layers: int, run: RunConfig) -> int:
    """Model chunks per pipeline rank (1: no interleaving), derived as Megatron's arguments.py derives
    virtual_pipeline_model_parallel_size. Raises PeakflatConfigError where the layers per virtual stage do not
    divide a rank's layers."""
    if run.pp == 1:
        return 1
    if run.vpp is not None:
        return max(1, run.vpp)
    if run.stage_layout is not None:
        return max(1, len(run.stage_layout) // run.pp)
    if run.layers_per_virtual_stage is not None:
        per = (layers + run.embedding_in_split + run.loss_in_split) // run.pp
        n = run.layers_per_virtual_stage
        if n < 1 or per % n:
            raise PeakflatConfigError("--num-layers-per-virtual-pipeline-stage", n,
                                      f"does not divide the {per} layers of a pipeline stage",
                                      "pass a divisor of --num-layers / --pipeline-model-parallel-size")
        return per // n
    return 1


def chunks_in_flight(run: RunConfig, rank: int, vpp: int) -> int:
    """Forward model chunks whose activations pipeline rank ``rank`` holds at once at its peak: Megatron's
    warm-up forwards plus the one the steady state adds (schedules.py ``get_pp_rank_microbatches``). Without
    interleaving that is PP - rank micro-batches; interleaved, (PP - rank - 1) x 2 + (VPP - 1) x group + 1
    chunks of 1/VPP of the stage. Capped by the step's micro-batches x VPP."""
    total = run.num_micro * vpp
    if vpp == 1:
        warmup = run.pp - rank - 1
    else:
        warmup = (run.pp - rank - 1) * 2 + (vpp - 1) * (run.vp_group or run.pp)
    return total if warmup >= total else warmup + 1


def mtp_split(s: ModelShape, run: RunConfig) -> tuple[int, ...]:
    """MTP layers of each pipeline rank: the layout's 'm' stages summed per rank, else all on the last rank."""
    if run.stage_layout_mtp is not None and sum(run.stage_layout_mtp):
        return _per_rank(run.stage_layout_mtp, run.pp)
    return (0,) * (run.pp - 1) + (s.mtp_layers,)


def embedding_grad_held(first: bool, decoder_layers: int, mtp: int, output_grad: bool) -> bool:
    """Whether autograd holds a [V/tp, H] gradient of the stage's word embeddings through a layer's backward.

    A leaf used several times gets one gradient buffer (autograd's InputBuffer): the first gradient to
    arrive in backward, from the last use in forward, stays alive until the first use's gradient is added,
    and so through every layer in between. The uses that return a gradient, in forward order: the
    decoder's lookup (``first``), each MTP layer's lookup (before its layer), and the tied output layer
    (``output_grad``: Megatron's returns dW, or a full-size placeholder under gradient-accumulation fusion;
    Ring-DTP returns none). Measured: the 0.77 GiB = 201088 x 2048 x 2 B block of ``memory_peak_mtp_32k.txt``."""
    seq = ("E",) * first + ("L",) * decoder_layers + ("E", "L") * mtp + ("E",) * output_grad
    uses = [i for i, x in enumerate(seq) if x == "E"]
    return len(uses) >= 2 and "L" in seq[uses[0]:uses[-1]]


def _per_rank(stages: tuple[int, ...], pp: int) -> tuple[int, ...]:
    """A layout's per-stage counts summed per pipeline rank (virtual stage i sits on rank i mod PP)."""
    return tuple(sum(stages[st::pp]) for st in range(pp))


def _stage_kinds(s: ModelShape, run: RunConfig) -> list[tuple[tuple[bool, ...], tuple[bool, ...]]]:
    """For each pipeline rank, its decoder layers and then its MTP layers, in forward order, True where MoE
    (``pipeline_split``, each decoder layer as ``ModelShape.layer_is_moe``; an MTP layer is of the last decoder
    layer's kind, as Megatron builds it from that spec). A rank's layers are taken as contiguous, also under VPP."""
    out, start = [], 0
    mtp_moe = bool(s.layers) and s.layer_is_moe[-1]
    for n, m in zip(pipeline_split(s.layers, run), mtp_split(s, run)):
        out.append((s.layer_is_moe[start:start + n], (mtp_moe,) * m))
        start += n
    return out


def _stage_counts(s: ModelShape, run: RunConfig,
                  kinds: list[tuple[tuple[bool, ...], tuple[bool, ...]]] | None = None) -> list[tuple[int, int]]:
    """(dense, moe) layers of each pipeline rank, its MTP layers included (``kinds``: ``_stage_kinds``, when
    already at hand)."""
    out = []
    for decoder, mtp in kinds if kinds is not None else _stage_kinds(s, run):
        moe = sum(decoder) + sum(mtp)
        out.append((len(decoder) + len(mtp) - moe, moe))
    return out


def dispatcher_held(decoder: Sequence[bool], mtp: Sequence[bool], run: RunConfig) -> tuple[int, int, int]:
    """[tokens, hidden] tensors that Megatron's alltoall or allgather dispatcher keeps alive under recompute, as
    (checkpoint inputs, their gradients) when the stage's lowest checkpoint begins its backward, and the total
    through the optimizer step. ``decoder`` and ``mtp``: the stage's layers in forward order, True where MoE.

    ``MoEAlltoAllTokenDispatcher`` keeps the router's probabilities as ``self.probs`` (the allgather one their
    local slice) until the layer's next forward (integration/moe_release.py drops them). Their graph is the
    checkpoint's recompute, which ends in the checkpoint's detached inputs, and those hold their gradients once
    its backward ran. So under full recompute each checkpoint with a MoE layer keeps its input and that input's
    gradient after its backward: one of each for a decoder chunk, two (the hidden states and the MTP embedding)
    for an MTP layer. At the lowest checkpoint's backward the chunk just above it is not counted as a gradient:
    its input's gradient is the one flowing into the lowest chunk. Under ``--recompute-modules moe`` each MoE
    layer's own checkpoint keeps its input (the pre-MLP norm's output) and that input's gradient, MTP layers' too:
    at layer 0's backward those of the MoE layers above it (none is flowing into layer 0: the layer's residual
    sits between). Checked against Megatron's GPTModel on CPU (tests/test_planner_megatron.py)."""
    if recomputes(run, "moe"):  # each MoE layer's own checkpoint, in decoder and MTP layers alike: one input each
        above = sum(decoder[1:]) + sum(mtp)
        return above, above, 2 * (sum(decoder) + sum(mtp))
    if run.recompute != "full":
        return 0, 0, 0
    n = max(1, run.recompute_num_layers)
    if run.recompute_method == "uniform":
        chunks = [any(decoder[i:i + n]) for i in range(0, len(decoder), n)]
    else:  # block: the first n layers are checkpointed one by one, the others keep their activations
        chunks = list(decoder[:n])
    # (has a MoE layer, inputs) per checkpoint, lowest first; Megatron checkpoints each MTP layer whole
    ckpts = [(moe, 1) for moe in chunks] + [(moe, 2) for moe in mtp]
    if not ckpts:
        return 0, 0, 0
    above = ckpts[1:]
    inputs = sum(k for moe, k in above if moe)
    grads = inputs - (1 if len(chunks) >= 2 and chunks[1] else 0)
    return inputs, grads, 2 * sum(k for moe, k in ckpts if moe)


def _stages_to_plan(counts: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(the pipeline ranks to plan, and for each rank the planned one that bounds it).

    The first and last are always planned (embedding; output layer and loss). A middle rank is bounded by an
    earlier planned rank other than the last with at least as many dense and as many MoE layers: that one holds
    at least as many micro-batches in flight (1F1B: PP - rank) and everything else the middle one holds."""
    pp = len(counts)
    planned, cover = [0], [0] * pp
    for st in range(1, pp):
        if st == pp - 1:
            planned.append(st)
            cover[st] = st
            continue
        by = next((p for p in planned if counts[p][0] >= counts[st][0] and counts[p][1] >= counts[st][1]), None)
        if by is None:
            planned.append(st)
            by = st
        cover[st] = by
    return planned, cover


def sco_budget(s: ModelShape, run: RunConfig, pf: PeakflatConfig, optimizer_host: float) -> int:
    """SCO's pinned host budget per rank: the flag, else the host share left after the optimizer."""
    if pf.sco.budget is not None:
        return int(pf.sco.budget)
    return int(max(0.0, run.host_bytes_per_rank - optimizer_host))


@dataclass(frozen=True)
class _Stage:
    """One planned pipeline rank, as the row builders of ``plan`` read it."""

    index: int
    n_dense: int
    n_moe: int
    mtp: int
    """Of its layers, the MTP layers."""
    first: bool
    last: bool
    chunks: int
    """Forward model chunks in flight at its peak (``chunks_in_flight``)."""
    inflight: float
    """The same in whole stages' worth: each of the rank's VPP model chunks holds about 1/VPP of its layers."""
    kinds: tuple[tuple[bool, ...], tuple[bool, ...]]
    """Its decoder and MTP layers in forward order, True where MoE (``_stage_kinds``)."""
    params: tuple[float, float]
    """(dense, expert) parameters it holds (``stage_params``), Megatron's layout."""
    params_pf: tuple[float, float]
    """The same in the peakflat column: the output layer's rows over the EP group with
    ``--peakflat-vocab-shard-over-ep``. Every row that counts parameters reads these two, so none can count
    another set."""

    @property
    def n_layers(self) -> int:
        return self.n_dense + self.n_moe


def plan(s: ModelShape, run: RunConfig, pf: PeakflatConfig | None = None) -> Plan:
    """Per-rank bytes of every term, for the first and last pipeline stages (one stage at PP=1), and every
    middle stage that no earlier stage bounds (``_stages_to_plan``).

    The peakflat column counts the components that ``pf`` enables; the others keep their baseline
    (the CLI turns all four on)."""
    pf = pf or PeakflatConfig()
    unpadded = s.vocab
    s = s.with_(vocab=padded_vocab(s.vocab, run))
    c_eff = llep_chunks(s, run, pf)[1] if s.experts else 0
    kinds = _stage_kinds(s, run)
    counts = _stage_counts(s, run, kinds)
    mtps = mtp_split(s, run)
    vpp = virtual_stages(s.layers, run)
    stages_idx, cover = _stages_to_plan(counts)
    stages: list[StagePlan] = []
    budget_used = 0
    for st in stages_idx:
        chunks = chunks_in_flight(run, st, vpp)
        first, last, (n_dense, n_moe) = st == 0, st == run.pp - 1, counts[st]
        embedding = first or mtps[st] > 0  # gpt_model.py builds the word embeddings where mtp_process too
        g = _Stage(st, n_dense, n_moe, mtps[st], first, last, chunks, chunks if vpp == 1 else chunks / vpp, kinds[st],
                   stage_params(s, run, n_dense, n_moe, embedding, last, mtp=mtps[st]),
                   stage_params(s, run, n_dense, n_moe, embedding, last, vocab_ep_shards(run, pf), mtp=mtps[st]))
        rows: dict[str, Row] = {}
        notes: list[str] = []
        _parameter_rows(rows, run, pf, g)
        _optimizer_rows(rows, run, pf, g)
        n_ckpt, stored_layers = _activation_rows(rows, s, run, pf, g)
        budget_used = _boundary_rows(rows, notes, s, run, pf, g, n_ckpt)
        _dispatcher_rows(rows, s, run, pf, g, n_ckpt)
        if g.n_moe:
            _dispatch_row(rows, s, run, pf, g, stored_layers)
        if g.last:
            _vocab_row(rows, s, run, pf)
        # A component that is off leaves Megatron's path: its peakflat value is the baseline.
        # (The optimizer row decided this itself: the output layer's shard changes Megatron's optimizer too.)
        for comp in components.COMPONENTS:
            for row_name in comp.planner_terms if comp.off_term_is_baseline and not pf.enabled[comp.name] else ():
                if row_name in rows:
                    row = rows[row_name]
                    row.peakflat, row.host_peakflat, row.bound = row.baseline, row.host_baseline, None
        reserve = RESERVE_FIXED + RESERVE_FRACTION * run.hbm_bytes
        rows["reserve"] = Row("reserve", reserve, reserve,
                              source="CUDA context, NCCL buffers, allocator fragmentation (2 GiB + 5% HBM)")
        notes += _stage_notes(s, run, g, vpp, unpadded)
        stages.append(StagePlan(_stage_label(st, run.pp), g.n_layers, g.n_moe, g.inflight, rows, notes))
    return Plan(s, run, pf, stages, c_eff, vocab_schedule(s, run, pf), budget_used,
                stage_of=tuple(_stage_label(c, run.pp) for c in cover))


def _parameter_rows(rows: dict[str, Row], run: RunConfig, pf: PeakflatConfig, g: _Stage) -> None:
    """Rows ``parameters``, ``model build`` and ``gradients``; the peakflat column holds the output layer's EP
    shard (``--peakflat-vocab-shard-over-ep``)."""
    w = run.w
    params, params_pf = sum(g.params), sum(g.params_pf)
    rows["parameters"] = Row("parameters", params * w, params_pf * w,
                             source="param_and_grad_buffer.py _ParamAndGradBuffer.param_data (w bytes/param)")
    # Megatron's DDP allocates its param and grad buffers while the model's own parameters are alive,
    # then copies each in and frees it: at 16K and 32K tokens on one H200 this was the run's peak
    # (38.28 GiB = 2 x 9.57 + 19.14, docs/evidence/memory_peak_16k.txt).
    rows["model build"] = Row("model build", params * w, params_pf * w, phase="build",
                              source="distributed_data_parallel.py: the module's parameters, alive while "
                                     "_ParamAndGradBuffer is built and filled")
    gbytes = run.grad_bytes
    # OffloadStreamAdamW under --fp16 runs only with fp32 gradients (what start-up asks, and a recommendation adds)
    fp32_for_offload = pf.enabled["optimizer"] and fp16_grads_clipped(run.precision == "fp16", bool(run.grads_fp32),
                                                                       run.clip_grad)
    rows["gradients"] = Row("gradients", params * gbytes, params_pf * (4 if fp32_for_offload else gbytes),
                            source="param_and_grad_buffer.py grad_data, full size even with the distributed optimizer"
                                   + ("; fp32 in the peakflat column: OffloadStreamAdamW under --fp16 needs "
                                      "--accumulate-allreduce-grads-in-fp32" if fp32_for_offload else ""))


def _optimizer_shards(run: RunConfig, dense: float, expert: float) -> list[float]:
    """Parameters in each optimizer that Megatron chains on this rank: under the distributed optimizer, one per
    gradient-reduction group (dense params over DP x CP, expert params over expert-DP) where the experts have
    their own (optimizer/distrib_optimizer.py); otherwise one over every parameter."""
    if run.distributed_optimizer and experts_have_own_optimizer(run.ep, run.etp, run.tp):
        return [n for n in (dense / (run.dp * run.cp), expert / run.expert_dp) if n > 0]
    if run.distributed_optimizer:
        return [(dense + expert) / (run.dp * run.cp)]
    return [dense + expert]


def _optimizer_rows(rows: dict[str, Row], run: RunConfig, pf: PeakflatConfig, g: _Stage) -> None:
    """Rows ``optimizer step`` and ``optimizer``: fp32 master (when params are not fp32) + exp_avg + exp_avg_sq
    of this rank's shards. OffloadStreamAdamW replaces the HybridDeviceOptimizer inside each chained optimizer,
    and every one holds its own slots of its largest bucket (a plain OffloadStreamAdamW over every parameter,
    as bench/planner.py builds, is one). Measured: one OffloadStreamAdamW over all 5.1B parameters at EP=1 on
    the H200 (2.24 GiB staging). The peakflat column counts the output layer's shard
    (--peakflat-vocab-shard-over-ep) as the expert parameter it becomes: the same state per rank under the
    distributed optimizer, V/EP rows without it."""
    w = run.w
    if run.optimizer == "sgd":  # torch's SGD: a momentum buffer of the fp32 gradient's size, none without momentum
        state = 4 if run.sgd_momentum else 0
    else:
        state = run.exp_avg_bytes + run.exp_avg_sq_bytes
    per_param = (run.main_params_bytes if w < 4 else 0) + state
    f = run.optimizer_offload_fraction
    slots, bucket = pf.optimizer.slots, pf.optimizer.bucket
    gpu_engine = getattr(pf.optimizer, "engine", "auto") != "cpu"
    base, instances = _optimizer_shards(run, *g.params), _optimizer_shards(run, *g.params_pf)
    shard, shard_pf = sum(base), sum(instances)
    opt_gpu_base, opt_gpu_pf = shard * per_param * (1 - f), shard_pf * per_param * (1 - f)
    if pf.enabled["optimizer"]:
        # as many slots as buckets when there are fewer (optimizer/api.py), each the size of the largest bucket
        slot_params = sum(min(slots, math.ceil(n / bucket)) * min(bucket, n) for n in instances)
        opt_pf = slot_params * 16 if gpu_engine else 0.0
        # host: fp32 master and moments, plus the host kernel's slots unless the engine is 'gpu' (api.py _host_need)
        opt_host_pf = shard_pf * 12 + (slot_params * (4 + w) if pf.optimizer.engine != "gpu" else 0.0)
    else:
        opt_pf, opt_host_pf = opt_gpu_pf, (shard_pf * per_param + 4 * shard_pf) * f
    # torch.optim.AdamW (no TE, no apex): one fp32 temporary of the GPU shard during the step
    step_temp = 0.0 if run.fused_adam else 4.0 * (1 - f)
    rows["optimizer step"] = Row("optimizer step", shard * step_temp,
                                 0.0 if pf.enabled["optimizer"] else shard_pf * step_temp, phase="step",
                                 source="torch.optim.adam _multi_tensor_adam: _foreach_sqrt(exp_avg_sq), 4 B/param "
                                        "of the GPU shard, when Megatron falls back to torch's AdamW (no TE or apex)")
    rows["optimizer"] = Row(
        "optimizer", opt_gpu_base, opt_pf,
        bound=(len(instances) * slots * bucket * 16 if gpu_engine else 0.0) if pf.enabled["optimizer"] else None,
        host_baseline=(shard * per_param + 4 * shard) * f, host_peakflat=opt_host_pf,
        source=f"distrib_optimizer.py master weights + {'SGD momentum' if run.optimizer == 'sgd' else 'Adam moments'} "
               f"({per_param} B/param shard); "
               "OffloadStreamAdamW: slots x bucket x 16 B staging per chained optimizer (dense, expert; "
               "engine 'auto' may use less: it can send every bucket to the host); pinned host: 12 B/param, plus "
               "slots x bucket x (4 + param bytes) for the host kernel unless the engine is 'gpu'")


def boundary_bytes(s: ModelShape, run: RunConfig) -> float:
    """One [tokens, hidden] activation of a rank, in the model's dtype: a full-recompute checkpoint's input,
    and each tensor that Megatron's dispatchers keep alive (``dispatcher_held``)."""
    return run.layer_rows * s.hidden * run.w


def _checkpointing(run: RunConfig, n_layers: int) -> tuple[int, int, int]:
    """(full-recompute checkpoints, layers that keep their saved tensors, layers re-materialised at once). Without
    full recompute no layer is re-materialised: each keeps its saved tensors (the 'activations' row), and its
    backward adds only the inner phases' transients (traced on CPU: one layer's saved tensors counted again as a
    working set counted 17.0 MiB for a layer that saves 9.0, docs/evidence/cpu_layer_terms_trace.txt)."""
    if run.recompute != "full":
        return 0, n_layers, 0
    n = max(1, run.recompute_num_layers)
    if run.recompute_method == "uniform":
        return math.ceil(n_layers / n), 0, min(n, n_layers)
    # block: the first n layers are checkpointed, the others keep their activations
    return min(n, n_layers), max(0, n_layers - n), 1


def _activation_rows(rows: dict[str, Row], s: ModelShape, run: RunConfig, pf: PeakflatConfig,
                     g: _Stage) -> tuple[int, int]:
    """Rows ``activations``, ``layer working set``, ``embedding gradient`` and ``tile`` (attention's backward, which
    the tiled sublayer bounds); returns
    (checkpoints, stored layers) for the rows that follow."""
    scores = unfused_scores(s, run)
    # the unfused backend saves its softmax probabilities for backward, unless core attention is recomputed
    attn = attention_activations(s, run) + cp_gathered_kv(s, run, pf) + \
        (0.0 if recomputes(run, "core_attn") else unfused_scores(s, run, saved=True))
    tiled = tiles_attention(s, run, pf)
    # the tiled sublayer saves only its input, the layer's (checkpoint) input, which the sco row counts
    attn_pf = 0.0 if tiled else attn
    layer_act = [attn + mlp_activations(s, run, s.ffn)] * g.n_dense + [attn + moe_nondispatch_activations(s, run)] * g.n_moe
    layer_act_pf = ([attn_pf + mlp_activations(s, run, s.ffn)] * g.n_dense
                    + [attn_pf + moe_nondispatch_activations(s, run)] * g.n_moe)
    # The working set of the layers being (re)computed and backpropagated: their saved tensors, and beside
    # them (not saved, so not part of stored layers below) either one attention's backward or one MoE's.
    one_layer = max(layer_act) if layer_act else 0.0
    one_layer_pf = max(layer_act_pf) if layer_act_pf else 0.0
    n_ckpt, stored_layers, work_layers = _checkpointing(run, g.n_layers)
    saved = g.inflight * stored_layers * (sum(layer_act) / max(1, g.n_layers))
    saved_pf = g.inflight * stored_layers * (sum(layer_act_pf) / max(1, g.n_layers))
    # 'selective' recomputes core attention only; with SDPA/flash it saves no s x s scores, so
    # it frees nothing the model counts and is treated like 'none'.
    rows["activations"] = Row("activations", saved, saved_pf,
                              source="saved tensors per layer (model.py attention/mlp/moe_nondispatch), "
                                     f"{stored_layers} stored layers x {g.inflight} micro-batches in flight")
    rows["layer working set"] = Row(
        "layer working set", work_layers * one_layer, work_layers * one_layer_pf, phase="layer",
        source="one recompute chunk re-materialised in backward (recompute.py checkpointed_forward)"
        if run.recompute == "full" else "the layer in backward")
    emb_grad = s.vocab / run.tp * s.hidden * run.w
    tied_out = g.last and s.tied_embeddings
    held = [emb_grad * embedding_grad_held(g.first, g.n_layers - g.mtp, g.mtp, out)
            for out in (tied_out, tied_out and not pf.enabled["vocab"])]
    if held[0] or held[1]:
        rows["embedding gradient"] = Row(
            "embedding gradient", held[0], held[1], phase="layer",
            source="autograd's buffer for the word embeddings' gradient, from their last use in forward (MTP "
                   "lookup, tied output layer) until the decoder's lookup adds its own (embedding_grad_held)")
    attn_bwd = attention_backward_transient(s, run) + cp_gathered_kv_backward(s, run, pf) if layer_act else 0.0
    gathered = (f"; at CP {run.cp} the whole sequence's gathered K/V gradients (cp_gathered_kv_backward), and "
                "each stored layer keeps the gathered K and V (cp_gathered_kv)") if cp_gathers_kv(run, pf) else ""
    tiled_bwd = tiled_attention_bytes(s, run, pf) if tiled and layer_act else attn_bwd
    rows["tile"] = Row(
        "tile", attn_bwd, tiled_bwd, bound=tiled_bwd if tiled else None, phase="attention",
        source="dQ, dK, dV, fp32 dQ accumulator x flash_dq_splits, dO, rotated q and k "
               f"(model.py attention_backward_transient){gathered}"
               + ("; cuDNN's dK and dV at the query heads over the call's keys (te_gqa_expansion)"
                  if te_gqa_expansion(s, run) else "") + "; never alive with the MoE's backward"
               + (f"; tiled sublayer: whole K, V, their fp32 gradient sums, the incoming gradient and dx, plus one "
                  f"tile of {tile_tokens(run, pf)} tokens (tile/bound.py)" if tiled else "")
               + (f"; at CP {run.cp} K, V and their gradient sums are the gathered sequence's, with the rank's "
                  "reduce-scattered dK and dV" if tiled and run.cp > 1 else ""))
    if g.n_dense:
        mlp_bwd = mlp_backward_transient(s, run, s.ffn)
        rows["mlp backward"] = Row(
            "mlp backward", mlp_bwd, mlp_bwd, phase="mlp",
            source="a dense MLP's backward: the gradients of its activation's and fc1's outputs "
                   "(model.py mlp_backward_transient); never alive with attention's backward or a MoE's")
    if scores:
        rows["attention scores"] = Row(
            "attention scores", scores, scores, phase="attention",
            source="Transformer Engine's unfused attention backend: [b, heads/TP, s, s] probabilities, their gradient "
                   "and the softmax's input gradient of the layer in backward (te_limits.unfused_scores_bytes), "
                   f"because {run.unfused_attention}")
    workspace = deterministic_workspace(s, run, pf, tiled=False) if layer_act else 0.0
    if workspace:
        rows["attention scores"] = Row(
            "attention scores", workspace, deterministic_workspace(s, run, pf, tiled=True) if tiled else workspace,
            phase="attention",
            source="cuDNN's deterministic attention backward under --deterministic-mode: its dP workspace, "
                   "[b, heads/TP, s_q, s_kv] bf16 for one call (te_limits.deterministic_workspace_bytes)"
                   + ("; the tiled sublayer's calls: one tile against its prefix" if tiled else ""))
    return n_ckpt, stored_layers


def deterministic_workspace(s: ModelShape, run: RunConfig, pf: PeakflatConfig, *, tiled: bool) -> float:
    """The dP workspace of the layer's largest attention call (``te_call_shape``, tiled or not) under cuDNN's
    deterministic backward (``te_limits.deterministic_workspace_applies``); 0 where it does not run."""
    from .te_limits import deterministic_workspace_applies, deterministic_workspace_bytes

    if not deterministic_workspace_applies(run):
        return 0.0
    heads, q, kv = te_call_shape(s, run, tile_tokens(run, pf) if tiled else None)
    return deterministic_workspace_bytes(micro_batch=run.micro_batch, heads=heads, tp=run.tp, q_tokens=q,
                                         kv_tokens=kv)


def unfused_scores(s: ModelShape, run: RunConfig, *, saved: bool = False) -> float:
    """One layer's [b, heads/TP, s_q, s_k] scores, probabilities and their gradients in backward under Transformer
    Engine's unfused attention backend (``run.unfused_attention``; ``saved``: what it keeps for backward instead;
    ``te_limits.unfused_scores_bytes``); 0 where flash or fused attention runs."""
    if not run.unfused_attention:
        return 0.0
    from .te_limits import unfused_scores_bytes

    return unfused_scores_bytes(micro_batch=run.micro_batch, heads=s.heads, tp=run.tp, seq_len=run.seq_len,
                                cp=run.cp, cp_comm=list(run.cp_comm_type), bytes_per_element=run.w, saved=saved)


def _boundary_rows(rows: dict[str, Row], notes: list[str], s: ModelShape, run: RunConfig, pf: PeakflatConfig,
                   g: _Stage, n_ckpt: int) -> int:
    """Row ``sco`` (full recompute's checkpoint boundaries; SCO's pinned host share of them); returns SCO's
    host budget per rank (0 without full recompute). Reads the ``optimizer`` row's host bytes."""
    boundary = boundary_bytes(s, run)
    if run.recompute != "full":
        rows["sco"] = Row("sco", 0.0, 0.0, bound=None,
                                 source="no full recompute: layers keep their activations (row 'activations')")
        notes.append("SCO needs --recompute-granularity full; without it the boundary peak is the activations row")
        return 0
    total_b = g.inflight * n_ckpt * boundary
    budget = sco_budget(s, run, pf, rows["optimizer"].host_peakflat)
    on_host = min(total_b, (budget // boundary) * boundary) if boundary else 0
    resident = min(1 + pf.sco.prefetch, g.inflight * n_ckpt) * boundary
    gpu_pf = total_b - on_host + (resident if on_host else 0)
    rows["sco"] = Row(
        "sco", total_b, min(gpu_pf, total_b), bound=resident, host_peakflat=on_host,
        source="CheckpointFunction saves the chunk input [s/tp, b, h] (tensor_parallel/random.py); "
               "SCO keeps them pinned on host up to its budget, 1+prefetch on GPU")
    if on_host < total_b:
        notes.append(f"SCO budget {on_host / GIB:.1f} GiB holds {on_host / max(1, total_b):.0%} of the "
                     "boundaries; the rest stay on the GPU")
    return budget


def _dispatcher_rows(rows: dict[str, Row], s: ModelShape, run: RunConfig, pf: PeakflatConfig, g: _Stage,
                     n_ckpt: int) -> None:
    """Rows ``dispatcher probs``, ``probs at step`` and ``dispatcher state``: what Megatron's dispatchers keep
    alive between calls, which moe-release (any component on) drops."""
    boundary = boundary_bytes(s, run)
    inputs, grads, at_step = dispatcher_held(*g.kinds, run)
    fixed = pf.releases_dispatcher_state
    if at_step and run.recompute == "full":
        # the sco row holds every checkpoint input through the backward: count those beyond it. (Under
        # selective recompute the activations row holds every layer's saved tensors, more than 2 [T, H] each.)
        extra = grads + max(0, 1 + inputs - n_ckpt)
        rows["dispatcher probs"] = Row(
            "dispatcher probs", extra * boundary, 0.0 if fixed else extra * boundary, phase="layer",
            source=f"the dispatcher's probs keep {inputs} checkpoint inputs and {grads} of their "
                   "gradients alive at the lowest checkpoint's backward (dispatcher_held); moe-release drops them")
    if at_step:
        rows["probs at step"] = Row(
            "probs at step", at_step * boundary, 0.0 if fixed else at_step * boundary, phase="step",
            source=f"the same through the optimizer step: {at_step} [tokens, hidden] tensors")
    if g.n_moe:
        state = g.n_moe * dispatcher_state(s, run)
        rows["dispatcher state"] = Row(
            "dispatcher state", state, 0.0 if fixed else state,
            source=f"{g.n_moe} MoE layers' dispatchers keep their probabilities, routing and permutation maps until "
                   "their next forward (dispatcher_state); moe-release drops them, PipelinedLLEP keeps none")


def _dispatch_row(rows: dict[str, Row], s: ModelShape, run: RunConfig, pf: PeakflatConfig, g: _Stage,
                  stored_layers: int) -> None:
    """Row ``dispatch``: Megatron's alltoall dispatcher against PipelinedLLEP's chunks and their bound."""
    pairs = routed_pairs(s, run)
    # the MoE forward runs again in its layer's backward: one layer's dispatch is alive at a time
    moe_recomputed = run.recompute == "full" or recomputes(run, "moe")
    if moe_recomputed:
        base = dispatch_working_set(s, run, pairs)
    else:
        base = g.inflight * stored_layers / g.n_layers * g.n_moe * dispatch_saved_per_layer(s, run, pairs) \
            + dispatch_working_set(s, run, pairs) - dispatch_saved_per_layer(s, run, pairs)
    rows_bound, rows_expected = llep_rows(s, run, pf)
    chunks, cap = llep_chunks(s, run, pf)
    bound = llep_working_set(s, run, rows_bound, llep_overlaps(s, run, pf, worst=True), pf)
    rows["dispatch"] = Row(
        "dispatch", base, llep_expected_working_set(s, run, pf, rows_expected), bound=bound,
        phase="moe" if moe_recomputed else "persistent",
        source=f"alltoall dispatcher: R x (4H + 3F) x w per layer, R = {pairs:.3g} pairs (skew "
               f"{run.routing_skew:g}, worst {routed_pairs_worst(s, run):.3g}); PipelinedLLEP: "
               f"K={chunks} chunks of c={cap} pairs per source, "
               f"{rows_expected:.3g} rows per chunk expected ({'grouped GEMMs' if llep_grouped(run, pf) else 'per expert'}), "
               f"bound dispatch/bound.py working_set_bound at {rows_bound:.3g} rows, with up to "
               f"{llep_hosting(s, run, pf)} hosted foreign experts")


def _vocab_row(rows: dict[str, Row], s: ModelShape, run: RunConfig, pf: PeakflatConfig) -> None:
    """Row ``vocab``: Megatron's cross-entropy (and each MTP loss's saved softmax) against Ring-DTP."""
    ring = vocab_ring_dtp(s, run, pf)
    if s.mtp_layers:  # the MTP layers' losses run the recompute schedule (integration/vocab.py MTPHead)
        ring = max(ring, vocab_ring_dtp(s, run, replace(pf, vocab=replace(pf.vocab, grad="recompute"))))
    mtp_saved = s.mtp_layers * vocab_saved(s, run)
    w = run.w
    rows["vocab"] = Row(
        "vocab", vocab_baseline(s, run) + mtp_saved, ring, bound=ring, phase="loss",
        source=("fused" if run.cross_entropy_fusion else "native") + " vocab_parallel_cross_entropy: "
               f"T x V/tp x {w + 4 + (4 if run.cross_entropy_fusion else 0)} B"
               + (f", + {s.mtp_layers} MTP loss(es) each holding its saved T x V/tp for backward"
                  if s.mtp_layers else "")
               + "; Ring-DTP: T/P x block x 4 + dW shard + dX + ring buffers (MTP losses: O(T) state)")


def _stage_notes(s: ModelShape, run: RunConfig, g: _Stage, vpp: int, unpadded: int) -> list[str]:
    notes = []
    unmodelled = [m for m in run.recompute_modules if m not in MODELLED_RECOMPUTE_MODULES]
    if run.recompute == "selective" and unmodelled:
        notes.append(f"--recompute-modules {' '.join(unmodelled)}: not modelled, counted as saved (an upper bound)")
    if g.mtp:
        notes.append(f"{g.mtp} MTP layer(s) counted as layers of the last decoder layer's kind, plus their "
                     "eh_proj, norms and the word embeddings they read")
    if vpp > 1:
        notes.append(f"interleaved 1F1B (VPP={vpp}): {g.chunks} forward model chunks of about 1/{vpp} of the "
                     f"stage's layers in flight at its peak, {g.inflight:g} stages' worth")
    if g.last and s.vocab != unpadded:
        notes.append(f"vocabulary padded from {unpadded} to {s.vocab} rows, as Megatron pads it to a multiple of "
                     f"--make-vocab-size-divisible-by x TP = {run.vocab_divisible_by * run.tp}")
    return notes


def _stage_label(st: int, pp: int) -> str:
    return "only" if pp == 1 else ("first" if st == 0 else ("last" if st == pp - 1 else f"middle {st}"))
