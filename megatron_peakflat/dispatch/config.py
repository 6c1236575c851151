"""Knobs of PipelinedLLEP: ``--peakflat-dispatch`` and ``--peakflat-dispatch-*``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..config_base import ComponentConfig, PeakflatConfigError, cuda_graph_flag, megatron_arg as _get
from ..runtime import machine

AUTO_CAP_TOKENS = 8192
"""--peakflat-dispatch-chunk-cap auto: this many tokens' token-expert pairs per source rank and chunk..."""
AUTO_CAP_MIN_PAIRS = 32768
"""...but no fewer pairs than this: smaller chunks cost more in per-chunk launches and synchronisation than
they save. Measured on 2 H200s at EP=2, 64 experts top-2, 32K tokens per rank, both regimes, balanced and
95% skewed: chunks of 8K pairs (cap 16384) ran at 0.67-1.00x one chunk's speed (0.67-0.77x on TE's grouped
experts), chunks of 16K pairs (this floor) at 0.99-1.06x."""

MEMBERSHIPS = ("auto", "expert", "strided", "hybrid")
"""The values of --peakflat-dispatch-membership (``DispatchConfig.membership``)."""


def resolve_membership(membership: str) -> str:
    """The chunk membership a schedule uses: ``"auto"`` is ``"expert"`` (cut per flow) at any EP size.
    Here, free of torch, so that the planner asks the same question as the schedule."""
    return "expert" if membership == "auto" else membership


_DISPATCH_CONFLICTS: tuple[tuple[str, str, str], ...] = (
    # (Megatron dest, what it does that PipelinedLLEP cannot, the fix)
    ("add_bias_linear", "experts with biases (Megatron's default unless --disable-bias-linear); PipelinedLLEP's "
     "experts are bias-free", "pass --disable-bias-linear"),
    ("fp8", "fp8 experts (--fp8-format)", "drop --fp8-format"),
    ("fp4", "fp4 experts (--fp4-format)", "drop --fp4-format"),
    ("moe_router_padding_for_quantization", "router padding for quantized experts",
     "drop --moe-router-padding-for-quantization"),
    ("delay_wgrad_compute", "delayed expert weight gradients", "drop --delay-wgrad-compute"),
    ("overlap_dispatch_backward_with_experts_wgrad", "Megatron's own dispatch/wgrad overlap",
     "drop --overlap-dispatch-backward-with-experts-wgrad"),
    ("moe_latent_size", "latent MoE projections", "drop --moe-latent-size"),
    ("use_te_activation_func", "Transformer Engine activation modules in the experts",
     "drop --use-te-activation-func"),
    ("use_transformer_engine_op_fuser", "TE's fused grouped MLP", "drop --use-transformer-engine-op-fuser"),
    ("moe_single_grouped_weight", "one grouped weight tensor per projection (PipelinedLLEP reads TE's weight0.."
     "weightN layout)", "drop --moe-single-grouped-weight"),
    ("moe_single_grouped_bias", "grouped expert biases", "drop --moe-single-grouped-bias"),
    ("moe_mlp_glu_interleave_size", "interleaved GLU weights", "drop --moe-mlp-glu-interleave-size"),
)
"""Megatron flags (dests) whose MoE layers PipelinedLLEP would hand back to Megatron's dispatcher, refused at start-up."""


@dataclass(kw_only=True)
class DispatchConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "dispatch"
    MODE_FIELD: ClassVar[str] = "impl"
    MODE_FLAG: ClassVar[str] = "dispatch"

    impl: Literal["megatron", "pipelined-llep"] = "megatron"
    """Expert dispatch. 'pipelined-llep' replaces Megatron's alltoall dispatcher with least-loaded
    expert parallelism and chunked dispatch, whose working set does not grow with routing skew."""
    chunk_cap: int | None = None
    """c: the most token-expert pairs that one source rank sends into one dispatch chunk (K is the
    smallest chunk count that respects it for the group's largest source, the same on every EP rank).
    The expert working set of a chunk is at most EP * c rows, whatever the routing. 'auto': 8192 x
    --moe-router-topk, at least 32768 (65536 at top-8, 32768 at top-4 and below), so that a call of 32K
    tokens per rank is cut into 4 chunks at top-4 as at top-8, and chunks never get so small that
    per-chunk overheads dominate. With
    --peakflat-dispatch-membership strided each chunk also reads every local expert's weights and adds
    their gradients once, so smaller caps cost time in proportion to K."""
    membership: Literal["auto", "expert", "strided", "hybrid"] = "auto"
    """Which chunk a token-expert pair joins. 'expert' (what 'auto' picks): each flow (the pairs one
    source rank sends one destination rank) sorted by expert and cut into K even slices, slice j of
    every flow forming chunk j: each chunk computes a few experts per destination, so an expert's
    weights are read and its gradient accumulated in about one chunk, and every destination gets 1/K of
    every flow in every chunk however hot an expert is. 'strided': token i joins chunk i mod K, so every
    chunk reads every expert's weights and adds to every expert's gradient.
    'hybrid': the pairs of cold experts (under 3/4 of the mean load) expert-major, the others strided.
    The same cap either way (hybrid may need a chunk more to keep it)."""
    max_chunks: int = 64
    """The most chunks K one MoE layer is split into; c grows when K would exceed it."""
    alpha: float = 1.0
    """Capacity factor: each rank computes at most alpha x the mean load before it spills."""
    min_spill: int = 1024
    """m: spills smaller than this many tokens are skipped, unless they are an expert's remainder."""
    imbalance_threshold: float = 1.3
    """lambda: when max/mean rank load is below this, plain EP runs (no expert weights move)."""
    max_foreign_experts: int | None = None
    """The most experts of other ranks that one rank hosts (receives the weights of, and computes) in one layer
    call. A spill that would exceed it stays on its owner, which is always exact. Each hosted expert costs
    its weights (or, at the end, the gradient it sends home) and the fp32 sum of their gradient: (dtype
    bytes + 4) per parameter, at once. 'auto': the most whose cost fits in a quarter of one chunk's dispatch and combine
    rows at the cap (EP x c rows of 12 x hidden x dtype bytes), so the hosted weights and accumulators stay
    at most 1/4 of that token working set; 0 at shapes where one expert costs more (no weights move).
    Guarantee (dispatch/bound.py working_set_bound and flow_chunk_rows): a rank's peak counts these, the
    weight copies it sends (at most min((EP - 1) x min(E_p, this), EP - 1 + E_p)), and the load that
    refused spills leave on their owner, at most E_p x EP / (E_p + this) times the mean load, whatever the
    routing. 0 turns moving weights off (every expert computed at home)."""
    fuse_recompute: bool = True
    """Under full recompute (or --recompute-modules moe), run each chunk's forward and backward
    together in the checkpoint's recompute, where the MoE output's gradient is already known: one
    expert forward less per layer. Checked against the gradient that arrives, with no host sync when it
    is the checkpoint's own tensor (as Megatron's residual add passes it); a different gradient is
    corrected exactly, except at EP > 1 after the layer had matched on every rank, where it raises.
    Once a layer's gradient has matched, its later recomputes skip the MoE output too, which only the
    checkpoint's discarded output reads. Needs --hidden-dropout 0 (Megatron's default is 0.1);
    otherwise it turns itself off, logged."""
    overlap: bool = False
    """At EP > 1, send chunk j+1's rows and chunk j's results while the next chunk computes (async
    all-to-alls), hiding communication behind the experts' GEMMs, in every layer call, including
    those the cap leaves whole. Costs two more chunks' send and receive buffers in flight (8 x hidden
    x dtype bytes per received row). Without this flag, calls the cap splits overlap by themselves
    (--peakflat-dispatch-overlap-min-chunks > 0)."""
    overlap_min_chunks: int = 8
    """N: at EP > 1 a layer call that the cap splits (K >= 2) overlaps its all-to-alls and is cut into
    at least min(N, 2K) chunks, so the two chunks in flight hold at most 2/N of its rows while no
    chunk drops under half the cap. 0: K is the cap's alone and only --peakflat-dispatch-overlap
    overlaps. Every rank of the EP group sees the same K and decides alike."""
    pack_collectives: bool = True
    """At EP > 1, send each chunk's hidden rows, probabilities and (in backward) output-gradient rows as
    one buffer in one all-to-all, and its results home in one: one all-to-all each way per chunk instead
    of up to three, the same bytes (exact: the pieces are copied bit for bit).
    --no-peakflat-dispatch-pack-collectives sends each piece on its own."""
    transport: Literal["auto", "nccl", "copy-engine"] = "auto"
    """What carries an overlapped call's packed all-to-alls. 'copy-engine': the GPUs' copy engines,
    pulling each peer's rows over NVLink from a symmetric-memory slot (torch.distributed's symmetric
    memory), so the all-to-alls take no SM from the GEMMs they overlap; needs every EP rank on one host.
    It holds 2 slots of symmetric memory, each sized to the largest exchange seen (one hidden row per
    pair: wider buffers travel as several exchanges), in place of the send buffers an overlapped call
    keeps in flight (counted in the benchmarks' peaks). 'nccl': NCCL's all-to-all. 'auto': the copy
    engines where they can run (CUDA, one host), else NCCL, logged. Calls that do not overlap use NCCL
    either way."""
    grouped_gemm: bool = True
    """Run each chunk's experts as grouped GEMMs (torch._grouped_mm: bf16 on sm80+ GPUs) on strided
    views of their weights, with no weight copy; --no-peakflat-dispatch-grouped-gemm runs one expert
    at a time (the same math, more kernel launches)."""

    def cap(self, topk: int) -> int:
        """The chunk cap in pairs for a router of ``topk``: ``chunk_cap``, or under 'auto'
        ``AUTO_CAP_TOKENS`` tokens' pairs, at least ``AUTO_CAP_MIN_PAIRS``."""
        if self.chunk_cap is not None:
            return self.chunk_cap
        return max(AUTO_CAP_TOKENS * max(1, topk), AUTO_CAP_MIN_PAIRS)

    def describe_cap(self, topk: int) -> str:
        """The cap as the start-up log states it: the number given, or 'auto' with what it is at ``topk``."""
        if self.chunk_cap is not None:
            return str(self.chunk_cap)
        return (f"auto ({self.cap(topk)} pairs: {AUTO_CAP_TOKENS} tokens x top-{topk}, "
                f"at least {AUTO_CAP_MIN_PAIRS})")

    def resolved(self, topk: int) -> "DispatchConfig":
        """This config with 'auto' knobs made numbers for a router of ``topk`` (what the algorithms take)."""
        return self if self.chunk_cap is not None else dataclasses.replace(self, chunk_cap=self.cap(topk))

    def validate(self) -> None:
        if self.chunk_cap is not None and self.chunk_cap < 1:
            raise PeakflatConfigError(self.flag("chunk_cap"), self.chunk_cap,
                                      "the chunk cap must be at least 1 token-expert pair",
                                      "pass a positive count of token-expert pairs, e.g. --peakflat-dispatch-chunk-cap "
                                      "32768 (4096 tokens at top-8), or auto")
        if self.max_chunks < 1:
            raise PeakflatConfigError(self.flag("max_chunks"), self.max_chunks, "at least one chunk is needed",
                                      "pass a positive integer, e.g. --peakflat-dispatch-max-chunks 64")
        if not math.isfinite(self.alpha) or self.alpha < 1.0:
            raise PeakflatConfigError(self.flag("alpha"), self.alpha,
                                      "a capacity below the mean load cannot hold every token, and it must be finite",
                                      "pass a finite alpha >= 1.0, e.g. --peakflat-dispatch-alpha 1.0")
        if self.min_spill < 0:
            raise PeakflatConfigError(self.flag("min_spill"), self.min_spill, "a spill size cannot be negative",
                                      "pass 0 or more, e.g. --peakflat-dispatch-min-spill 1024")
        if self.max_foreign_experts is not None and self.max_foreign_experts < 0:
            raise PeakflatConfigError(self.flag("max_foreign_experts"), self.max_foreign_experts,
                                      "a rank cannot host a negative number of experts",
                                      "pass 0 (weights never move), a count such as "
                                      "--peakflat-dispatch-max-foreign-experts 4, or auto")
        if self.overlap_min_chunks < 0:
            raise PeakflatConfigError(self.flag("overlap_min_chunks"), self.overlap_min_chunks,
                                      "a chunk count cannot be negative",
                                      "pass 0 (never by itself) or a chunk count, e.g. --peakflat-dispatch-overlap-min-chunks 8")
        if self.transport == "copy-engine" and not self.pack_collectives:
            raise PeakflatConfigError(self.flag("transport"), self.transport,
                                      "the copy engines carry packed exchanges only",
                                      "drop --no-peakflat-dispatch-pack-collectives, or pass "
                                      "--peakflat-dispatch-transport nccl")
        if not math.isfinite(self.imbalance_threshold) or self.imbalance_threshold < 1.0:
            raise PeakflatConfigError(self.flag("imbalance_threshold"), self.imbalance_threshold,
                                      "max/mean load is never below 1, so a threshold under 1 (or NaN) would always "
                                      "rebalance, and an infinite one leaves the planner's bound undefined",
                                      "pass a finite lambda >= 1.0, e.g. --peakflat-dispatch-imbalance-threshold 1.3")

    def check_against_megatron(self, args: Any) -> None:
        """Refuse, at start-up, the Megatron flags beside which PipelinedLLEP cannot run (Megatron's parsed args)."""
        if self.impl == "megatron":
            return
        num_experts = _get(args, "num_experts")
        flag = self.flag("impl")
        if not num_experts:
            raise PeakflatConfigError(flag, self.impl, "the model has no MoE layers to dispatch for",
                                      "add --num-experts N, or drop " + flag)
        freq = _get(args, "moe_layer_freq", 1)
        if isinstance(freq, (list, tuple)) and not any(freq):
            raise PeakflatConfigError(flag, self.impl,
                                      f"--moe-layer-freq {list(freq)} makes every layer dense, so the model has no "
                                      "MoE layers to dispatch for", "put a 1 in --moe-layer-freq, or drop " + flag)
        if _get(args, "moe_token_dispatcher_type", "alltoall") != "alltoall":
            raise PeakflatConfigError(flag, self.impl,
                                      f"it replaces the alltoall dispatcher, but --moe-token-dispatcher-type is "
                                      f"{_get(args, 'moe_token_dispatcher_type')!r}",
                                      "pass --moe-token-dispatcher-type alltoall")
        etp = _get(args, "expert_tensor_parallel_size", 1) or 1
        if etp > 1:
            raise PeakflatConfigError(flag, self.impl,
                                      f"expert tensor parallelism ({etp}) is not supported by PipelinedLLEP yet",
                                      "pass --expert-tensor-parallel-size 1")
        if _get(args, "moe_pad_expert_input_to_capacity", False):
            raise PeakflatConfigError(flag, self.impl,
                                      "--moe-pad-expert-input-to-capacity pads the dispatcher's buffers, which "
                                      "PipelinedLLEP replaces (it is dropless and never pads)",
                                      "drop --moe-pad-expert-input-to-capacity, or drop " + flag)
        ep = _get(args, "expert_model_parallel_size", 1) or 1
        if num_experts % ep:
            raise PeakflatConfigError(flag, self.impl,
                                      f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}",
                                      "choose an EP size that divides the number of experts")
        self._check_experts(args)
        hosts_ranks = machine.local_world_size(default=None)  # unknown here: checked at the first call
        if self.transport == "copy-engine" and hosts_ranks is not None and ep > hosts_ranks:
            raise PeakflatConfigError(self.flag("transport"), self.transport,
                                      f"the copy engines need every rank of an expert-parallel group on one host, and "
                                      f"--expert-model-parallel-size {ep} is more than the {hosts_ranks} ranks per host "
                                      "(LOCAL_WORLD_SIZE)",
                                      "pass --peakflat-dispatch-transport auto (NCCL where a group spans hosts) or nccl")

    def _check_experts(self, args: Any) -> None:
        """Reject the Megatron flags whose MoE layers PipelinedLLEP would hand back to Megatron's dispatcher
        (``integration.dispatch.unsupported_reason``), so that the choice fails at start-up, not silently."""
        flag = self.flag("impl")
        for dest, what, fix in _DISPATCH_CONFLICTS:
            if _get(args, dest):
                raise PeakflatConfigError(flag, self.impl, f"it does not support {what}",
                                          f"{fix}, or drop {flag}")
        graphs = cuda_graph_flag(args)
        if graphs:
            raise PeakflatConfigError(flag, self.impl, f"{graphs} captures the layers, and PipelinedLLEP's chunk "
                                      "sizes follow the routing", f"drop {graphs.split()[0]}, or drop {flag}")
        if _get(args, "transformer_impl") == "inference_optimized":
            raise PeakflatConfigError(flag, self.impl, "--transformer-impl inference_optimized builds inference "
                                      "experts", f"use --transformer-impl transformer_engine or local, or drop {flag}")
        offloaded = {"expert_fc1", "moe_act"} & set(_get(args, "offload_modules", None) or [])
        if _get(args, "fine_grained_activation_offloading") and offloaded:
            raise PeakflatConfigError(flag, self.impl,
                                      f"--offload-modules {' '.join(sorted(offloaded))} offloads activations inside "
                                      "Megatron's expert modules, which PipelinedLLEP does not call",
                                      f"drop {' '.join(sorted(offloaded))} from --offload-modules, or drop {flag}")
