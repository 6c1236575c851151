"""``PeakflatConfig``: every knob of the four components, the ``--peakflat-*`` flags and their checks.

The flags are derived from the component dataclasses (``config_base.ComponentConfig.add_flags``).
``PeakflatConfig.from_args(args)`` builds the config from a parsed Megatron namespace and runs
every check, the checks against Megatron's own flags included, so a bad value or an incompatible
combination fails at start-up with a message naming the flag, the value and the fix.

No Megatron import: Megatron's parsed arguments are read as a plain namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal

from .config_base import ComponentConfig, PeakflatConfigError, read_dash_values, shown_default
from .dispatch.config import DispatchConfig
from .optimizer.config import OptimizerConfig
from .recompute.config import SCOConfig
from .tiling.config import TileConfig
from .vocab.config import VocabConfig

log = logging.getLogger("megatron_peakflat")

__all__ = ["PeakflatConfig", "GeneralConfig", "add_args", "PeakflatConfigError"]


@dataclass(kw_only=True)
class GeneralConfig(ComponentConfig):
    PREFIX: ClassVar[str] = ""

    attention: Literal["auto", "local", "sdpa"] = "auto"
    """Core attention of Megatron's local spec. 'sdpa' uses torch scaled_dot_product_attention
    (flash/memory-efficient kernels, no s x s scores), and runs --context-parallel-size > 1 (K and V
    all-gathered over the CP group), which Megatron's local attention refuses; 'auto' picks sdpa when
    Transformer Engine is absent and leaves TE's attention alone when it is present."""
    report_peaks: bool = False
    """Measure each component's peak memory and log it every log interval beside the planner's prediction."""
    log_all_ranks: bool = False
    """Log peakflat's lines from every rank, each prefixed with its rank. Without it rank 0 logs each decision
    once, and only the lines that differ per rank (measured per-rank figures, host memory) come from every
    rank, prefixed with theirs."""


_COMPONENTS: dict[str, type[ComponentConfig]] = {
    "dispatch": DispatchConfig,
    "vocab": VocabConfig,
    "sco": SCOConfig,
    "optimizer": OptimizerConfig,
    # --- component "tile" (tiled attention sublayer): its registration is this entry, the PeakflatConfig
    # field and `enabled` entry below, its title in add_args and _check_tile in _check_against_megatron ---
    "tile": TileConfig,
    "general": GeneralConfig,
}


@dataclass(kw_only=True)
class PeakflatConfig:
    """All knobs. Every component is off by default: an empty command line changes nothing."""

    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    sco: SCOConfig = field(default_factory=SCOConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    tile: TileConfig = field(default_factory=TileConfig)
    general: GeneralConfig = field(default_factory=GeneralConfig)

    @property
    def releases_dispatcher_state(self) -> bool:
        """Whether ``apply`` adds moe-release (integration/moe_release.py), the fix to Megatron's own dispatchers:
        with any component on. The planner's peakflat column follows it."""
        return any(self.enabled.values())

    @property
    def enabled(self) -> dict[str, bool]:
        """Which components replace a Megatron part."""
        return {
            "dispatch": self.dispatch.impl != "megatron",
            "vocab": self.vocab.impl != "megatron",
            "sco": self.sco.enabled,
            "optimizer": self.optimizer.impl != "megatron",
            "tile": self.tile.enabled,
        }

    def validate(self, megatron_args: Any | None = None) -> "PeakflatConfig":
        """Check each field, then the combinations with Megatron's flags when they are given."""
        for name in _COMPONENTS:
            getattr(self, name).validate()
        if megatron_args is not None:
            _check_against_megatron(self, megatron_args)
        return self

    @classmethod
    def from_args(cls, args: Any, *, validate: bool = True) -> "PeakflatConfig":
        """Build from a namespace holding the ``peakflat_*`` dests (Megatron's parsed args)."""
        cfg = cls(**{name: comp.from_namespace(args) for name, comp in _COMPONENTS.items()})
        if validate:
            cfg.validate(args)
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``--peakflat-*`` flag. Usable as Megatron's ``extra_args_provider``."""
    titles = {
        "dispatch": "peakflat: PipelinedLLEP expert dispatch",
        "vocab": "peakflat: Ring-DTP vocabulary projection",
        "sco": "peakflat: SCO checkpoint-boundary offload",
        "optimizer": "peakflat: OffloadStreamAdamW",
        "tile": "peakflat: tiled attention sublayer",
        "general": "peakflat: general",
    }
    groups = {name: parser.add_argument_group(titles[name]) for name in _COMPONENTS}
    groups["general"].add_argument(
        "--peakflat", choices=["auto", "manual"], default="manual", dest="peakflat",
        help="auto: turn on the components and knobs that the peak planner recommends for this run on this "
             "machine (GPU memory, host memory, world size), and log the decision; --peakflat-* flags given "
             "alongside win. manual: exactly the --peakflat-* flags given. (default: manual)")
    for name, comp in _COMPONENTS.items():
        comp.add_flags(groups[name])
    read_dash_values(parser)
    return parser


def chain_args(*providers: Callable[[argparse.ArgumentParser], Any] | None
               ) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """One ``extra_args_provider`` that runs each of ``providers`` on Megatron's parser in turn and returns it.

    Megatron takes a single provider, and Megatron-LM's ``pretrain_gpt.py`` already passes one where modelopt is
    installed (as in NGC containers): ``chain_args(megatron_peakflat.add_args, add_modelopt_args if
    has_nvidia_modelopt else None)``. A None is skipped, so that conditional can stay as it is; a provider that
    returns None (instead of the parser) is allowed."""
    chain = [p for p in providers if p is not None]
    for p in chain:
        if not callable(p):
            raise TypeError(f"chain_args: {p!r} is not an extra_args_provider (a function of the parser)")

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            out = p(parser)
            parser = parser if out is None else out
        return parser

    return provider


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _check_against_megatron(cfg: PeakflatConfig, args: Any) -> None:
    """Reject combinations with Megatron's flags that cannot work, before any model is built."""
    if _get(args, "mtp_num_layers") and _get(args, "recompute_granularity") == "full":
        _check_megatron_mtp_full_recompute(_get(args, "mtp_num_layers"))
    num_experts = _get(args, "num_experts")
    if cfg.dispatch.impl != "megatron":
        flag = cfg.dispatch.flag("impl")
        if not num_experts:
            raise PeakflatConfigError(flag, cfg.dispatch.impl, "the model has no MoE layers to dispatch for",
                                      "add --num-experts N, or drop " + flag)
        freq = _get(args, "moe_layer_freq", 1)
        if isinstance(freq, (list, tuple)) and not any(freq):
            raise PeakflatConfigError(flag, cfg.dispatch.impl,
                                      f"--moe-layer-freq {list(freq)} makes every layer dense, so the model has no "
                                      "MoE layers to dispatch for", "put a 1 in --moe-layer-freq, or drop " + flag)
        if _get(args, "moe_token_dispatcher_type", "alltoall") != "alltoall":
            raise PeakflatConfigError(flag, cfg.dispatch.impl,
                                      f"it replaces the alltoall dispatcher, but --moe-token-dispatcher-type is "
                                      f"{_get(args, 'moe_token_dispatcher_type')!r}",
                                      "pass --moe-token-dispatcher-type alltoall")
        etp = _get(args, "expert_tensor_parallel_size", 1) or 1
        if etp > 1:
            raise PeakflatConfigError(flag, cfg.dispatch.impl,
                                      f"expert tensor parallelism ({etp}) is not supported by PipelinedLLEP yet",
                                      "pass --expert-tensor-parallel-size 1")
        if _get(args, "moe_pad_expert_input_to_capacity", False):
            raise PeakflatConfigError(flag, cfg.dispatch.impl,
                                      "--moe-pad-expert-input-to-capacity pads the dispatcher's buffers, which "
                                      "PipelinedLLEP replaces (it is dropless and never pads)",
                                      "drop --moe-pad-expert-input-to-capacity, or drop " + flag)
        ep = _get(args, "expert_model_parallel_size", 1) or 1
        if num_experts % ep:
            raise PeakflatConfigError(flag, cfg.dispatch.impl,
                                      f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}",
                                      "choose an EP size that divides the number of experts")
        _check_dispatch_experts(cfg, args)
        hosts_ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
        if cfg.dispatch.transport == "copy-engine" and hosts_ranks.isdigit() and ep > int(hosts_ranks):
            raise PeakflatConfigError(cfg.dispatch.flag("transport"), cfg.dispatch.transport,
                                      f"the copy engines need every rank of an expert-parallel group on one host, and "
                                      f"--expert-model-parallel-size {ep} is more than the {hosts_ranks} ranks per host "
                                      "(LOCAL_WORLD_SIZE)",
                                      "pass --peakflat-dispatch-transport auto (NCCL where a group spans hosts) or nccl")
    if cfg.vocab.shard_over_ep:
        _check_vocab_shard_over_ep(cfg, args)
    if cfg.sco.enabled:
        flag = cfg.sco.flag("enabled")
        if _get(args, "recompute_granularity") != "full":
            raise PeakflatConfigError(flag, True,
                                      "SCO offloads the boundaries of full-recompute checkpoints, but "
                                      f"--recompute-granularity is {_get(args, 'recompute_granularity')!r}",
                                      ("pass --recompute-granularity full in place of "
                                       f"{_get(args, 'recompute_granularity')!r}, with" if _get(args, "recompute_granularity")
                                       else "add --recompute-granularity full")
                                      + " --recompute-method uniform --recompute-num-layers 1")
        if _get(args, "distribute_saved_activations"):
            raise PeakflatConfigError(flag, True,
                                      "--distribute-saved-activations splits boundaries across TP ranks, which SCO does not handle",
                                      "drop --distribute-saved-activations")
        if _get(args, "cpu_offloading"):
            raise PeakflatConfigError(flag, True, "legacy --cpu-offloading cannot run beside SCO",
                                      "drop --cpu-offloading")
        if _get(args, "fp8") or _get(args, "fp4"):
            raise PeakflatConfigError(flag, True,
                                      "fp8/fp4 layers checkpoint through Transformer Engine's te_checkpoint, which SCO "
                                      "does not wrap, so every boundary would stay on the GPU",
                                      "drop --fp8-format / --fp4-format, or drop " + flag)
        graphs = cuda_graph_flag(args)
        if graphs:
            raise PeakflatConfigError(flag, True,
                                      f"{graphs} captures the layers, and a captured layer records no checkpoint "
                                      "boundary for SCO to offload (SCO would hand every captured layer back to "
                                      "Megatron's recompute)", f"drop {graphs.split()[0]}, or drop {flag}")
        _check_sco_budget(cfg, args)
    if cfg.tile.enabled:
        _check_tile(cfg, args)
    if cfg.general.attention == "sdpa" or _auto_sdpa_under_cp(cfg, args):
        _check_sdpa_attention(cfg, args)
    if cfg.optimizer.impl != "megatron":
        flag = cfg.optimizer.flag("impl")
        if _get(args, "optimizer", "adam") != "adam":
            raise PeakflatConfigError(flag, cfg.optimizer.impl,
                                      f"OffloadStreamAdamW implements Adam(W), not --optimizer {_get(args, 'optimizer')}",
                                      "pass --optimizer adam")
        # Megatron builds HybridDeviceOptimizer, the class OffloadStreamAdamW takes the place of, only inside
        # its DistributedOptimizer under --optimizer-cpu-offload, which it ties to
        # --use-precision-aware-optimizer. The user passes all three.
        needed = OptimizerConfig.MEGATRON_FLAGS
        missing = [f for f in needed if not _get(args, f.lstrip("-").replace("-", "_"), False)]
        if missing:
            raise PeakflatConfigError(flag, cfg.optimizer.impl,
                                      "it takes the place of the offloaded optimizer that Megatron builds only with "
                                      f"{' '.join(needed)}", "add " + " ".join(missing))
        if _get(args, "deterministic_mode", False) and cfg.optimizer.engine == "auto":
            cfg.optimizer.engine = "gpu"
            log.info("peakflat optimizer: --deterministic-mode: --peakflat-opt-engine auto -> gpu (auto splits buckets "
                     "between the GPU and host kernels by measured speed, and the two round a few parameters' last "
                     "bit differently, so runs would not repeat bit for bit)")
        if not _get(args, "decoupled_weight_decay", True):
            raise PeakflatConfigError(flag, cfg.optimizer.impl, "it implements AdamW (decoupled weight decay)",
                                      "drop --no-decoupled-weight-decay")
        _check_offload_stream_megatron_knobs(flag, cfg.optimizer.impl, args)
    elif _get(args, "optimizer_cpu_offload", False) and not (_get(args, "bf16") or _get(args, "fp16")):
        _check_megatron_offload_fp32()
    for name in _COMPONENTS:
        for note in getattr(cfg, name).unused_flag_notes():
            log.warning(note)
    for note in _sub_flag_notes(cfg):
        log.warning(note)


def check_devices(cfg: PeakflatConfig) -> None:
    """Refuse choices that need a GPU in a process that sees none (a CPU dry run of a command line): they
    would fail at the first forward otherwise. 'auto' picks what runs on either."""
    import torch

    if torch.cuda.is_available():
        return
    if cfg.vocab.impl != "megatron" and cfg.vocab.kernel == "triton":
        raise PeakflatConfigError(cfg.vocab.flag("kernel"), "triton", "the Triton block kernel runs on CUDA and this "
                                  "process sees no GPU", "pass auto (Triton on CUDA, torch elsewhere) or torch")
    if cfg.dispatch.impl != "megatron" and cfg.dispatch.transport == "copy-engine":
        raise PeakflatConfigError(cfg.dispatch.flag("transport"), "copy-engine", "copy engines move CUDA tensors and "
                                  "this process sees no GPU", "pass auto (copy engines where they apply) or nccl")


def _check_megatron_offload_fp32() -> None:
    """Megatron's own offloaded optimizer, on fp32 parameters. Up to megatron-core 0.19.2 (the last
    release checked) DistributedOptimizer hands HybridDeviceOptimizer fp32 shards that are views of the
    parameters, and torch refuses them once the model is built ("can't optimize a non-leaf Tensor"; fixed
    on Megatron-LM's main by PR 6982). OffloadStreamAdamW keeps its own host copies and runs there.
    Later releases are left to Megatron."""
    version = _megatron_core_version()
    if version is None or version > (0, 19, 2):
        return
    raise PeakflatConfigError("--optimizer-cpu-offload", True,
                              f"megatron-core {'.'.join(map(str, version))}'s offloaded optimizer fails on fp32 "
                              "parameters (without --bf16 or --fp16) once the model is built (\"can't optimize "
                              "a non-leaf Tensor\"; fixed on Megatron-LM's main by PR 6982)",
                              "add --bf16, or add --peakflat-optimizer offload-stream (which runs fp32 parameters)")


def _check_megatron_mtp_full_recompute(layers: int) -> None:
    """megatron-core 0.18's MTP layer under full recompute: ``MultiTokenPredictionLayer.forward`` passes
    ``padding_mask`` to its ``_checkpointed_forward``, which takes no such argument, so the first training step
    raises a TypeError (seen on CPU with 0.18.2; 0.19 takes it)."""
    version = _megatron_core_version()
    if version is None or version >= (0, 19):
        return
    raise PeakflatConfigError("--mtp-num-layers", layers,
                              f"megatron-core {'.'.join(map(str, version))}'s MTP layer fails under "
                              "--recompute-granularity full at the first training step (\"_checkpointed_forward() "
                              "got an unexpected keyword argument 'padding_mask'\"; megatron-core 0.19 runs it)",
                              "install megatron-core 0.19, or recompute selectively (SCO needs full recompute), "
                              "or drop --mtp-num-layers")


def _megatron_core_version() -> tuple[int, ...] | None:
    """The installed megatron-core's (major, minor, patch), as the registry's version guard reads it."""
    from .integration.registry import megatron_core_version

    text = megatron_core_version()
    return None if text is None else tuple(int(x) for x in re.findall(r"\d+", text)[:3])


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


def cuda_graph_flag(args: Any) -> str:
    """The Megatron flag that captures the layers in CUDA graphs, as the user wrote it, or ''. ``args``: Megatron's
    parsed args or its TransformerConfig (the same two fields)."""
    impl = _get(args, "cuda_graph_impl", "none") or "none"
    if impl != "none":
        return f"--cuda-graph-impl {impl}"
    return "--enable-cuda-graph" if _get(args, "enable_cuda_graph") else ""


def _sub_flag_notes(cfg: PeakflatConfig) -> list[str]:
    """Sub-flags of an enabled component that another of its sub-flags makes useless (each changes nothing)."""
    notes = []
    v, o = cfg.vocab, cfg.optimizer
    if v.impl != "megatron" and v.grad == "recompute" and v.chunk_tokens:
        notes.append(f"peakflat: {v.flag('chunk_tokens')}={v.chunk_tokens} has no effect: {v.flag('grad')} recompute "
                     f"computes dX and dW in backward, block by block. Fix: drop {v.flag('chunk_tokens')}, or pass "
                     f"{v.flag('grad')} in-forward")
    if o.impl != "megatron" and o.engine == "gpu" and o.host_threads is not None:
        notes.append(f"peakflat: {o.flag('host_threads')}={o.host_threads} has no effect: {o.flag('engine')} gpu runs "
                     f"every bucket on the GPU. Fix: drop {o.flag('host_threads')}, or pass {o.flag('engine')} auto")
    return notes


def _check_tile(cfg: PeakflatConfig, args: Any) -> None:
    """What the tiled attention sublayer cannot run: a sequence split over ranks (context or sequence
    parallelism), dropout (backward recomputes each tile and must draw the same numbers), Megatron's local
    DotProductAttention (it materialises the causal mask square, not aligned to a tile's prefix), and
    multi-latent attention (other projections)."""
    flag, value = cfg.tile.flag("enabled"), True
    cp = _get(args, "context_parallel_size", 1) or 1
    if cp > 1:
        raise PeakflatConfigError(flag, value, f"--context-parallel-size {cp} splits the sequence over ranks, and "
                                  "the tiles cut the whole sequence of one rank", "pass --context-parallel-size 1, "
                                  f"or drop {flag}")
    if _get(args, "sequence_parallel", False):
        raise PeakflatConfigError(flag, value, "--sequence-parallel splits the layer's input over the tensor-parallel "
                                  "ranks, and the tiles cut the whole sequence",
                                  f"drop --sequence-parallel, or drop {flag}")
    for dest, name in (("hidden_dropout", "--hidden-dropout"), ("attention_dropout", "--attention-dropout")):
        p = _get(args, dest, 0.0) or 0.0
        if p > 0:
            raise PeakflatConfigError(flag, value, f"{name} is {p} (Megatron's default is 0.1), and backward "
                                      "recomputes each tile, which would draw other dropout masks than the forward",
                                      f"pass {name} 0, or drop {flag}")
    if _get(args, "multi_latent_attention", False):
        raise PeakflatConfigError(flag, value, "multi-latent attention projects queries, keys and values "
                                  "differently from the self-attention it tiles", f"drop --multi-latent-attention, "
                                  f"or drop {flag}")
    graphs = cuda_graph_flag(args)
    if graphs:
        raise PeakflatConfigError(flag, value, f"{graphs} captures the layers, whose tiled sublayer recomputes in "
                                  "backward outside any graph", f"drop {graphs.split()[0]}, or drop {flag}")
    if _get(args, "create_attention_mask_in_dataloader", False):
        raise PeakflatConfigError(flag, value, "Megatron's dataloader builds an explicit attention mask "
                                  "(--create-attention-mask-in-dataloader, its default), and a layer given a mask "
                                  "runs Megatron's own attention sublayer, untiled",
                                  "pass --no-create-attention-mask-in-dataloader (a causal model needs no mask)")
    if _get(args, "transformer_impl") == "local" and not _local_spec_runs_sdpa(cfg):
        raise PeakflatConfigError(flag, value, "Megatron's local DotProductAttention (--transformer-impl local with "
                                  f"--peakflat-attention {cfg.general.attention}) builds the causal mask for as many "
                                  "queries as keys, and a tile's queries are the last of its keys",
                                  "pass --peakflat-attention sdpa (torch SDPA aligns the mask to the tile), or use "
                                  "--transformer-impl transformer_engine")


def _local_spec_runs_sdpa(cfg: PeakflatConfig) -> bool:
    """Whether Megatron's local spec gets the SDPA core attention (``apply``'s choice for 'auto')."""
    if cfg.general.attention != "auto":
        return cfg.general.attention == "sdpa"
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is None


def _check_dispatch_experts(cfg: PeakflatConfig, args: Any) -> None:
    """Reject the Megatron flags whose MoE layers PipelinedLLEP would hand back to Megatron's dispatcher
    (``integration.dispatch.unsupported_reason``), so that the choice fails at start-up, not silently."""
    flag = cfg.dispatch.flag("impl")
    for dest, what, fix in _DISPATCH_CONFLICTS:
        if _get(args, dest):
            raise PeakflatConfigError(flag, cfg.dispatch.impl, f"it does not support {what}",
                                      f"{fix}, or drop {flag}")
    graphs = cuda_graph_flag(args)
    if graphs:
        raise PeakflatConfigError(flag, cfg.dispatch.impl, f"{graphs} captures the layers, and PipelinedLLEP's chunk "
                                  "sizes follow the routing", f"drop {graphs.split()[0]}, or drop {flag}")
    if _get(args, "transformer_impl") == "inference_optimized":
        raise PeakflatConfigError(flag, cfg.dispatch.impl, "--transformer-impl inference_optimized builds inference "
                                  "experts", f"use --transformer-impl transformer_engine or local, or drop {flag}")
    offloaded = {"expert_fc1", "moe_act"} & set(_get(args, "offload_modules", None) or [])
    if _get(args, "fine_grained_activation_offloading") and offloaded:
        raise PeakflatConfigError(flag, cfg.dispatch.impl,
                                  f"--offload-modules {' '.join(sorted(offloaded))} offloads activations inside "
                                  "Megatron's expert modules, which PipelinedLLEP does not call",
                                  f"drop {' '.join(sorted(offloaded))} from --offload-modules, or drop {flag}")


def _is_fp32(dtype: Any) -> bool:
    """Megatron's dtype flags hold 'fp32' before its validation and torch.float32 after it."""
    return dtype is None or str(dtype) in ("fp32", "torch.float32")


def _check_offload_stream_megatron_knobs(flag: str, impl: str, args: Any) -> None:
    """Megatron flags of the offloaded optimizer that OffloadStreamAdamW would otherwise ignore or fail on."""
    if _get(args, "optimizer_cuda_graph", False):
        raise PeakflatConfigError(flag, impl,
                                  "--optimizer-cuda-graph records the optimizer step as a CUDA graph, and "
                                  "OffloadStreamAdamW's step streams buckets through the host (host work and "
                                  "host-to-device copies a graph cannot replay)", f"drop --optimizer-cuda-graph, or drop {flag}")
    fraction = _get(args, "optimizer_offload_fraction", 1.0)
    if fraction is not None and fraction != 1.0:
        raise PeakflatConfigError(flag, impl,
                                  f"it keeps the whole optimizer shard on the host (--optimizer-offload-fraction is "
                                  f"{fraction}); where Adam's math runs is --peakflat-opt-engine's choice",
                                  "drop --optimizer-offload-fraction (or set it to 1.0)")
    for dest in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if not _is_fp32(_get(args, dest, None)):
            name = "--" + dest.replace("_", "-")
            raise PeakflatConfigError(flag, impl,
                                      f"it keeps fp32 master weights and moments ({name} is {_get(args, dest)})",
                                      f"drop {name}, or drop {flag}")
    clip = _get(args, "clip_grad", 1.0)
    if _get(args, "fp16") and not _get(args, "accumulate_allreduce_grads_in_fp32") and clip:
        raise PeakflatConfigError(flag, impl,
                                  f"with --fp16 Megatron keeps fp16 gradients, and its gradient clipping (--clip-grad "
                                  f"{clip}) refuses fp16 gradients of an offloaded optimizer at the first step",
                                  "add --accumulate-allreduce-grads-in-fp32, or train with --bf16 (or --clip-grad 0)")


def _check_sco_budget(cfg: PeakflatConfig, args: Any) -> None:
    """An explicit budget smaller than one checkpoint boundary would offload nothing, silently."""
    budget = cfg.sco.budget
    seq, hidden = _get(args, "seq_length"), _get(args, "hidden_size")
    if budget is None or not seq or not hidden:
        return
    tp = (_get(args, "tensor_model_parallel_size", 1) or 1) if _get(args, "sequence_parallel", False) else 1
    cp = _get(args, "context_parallel_size", 1) or 1
    elem = 2 if (_get(args, "bf16") or _get(args, "fp16")) else 4
    boundary = seq // (tp * cp) * (_get(args, "micro_batch_size", 1) or 1) * hidden * elem
    if budget < boundary:
        raise PeakflatConfigError(cfg.sco.flag("budget"), budget,
                                  f"it is smaller than one checkpoint boundary ({boundary} bytes at --seq-length {seq}, "
                                  f"--hidden-size {hidden}), so SCO would offload nothing (a bare number counts bytes)",
                                  "give a size with its unit, e.g. --peakflat-sco-budget 64GiB, or 'auto'; or drop "
                                  + cfg.sco.flag("enabled"))


def _auto_sdpa_under_cp(cfg: PeakflatConfig, args: Any) -> bool:
    """``--peakflat-attention auto`` picks SDPA (no Transformer Engine) for a local-spec run with context
    parallelism, where nothing can be handed back to Megatron's DotProductAttention: it is checked as 'sdpa' is."""
    import importlib.util

    return (cfg.general.attention == "auto" and (_get(args, "context_parallel_size", 1) or 1) > 1
            and _get(args, "transformer_impl") == "local" and importlib.util.find_spec("transformer_engine") is None)


def _check_sdpa_attention(cfg: PeakflatConfig, args: Any) -> None:
    """What the SDPA core attention hands back to Megatron's DotProductAttention, refused when it was asked for;
    with context parallelism, what it does not run (DotProductAttention runs no CP to hand back to)."""
    flag = cfg.general.flag("attention")
    value = cfg.general.attention
    _check_sdpa_context_parallel(flag, value, args)
    if _get(args, "transformer_impl") == "transformer_engine":
        raise PeakflatConfigError(flag, "sdpa", "it replaces the core attention of Megatron's local layer spec, and "
                                  "--transformer-impl transformer_engine builds Transformer Engine's layers, whose "
                                  "attention it never touches", f"pass --transformer-impl local, or drop {flag} "
                                  "(its default, auto, leaves TE's attention alone)")
    uncovered = _sdpa_uncovered(args)
    if uncovered:
        problem, drop = uncovered
        raise PeakflatConfigError(flag, "sdpa", f"{problem}, which would fall back to s x s scores",
                                  f"drop {drop}, or pass {flag} local")


def _sdpa_uncovered(args: Any) -> tuple[str, str] | None:
    """What the SDPA attention does not compute, at any CP: (the problem, the flag that asks for it)."""
    window = _get(args, "window_size")
    if window:
        return f"it does not cover sliding-window attention (--window-size {window})", "--window-size"
    softmax = _get(args, "softmax_type", "vanilla") or "vanilla"
    if softmax != "vanilla":
        return f"it computes the vanilla softmax only, not --softmax-type {softmax}", "--softmax-type"
    return None


_PACKED_UNDER_CP = (("sft", "--sft"), ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
                    ("hybrid_context_parallel", "--hybrid-context-parallel"))
"""Megatron flags whose batches carry packed sequences (cu_seqlens) or per-sample CP groups."""


def _check_sdpa_context_parallel(flag: str, value: str, args: Any) -> None:
    """SDPA with --context-parallel-size > 1 (K/V all-gathered over the CP group): only whole, causal sequences
    split into 2 x CP equal chunks, the vanilla softmax and no sliding window; DotProductAttention, to which
    other cases are handed back at CP 1, refuses CP."""
    cp = _get(args, "context_parallel_size", 1) or 1
    if cp <= 1:
        return
    te = "use Transformer Engine's attention (--transformer-impl transformer_engine)"
    seq = _get(args, "seq_length")
    if seq and seq % (2 * cp):
        raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} each rank holds 2 of 2 x {cp} = "
                                  f"{2 * cp} equal chunks of the sequence, and --seq-length {seq} does not split "
                                  "into them", f"pass a --seq-length that is a multiple of {2 * cp} (e.g. "
                                  f"{-(-seq // (2 * cp)) * 2 * cp}), or another --context-parallel-size")
    uncovered = _sdpa_uncovered(args)
    if uncovered:
        problem, drop = uncovered
        raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} {problem}", f"drop {drop}, or {te}")
    if _get(args, "multi_latent_attention"):
        raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} it gathers K and V of one shape, "
                                  "and multi-latent attention's keys and values differ in head size",
                                  f"drop --multi-latent-attention, or {te}")
    for dest, name in _PACKED_UNDER_CP:
        if _get(args, dest):
            raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} it attends whole sequences "
                                      f"split in Megatron's load-balanced layout, not the packed sequences of {name}",
                                      f"drop {name}, or {te}")


def _check_vocab_shard_over_ep(cfg: PeakflatConfig, args: Any) -> None:
    """Refuse the layouts in which the EP-sharded output layer would not train as the whole one.

    The shard's gradient sums the tokens of the expert-parallel ring, then DDP reduces it, as an expert
    parameter, over the expert data-parallel group only. Those two groups cover every data-parallel rank
    only at --expert-tensor-parallel-size 1: at ETP > 1 (with TP=1) the expert-tensor-parallel ranks hold
    other tokens and the same rows, their gradients are never summed, and the replicas drift apart.
    """
    flag = cfg.vocab.flag("shard_over_ep")
    ep = _get(args, "expert_model_parallel_size", 1) or 1
    tp = _get(args, "tensor_model_parallel_size", 1) or 1
    etp = _get(args, "expert_tensor_parallel_size", 1) or 1
    pp = _get(args, "pipeline_model_parallel_size", 1) or 1
    need = [
        (cfg.vocab.impl == "ring-dtp", "it shards the output layer for the Ring-DTP loss",
         "add --peakflat-vocab ring-dtp"),
        (ep > 1, f"there is no expert-parallel group to shard over (--expert-model-parallel-size {ep})",
         "use it with --expert-model-parallel-size > 1, or drop " + flag),
        (tp == 1, f"--tensor-model-parallel-size is {tp}: the output layer is already vocab-parallel over the "
         "tensor-parallel group", "drop " + flag + " (Ring-DTP rings over the tensor-parallel group)"),
        (etp == 1, f"--expert-tensor-parallel-size is {etp}: the shard's gradient is summed over the expert-parallel "
         "group and reduced over the expert data-parallel group, which leave out the tokens of the other "
         f"{etp - 1} expert-tensor-parallel rank(s), so the shard would train on part of the batch and its "
         "copies drift apart", "pass --expert-tensor-parallel-size 1, or drop " + flag),
        (pp == 1, f"--pipeline-model-parallel-size is {pp}: pipeline parallelism is not supported yet",
         "pass --pipeline-model-parallel-size 1, or drop " + flag),
        (bool(_get(args, "untie_embeddings_and_output_weights", False)),
         "a tied output layer is the input embedding, which stays whole on every rank",
         "add --untie-embeddings-and-output-weights, or drop " + flag),
        ((_get(args, "make_vocab_size_divisible_by", 128) or 1) * tp % ep == 0,
         f"the padded vocabulary must split evenly over EP={ep} (--make-vocab-size-divisible-by "
         f"{_get(args, 'make_vocab_size_divisible_by', 128)})",
         f"pass --make-vocab-size-divisible-by a multiple of {ep}"),
    ]
    for ok, why, fix in need:
        if not ok:
            raise PeakflatConfigError(flag, True, why, fix)


def flags_markdown() -> str:
    """The README's flags table, derived from the dataclasses (``python -m megatron_peakflat.config``)."""
    parser = add_args(argparse.ArgumentParser(add_help=False))
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings:
            continue
        flag = " / ".join(f"`{o}`" for o in action.option_strings)
        choices = f" ({', '.join(map(str, action.choices))})" if action.choices else ""
        text = (action.help or "").replace("%%", "%").rsplit(" (default:", 1)[0]
        rows.append(f"| {flag}{choices} | `{shown_default(action.default)}` | {text} |")
    return "\n".join(rows)


def flags_document() -> str:
    """docs/flags.md: a short header and ``flags_markdown``'s table (``python -m megatron_peakflat.config >
    docs/flags.md`` regenerates it)."""
    return ("# Flags\n\n"
            "Every `--peakflat-*` flag, generated from the config dataclasses in `megatron_peakflat/config.py` and\n"
            "the components' own config files (regenerate with `python -m megatron_peakflat.config > docs/flags.md`).\n"
            "Every component is off by default: a command line without these flags runs Megatron's own dispatch,\n"
            "loss, recompute and optimizer. One default acts alone: without Transformer Engine, `--peakflat-attention\n"
            "auto` makes the core attention of Megatron's local spec torch's SDPA (`local` keeps Megatron's). A bad\n"
            "value or a combination that cannot run fails at start-up, naming the flag, the value and the fix.\n"
            "Sizes take units (`16GiB`, `512MiB`, `2e9`); counts take suffixes (`50M`, `2.5B`).\n\n"
            + flags_markdown() + "\n")


if __name__ == "__main__":
    print(flags_document(), end="")
