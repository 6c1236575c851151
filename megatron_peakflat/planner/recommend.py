"""Pick the peakflat knobs that fit a run into the HBM and host RAM given, or say why nothing fits.

Start from each component's default knobs (the sizes its author found fast: dispatch chunk cap,
automatic vocabulary block, optimizer bucket, 3 staging slots), give SCO the host RAM the optimizer
leaves, then halve whichever knob's row is the largest in the binding stage until the total fits,
whatever the routing, or every knob is at its floor. Then leave off the host components (SCO, the
offloaded optimizer), which cost PCIe time at every step, where the run fits without them.
Smaller knobs only cost time (more chunks, blocks, buckets), never exactness.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .. import components
from ..config import PeakflatConfig
from ..config_base import PeakflatConfigError, flag_name, format_bytes, shown_default
from ..integration import compat
from ..dispatch.config import DispatchConfig
from ..optimizer.config import FP32_GRADS_FLAG, OptimizerConfig, fp16_grads_clipped
from ..sco.config import SCOConfig
from ..tile.config import TileConfig
from ..vocab.config import VocabConfig
from . import dataloader_mask, te_limits
from .megatron_args import MEGATRON_DEFAULTS, is_command_line
from .model import GIB, Plan, Row, RunConfig, plan, tile_tokens, vocab_block, vocab_ring_size
from .shapes import ModelShape

__all__ = ["Recommendation", "recommend", "blockers", "startup_namespace", "layout_flags", "FLOORS"]

FLOORS = {"chunk_cap": 1024, "block_size": 256, "bucket": 5_000_000, "tile_tokens": 2048}
STARTS = {"chunk_cap": DispatchConfig().chunk_cap, "block_size": VocabConfig().block_size,
          "bucket": OptimizerConfig().bucket}
"""The components' own defaults (chunk_cap None: 'auto', 8192 x top-k; block_size 0: Ring-DTP's automatic
~128 MiB block)."""


@dataclass
class Recommendation:
    fits: bool
    config: PeakflatConfig
    plan: Plan
    flags: list[str] = field(default_factory=list)
    """The flags to add to the run's command line: the --peakflat-* knobs and the Megatron flags they need
    (full recompute for SCO, the offloaded optimizer's)."""
    reasons: list[str] = field(default_factory=list)
    layout_flags: list[str] = field(default_factory=list)
    """The parallel layout the plan assumed, as Megatron flags (``layout_flags``): printed on the same line as
    ``flags``, so that the pasted line reproduces the plan, but kept apart from the knobs."""


def _chunks_needed(shape: ModelShape, run: RunConfig, cap: int) -> int:
    """K that keeps every chunk within ``cap`` pairs per source rank (max_chunks must allow it)."""
    r = math.ceil(run.layer_rows)
    return int(-(-r // max(1, cap // max(1, shape.topk))))


def _dispatch_flags(cfg: PeakflatConfig, plan_: Plan) -> list[str]:
    out = [flag_name(DispatchConfig, "impl"), cfg.dispatch.impl,
           flag_name(DispatchConfig, "chunk_cap"), str(shown_default(cfg.dispatch.chunk_cap))]
    if cfg.dispatch.max_chunks != DispatchConfig().max_chunks:
        out += [flag_name(DispatchConfig, "max_chunks"), str(cfg.dispatch.max_chunks)]
    return out


def _vocab_flags(cfg: PeakflatConfig, plan_: Plan) -> list[str]:
    out = [flag_name(VocabConfig, "impl"), cfg.vocab.impl]
    if vocab_ring_size(plan_.run, cfg) > 1:  # one rank holding the whole vocabulary runs no schedule
        out += [flag_name(VocabConfig, "schedule"), plan_.vocab_schedule]
    return out + [flag_name(VocabConfig, "block_size"), str(vocab_block_size(cfg, plan_.run))]


def vocab_block_size(cfg: PeakflatConfig, run: RunConfig) -> int:
    """Ring-DTP's vocabulary block as recommended: the configured one, else the planner's for this run."""
    return cfg.vocab.block_size or vocab_block(run.tp_tokens, run.w, 0)


def _sco_flags(cfg: PeakflatConfig, plan_: Plan) -> list[str]:
    return [flag_name(SCOConfig, "enabled"), flag_name(SCOConfig, "budget"), f"{cfg.sco.budget / GIB:.0f}GiB",
            "--recompute-granularity", "full", "--recompute-method", plan_.run.recompute_method,
            "--recompute-num-layers", str(plan_.run.recompute_num_layers)]


def _optimizer_flags(cfg: PeakflatConfig, plan_: Plan) -> list[str]:
    return [flag_name(OptimizerConfig, "impl"), cfg.optimizer.impl,
            flag_name(OptimizerConfig, "bucket"), f"{cfg.optimizer.bucket / 1_000_000:g}M",
            flag_name(OptimizerConfig, "slots"), str(cfg.optimizer.slots), *OptimizerConfig.MEGATRON_FLAGS]


def _tile_flags(cfg: PeakflatConfig, plan_: Plan) -> list[str]:
    """The switch, and the tile where the recommendation chose one ('auto' otherwise)."""
    out = [cfg.tile.flag("enabled")]
    return out + ([cfg.tile.flag("tokens"), str(cfg.tile.tokens)] if cfg.tile.tokens is not None else [])


_FLAG_WRITERS = {"dispatch": _dispatch_flags, "vocab": _vocab_flags, "sco": _sco_flags, "optimizer": _optimizer_flags,
                 "tile": _tile_flags}
"""The knobs the recommendation sizes, per component; a component without one is written as its switch."""


def _switch_flags(component: components.Component, cfg: PeakflatConfig) -> list[str]:
    """A component's switch as a command line writes it: the flag alone for a boolean, else with its value."""
    value = getattr(getattr(cfg, component.name), component.config_class.MODE_FIELD)
    return [component.switch] if value is True else [component.switch, str(value)]


def _flags(cfg: PeakflatConfig, plan_: Plan) -> list[str]:
    """The command line of ``cfg``: the --peakflat-* flags of each component it turns on (``components.COMPONENTS``),
    plus the Megatron flags that SCO (the full recompute the plan counts boundaries for) and 'offload-stream' need to
    pass start-up's checks."""
    out: list[str] = []
    for c in components.COMPONENTS:
        if cfg.enabled[c.name]:
            write = _FLAG_WRITERS.get(c.name)
            out += write(cfg, plan_) if write is not None else _switch_flags(c, cfg)
    return out


def layout_flags(run: RunConfig) -> list[str]:
    """The Megatron flags of the parallel layout ``run`` assumes: TP, CP, EP and PP sizes always, with
    --sequence-parallel where TP > 1 has it, and --expert-tensor-parallel-size where it differs from TP (Megatron's
    default for it). DP is what the world size leaves."""
    out = ["--tensor-model-parallel-size", str(run.tp), "--context-parallel-size", str(run.cp),
           "--expert-model-parallel-size", str(run.ep), "--pipeline-model-parallel-size", str(run.pp)]
    if run.etp != run.tp:
        out += ["--expert-tensor-parallel-size", str(run.etp)]
    if run.tp > 1 and run.sp:
        out.append("--sequence-parallel")
    return out


def _why(p: Plan, optimizer_off: str | None = None) -> list[str]:
    """Name the rows that no knob can shrink, largest first, each with its fix; ``optimizer_off``: why the
    optimizer stays on the GPU (host RAM short where None)."""
    st = p.worst("peakflat")
    run = p.run
    # EP cannot pass the expert count: where it is there already, the expert weights split by ETP (and PP) instead
    ep_can_grow = p.shape.experts > run.ep
    sharded = ("--expert-model-parallel-size or --pipeline-model-parallel-size" if ep_can_grow else
               f"--pipeline-model-parallel-size or --expert-tensor-parallel-size (EP is already the "
               f"{p.shape.experts} experts)" if p.shape.experts else
               "--pipeline-model-parallel-size or --tensor-model-parallel-size")
    fixes = {
        "parameters": f"raise {sharded}, or use more GPUs",
        "gradients": f"raise {sharded}, or use more GPUs",
        "optimizer": (f"the optimizer shard stays on the GPU because {optimizer_off}" if optimizer_off else
                      "the optimizer shard stays on the GPU because host RAM is short: raise --host-gib or DP"),
        "activations": "turn on --recompute-granularity full",
        "layer working set": "raise --context-parallel-size or --tensor-model-parallel-size",
        "model build": f"raise {sharded} (Megatron's DDP holds the parameters twice while it builds its buffers)",
        "optimizer step": "install Transformer Engine or apex (Megatron's Adam is then their FusedAdam, which "
                          "needs no temporary; the planner's --adam fused), or shard the optimizer over more ranks",
        "attention scores": te_limits.scores_cause(run),
        "sco": "the SCO budget cannot hold the boundaries: raise --host-gib or --context-parallel-size",
        "tile": "raise --context-parallel-size or --tensor-model-parallel-size (attention's backward "
                "holds this rank's sequence and heads at once)" + _te_expansion_fix(p),
        "embedding gradient": "raise --tensor-model-parallel-size, or --pipeline-model-parallel-size so that the "
                              "MTP layers and a tied output layer sit on another stage than the embedding lookup",
        "dispatch": (f"raise {'--expert-model-parallel-size' if ep_can_grow else '--context-parallel-size'}"
                     " (a smaller --peakflat-dispatch-chunk-cap lowers only the MoE phase)"),
        "vocab": "raise --tensor-model-parallel-size or --context-parallel-size (a smaller --peakflat-vocab-block-size "
                 "lowers only the loss phase)",
    }
    out = [f"the {st.stage} stage needs {format_bytes(st.total('peakflat', guaranteed=True))} per GPU with every "
           "knob at its floor (bounded peaks at their bounds), "
           f"HBM is {format_bytes(run.hbm_bytes)}"]
    rows = sorted((r for r in st.rows.values() if r.name != "reserve"), key=lambda r: -r.peakflat)
    for r in rows[:3]:
        if r.peakflat > 0:
            out.append(f"{components.term_label(r.name)}: {format_bytes(r.peakflat)}; fix: {fixes.get(r.name, '')}")
    host = max(s.host("peakflat") for s in p.stages)
    if host > run.host_bytes_per_rank:
        out.append(f"host: {format_bytes(host)} per rank needed, {format_bytes(run.host_bytes_per_rank)} available "
                   "(90% of --host-gib over the local ranks)")
    return out


def _te_expansion_fix(p: Plan) -> str:
    """The tile row's other fix where cuDNN's backward expands dK and dV to more query heads at once
    (``model.te_gqa_expansion``) than flash's would under the local spec's SDPA attention, which runs one call per
    K/V head at long lengths (``model.flash_gqa_expansion``): Transformer Engine's own untiled attention. The tiled
    sublayer splits TE's calls the same way (``model.te_tile_calls``), so there the local spec saves nothing."""
    from .model import flash_gqa_expansion, te_gqa_expansion, tile_tokens, tiles_attention

    tiled = tiles_attention(p.shape, p.run, p.peakflat)
    expanded = te_gqa_expansion(p.shape, p.run, tile_tokens(p.run, p.peakflat) if tiled else None)
    local = flash_gqa_expansion(p.shape, dataclasses.replace(p.run, transformer_impl="local"))
    if expanded <= local:
        return ""
    return (f"; or run Megatron's local spec (--transformer-impl local --peakflat-attention sdpa): on Transformer "
            f"Engine's layers cuDNN's attention backward holds dK and dV at every query head over the whole "
            f"sequence ({format_bytes(expanded)} here), where the SDPA attention runs one call per K/V head "
            f"({format_bytes(local)})")


def _guaranteed(r: Row) -> float:
    """A row's bytes whatever the routing: its bound when that is larger."""
    return max(r.peakflat, r.bound or 0.0)



def startup_namespace(shape: ModelShape, run: RunConfig, megatron_args: Any = None) -> argparse.Namespace:
    """The Megatron flags that peakflat's start-up checks read, for this run: Megatron's defaults where a
    command line leaves them out (``MEGATRON_DEFAULTS``), the flags given, and the model's and run's sizes, layout
    and precision (a preset's bf16 is the run's, whether or not the flags beside it say --bf16)."""
    given = dict(vars(megatron_args)) if megatron_args is not None else {}
    ns = {**(MEGATRON_DEFAULTS if megatron_args is not None and is_command_line(megatron_args) else {}), **given}
    ns.update(num_experts=shape.experts or None, expert_model_parallel_size=run.ep,
              expert_tensor_parallel_size=run.etp, mtp_num_layers=shape.mtp_layers or None,
              recompute_granularity=None if run.recompute == "none" else run.recompute,
              tensor_model_parallel_size=run.tp, context_parallel_size=run.cp,
              pipeline_model_parallel_size=run.pp, seq_length=run.seq_len,
              bf16=run.precision == "bf16", fp16=run.precision == "fp16")
    return argparse.Namespace(**ns)


def blockers(shape: ModelShape, run: RunConfig, megatron_args: Any = None) -> dict[str, str]:
    """Why each of PipelinedLLEP, Ring-DTP, SCO, the tiled sublayer and OffloadStreamAdamW cannot run here
    ('dispatch', 'vocab', 'sco', 'tile', 'optimizer'): the refusal
    that its own start-up check (``PeakflatConfig.validate``) gives on ``startup_namespace``, so that the
    plan never turns on, nor a recommendation names, a component that start-up would refuse. Without
    ``megatron_args`` (a preset) only the model and run decide."""
    ns = startup_namespace(shape, run, megatron_args)
    # Megatron's own offloaded optimizer is no component's blocker: where the line asks for it, the recommendation
    # puts OffloadStreamAdamW in its place, and otherwise start-up judges it whatever the components
    ns.optimizer_cpu_offload = False
    alone = {"dispatch": PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep")),
             "vocab": PeakflatConfig(vocab=VocabConfig(impl="ring-dtp")),
             "sco": PeakflatConfig(sco=SCOConfig(enabled=True)),
             "tile": PeakflatConfig(tile=TileConfig(enabled=True))}
    out: dict[str, str] = {}
    for name, cfg in alone.items():
        e = _startup_refusal(cfg, ns)
        if e is not None:
            out[name] = f"{e.problem} (fix: {e.fix})"
    # OffloadStreamAdamW with the Megatron flags a recommendation adds beside it (OptimizerConfig.MEGATRON_FLAGS,
    # and fp32 gradients under --fp16): what is left is the line's own (another optimizer, other state dtypes)
    adds = {f.lstrip("-").replace("-", "_"): True
            for f in (*OptimizerConfig.MEGATRON_FLAGS, *OptimizerConfig.MEGATRON_FLAGS_WHERE_NEEDED)}
    e = _startup_refusal(PeakflatConfig(optimizer=OptimizerConfig(impl="offload-stream")),
                         argparse.Namespace(**{**vars(ns), **adds}))
    if e is not None:
        out["optimizer"] = f"{e.problem} (fix: {e.fix})"
    return out


def _startup_refusal(cfg: PeakflatConfig, ns: argparse.Namespace) -> PeakflatConfigError | None:
    """What start-up (``PeakflatConfig.validate`` and Megatron's compatibility checks) says of ``cfg`` on ``ns``."""
    try:
        cfg.validate(ns)
        compat.check_args(cfg, ns)
    except PeakflatConfigError as e:
        return e
    return None


def recommend(shape: ModelShape, run: RunConfig, base: PeakflatConfig | None = None,
              megatron_args: Any = None, *, replace_offload: bool = True) -> Recommendation:
    """``_recommend``'s knobs, plus the Megatron flags without which the line would not start, would crash or would
    not be the run planned: full recompute where the plan counts it (SCO's flags carry it where SCO is on),
    ``--no-rope-fusion`` past Transformer Engine's fused RoPE limit (``te_limits``), and
    ``--no-create-attention-mask-in-dataloader`` where start-up would warn of, or refuse, the dataloader's mask.
    The line's position embedding and layers decide; a preset (no command line) is taken as a RoPE model. Both
    flags are recommended whether or not the line already holds them, so that a recommended line planned again
    gives the same recommendation (``--peakflat auto`` keeps what the line holds)."""
    preset = megatron_args is None or not is_command_line(megatron_args)
    rec = _recommend(shape, run, base, megatron_args, replace_offload=replace_offload,
                     norms=_norms_need_tile(shape, run, megatron_args, preset))
    ns = argparse.Namespace(**vars(megatron_args)) if megatron_args is not None else argparse.Namespace()
    ns.apply_rope_fusion = True  # Megatron's default: would the line need the flag
    # the tiled sublayer applies RoPE per tile: the kernel sees the recommended tile, not the sequence
    ns.peakflat_tile_enabled, ns.peakflat_tile_tokens = rec.config.tile.enabled, rec.config.tile.tokens
    rope = te_limits.rope_line_refusal(shape, run, ns, preset=preset)
    if rope is not None:
        rec.flags.append(te_limits.NO_ROPE_FUSION)
        rec.reasons.append(f"{te_limits.NO_ROPE_FUSION}: {rope.problem}")
    if run.recompute == "full" and "--recompute-granularity" not in rec.flags:
        # SCO's flags carry these; without SCO the plan still counts full recompute, which Megatron runs only so
        rec.flags += ["--recompute-granularity", "full", "--recompute-method", run.recompute_method,
                      "--recompute-num-layers", str(run.recompute_num_layers)]
        if getattr(megatron_args, "recompute_granularity", None) != "full":
            rec.reasons.append("--recompute-granularity full: the plan counts full recompute, and without it "
                               "Megatron keeps every layer's activations")
    if preset:
        rec.reasons += _preset_prerequisites(shape, run, rec)
    elif getattr(megatron_args, "seq_length", None) not in (None, run.seq_len):  # the planner's --seq-len over it
        # in the line's own flag: Megatron refuses --seq-length beside --encoder-seq-length
        length = "--encoder-seq-length" if getattr(megatron_args, "encoder_seq_length", None) else "--seq-length"
        rec.flags += [length, str(run.seq_len)]
        if (getattr(megatron_args, "max_position_embeddings", None) or run.seq_len) < run.seq_len:
            rec.flags += ["--max-position-embeddings", str(run.seq_len)]
        rec.reasons.append(f"{length} {run.seq_len}: the length planned (--seq-len), in place of the line's "
                           f"{megatron_args.seq_length}")
    if dataloader_mask.mask_bytes(run.seq_len, run.micro_batch) >= dataloader_mask.MASK_WARN_BYTES:
        rec.flags.append(dataloader_mask.NO_MASK_FLAG)
        rec.reasons.append(f"{dataloader_mask.NO_MASK_FLAG}: Megatron's dataloader would build a "
                           f"[{run.micro_batch}, 1, {run.seq_len}, {run.seq_len}] mask per micro-batch "
                           "(start-up warns from 256 MiB and refuses from 4 GiB); a causal model needs none")
    return rec


def _preset_prerequisites(shape: ModelShape, run: RunConfig, rec: Recommendation) -> list[str]:
    """For a preset, whose model has no linear biases, no dropout and the alltoall dispatcher: what a Megatron line
    at its own defaults (``MEGATRON_DEFAULTS``: biases, dropout 0.1, the allgather dispatcher) must also pass for
    each recommended component to start, so that the flags to add are not refused on the user's own line. Each
    default is tried on its own, so that every one a component refuses is named, not the first."""
    base = startup_namespace(shape, run, None)
    base.optimizer_cpu_offload = False
    needs: dict[str, list[str]] = {}
    if rec.config.enabled["dispatch"]:
        for dest, default in MEGATRON_DEFAULTS.items():
            ns = argparse.Namespace(**{**vars(base), dest: default})
            refusal = _startup_refusal(PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep")), ns)
            if refusal is not None and refusal.fix not in needs.setdefault("dispatch", []):
                needs["dispatch"].append(refusal.fix)
    if rec.config.enabled["tile"]:  # the dataloader's mask is among the flags to add already
        # a preset's namespace leaves dropout and the mask out: tile_prerequisites takes Megatron's defaults for them
        flags = [f for f in te_limits.tile_prerequisites(base) if not f.startswith("--no-create-attention-mask")]
        if flags:
            needs["tile"] = [f"add {' '.join(flags)}"]
    return [f"{components.get(name).label} on your own line: the preset's model has no linear biases, no dropout "
            f"and the alltoall dispatcher; with Megatron's defaults for them, {'; '.join(fixes)}"
            for name, fixes in needs.items() if fixes]


def _norms_need_tile(shape: ModelShape, run: RunConfig, megatron_args: Any, preset: bool) -> str | None:
    """Why the tiled sublayer must run, where Transformer Engine's whole-sequence norms (pre-MLP, final, MTP) pass
    their kernels' 32-bit limit with it off (``te_limits.norm_refusal``): with it on they run in row slices."""
    ns = argparse.Namespace(**vars(megatron_args)) if megatron_args is not None else argparse.Namespace()
    ns.peakflat_tile_enabled = False
    refusal = te_limits.norm_refusal(shape, run, ns, preset=preset)
    if refusal is None or refusal.flag != "--seq-length":  # the query norm's own limit: not lifted by slicing
        return None
    return (f"{components.get('tile').label} on: it runs the pre-MLP, final and MTP norms in row slices, where "
            f"{refusal.problem}")


def _recommend(shape: ModelShape, run: RunConfig, base: PeakflatConfig | None = None,
               megatron_args: Any = None, *, replace_offload: bool = True, norms: str | None = None) -> Recommendation:
    """Knobs that make the worst stage fit ``run.hbm_bytes`` and the host share, with the fewest host components.

    Dispatch and vocabulary run whenever they apply. SCO and OffloadStreamAdamW move bytes over PCIe at
    every step (the optimizer streams its fp32 state through the GPU: 1.3 s of a 2.4 s step for 5.1B
    parameters on one H200, ``bench/results/pretrain_components_16k.json``), so each is left off when the run fits
    without it at knobs no smaller than with every component on; the reasons say which were left off.

    Where ``megatron_args`` asks for Megatron's own offloaded optimizer (``--optimizer-cpu-offload``), the
    optimizer state stays in host memory as asked, and with ``replace_offload`` OffloadStreamAdamW takes the
    place of Megatron's serial step (the same state, stepped as a bucketed pipeline); ``advise`` passes False
    to ask whether the run would fit with no offload at all.
    """
    blocked = blockers(shape, run, megatron_args)
    need_tile = norms is not None and "tile" not in blocked
    full = _fit(shape, run, base, blocked, optimizer=True, sco=True, tile=need_tile)
    if need_tile:
        full.reasons.insert(0, norms)
    if not full.fits and need_tile:
        return full
    if not full.fits:  # the tiled sublayer costs an attention forward per layer: only where nothing fits without
        if "tile" in blocked:
            full.reasons.append(f"{components.get('tile').label} (--peakflat-tile) would bound the attention "
                                f"working set, but start-up refuses it here: {blocked['tile']}")
            return full
        full = _fit(shape, run, base, blocked, optimizer=True, sco=True, tile=True)
        if not full.fits:
            return full
    options: tuple[tuple[bool, bool], ...] = ((False, False), (False, True), (True, False))
    replaced = replace_offload and bool(getattr(megatron_args, "optimizer_cpu_offload", None))
    if replaced:
        options = ((True, False),)
    tile = full.config.tile.enabled
    for optimizer, sco in options:
        rec = _fit(shape, run, base, blocked, optimizer=optimizer, sco=sco, tile=tile)
        if rec.fits and all(a >= b for a, b in zip(_knobs(rec.config, shape.topk), _knobs(full.config, shape.topk))):
            if not optimizer and full.config.optimizer.impl != "megatron":
                rec.reasons.append("optimizer offload left off: the run fits with Megatron's optimizer on the GPU "
                                   "(no --peakflat-optimizer offload-stream, no --optimizer-cpu-offload)")
            if not sco and full.config.sco.enabled:
                rec.reasons.append("SCO (--peakflat-sco) left off: the run fits without it")
            if need_tile:
                rec.reasons.insert(0, norms)
            return _note_replaced(rec, replaced)
    return _note_replaced(full, replaced)


def _note_replaced(rec: Recommendation, replaced: bool) -> Recommendation:
    if replaced and rec.config.optimizer.impl != "megatron":
        rec.reasons.append(OFFLOAD_REPLACED)
    return rec


OFFLOAD_REPLACED = ("OffloadStreamAdamW in place of Megatron's offloaded optimizer: --optimizer-cpu-offload asks for "
                    "the optimizer state in host memory, and it steps that state as a bucketed pipeline")


def _knobs(cfg: PeakflatConfig, topk: int) -> tuple[int, int, int]:
    """The knobs that cost time as they shrink (dispatch chunk cap, vocabulary block, attention tile; 0 or None:
    automatic, largest)."""
    return (cfg.dispatch.cap(topk), cfg.vocab.block_size or 1 << 62, cfg.tile.tokens or 1 << 62)


def _fit(shape: ModelShape, run: RunConfig, base: PeakflatConfig | None, blocked: dict[str, str], *,
         optimizer: bool, sco: bool, tile: bool = False) -> Recommendation:
    """Component defaults (``optimizer``: offload-stream, ``sco``: on under full recompute), then the largest
    shrinkable row of the binding stage halved until the total fits whatever the routing, or all are at floor.
    A component in ``blocked`` stays off."""
    base = base or PeakflatConfig()
    disp = dataclasses.replace(base.dispatch, impl="megatron" if "dispatch" in blocked else "pipelined-llep",
                               chunk_cap=STARTS["chunk_cap"], max_chunks=DispatchConfig().max_chunks)
    voc = dataclasses.replace(base.vocab, impl="megatron" if "vocab" in blocked else "ring-dtp",
                              block_size=STARTS["block_size"])
    asked_offload, optimizer = optimizer, optimizer and "optimizer" not in blocked
    opt = dataclasses.replace(base.optimizer, impl="offload-stream" if optimizer else "megatron",
                              bucket=STARTS["bucket"], slots=3)
    sco_cfg = dataclasses.replace(base.sco, enabled=sco and "sco" not in blocked, budget=None)
    tile_cfg = dataclasses.replace(base.tile, enabled=tile and "tile" not in blocked)
    cfg = PeakflatConfig(dispatch=disp, vocab=voc, sco=sco_cfg, optimizer=opt, tile=tile_cfg, general=base.general)
    asked = run
    extra: list[str] = []
    if optimizer:  # its flags (OptimizerConfig.MEGATRON_FLAGS) make Megatron's optimizer the distributed one
        run = dataclasses.replace(run, distributed_optimizer=True)
        if fp16_grads_clipped(run.precision == "fp16", bool(run.grads_fp32), run.clip_grad):
            run = dataclasses.replace(run, grads_fp32=True)
            extra = [FP32_GRADS_FLAG]

    probe = plan(shape, run, cfg)
    opt_host = max(s.rows["optimizer"].host_peakflat for s in probe.stages) if optimizer else 0.0
    reasons: list[str] = []
    # Without experts there is nothing to dispatch, and without full recompute SCO has nothing to keep: no news.
    for name, why in blocked.items():
        if (name == "dispatch" and not shape.experts) or (name == "sco" and (not sco or run.recompute != "full")) \
                or (name == "tile" and not tile) or (name == "optimizer" and not asked_offload):
            continue
        reasons.append(f"{components.get(name).label} left off: {why}")
    if opt_host > run.host_bytes_per_rank:
        cfg.optimizer = dataclasses.replace(cfg.optimizer, impl="megatron")
        reasons.append(f"optimizer offload needs {format_bytes(opt_host)} host per rank, more than the "
                       f"{format_bytes(run.host_bytes_per_rank)} available: the optimizer stays on the GPU")
        opt_host = 0.0
    if cfg.optimizer.impl == "megatron":  # on the GPU: not Megatron's own CPU offload either
        run = dataclasses.replace(asked, optimizer_offload_fraction=0.0)
        extra = []
    elif extra:
        reasons.append(f"{FP32_GRADS_FLAG}: under --fp16 Megatron keeps fp16 gradients, which its gradient clipping "
                       "refuses from an offloaded optimizer; planned with fp32 gradients")
    if cfg.sco.enabled:
        need = max(s.rows["sco"].baseline for s in probe.stages)
        avail = max(0.0, run.host_bytes_per_rank - opt_host)
        whole_gib = min(-(-need // GIB), avail // GIB)
        cfg.sco = dataclasses.replace(cfg.sco, budget=int(whole_gib) * GIB)

    for _ in range(64):
        p = plan(shape, run, cfg)
        if p.fits("peakflat", guaranteed=True):
            return Recommendation(True, cfg, p, _flags(cfg, p) + extra, reasons, layout_flags(p.run))
        st = max(p.stages, key=lambda x: x.total("peakflat", guaranteed=True))
        live = st.live_phases("peakflat", guaranteed=True)
        candidates = []
        if "dispatch" in st.rows and cfg.dispatch.impl != "megatron" \
                and cfg.dispatch.cap(shape.topk) > FLOORS["chunk_cap"] \
                and st.rows["dispatch"].phase in live:
            candidates.append((_guaranteed(st.rows["dispatch"]), "chunk_cap"))
        block = cfg.vocab.block_size or vocab_block(run.tp_tokens, run.w, 0)
        if "vocab" in st.rows and block > FLOORS["block_size"] and "loss" in live:
            candidates.append((_guaranteed(st.rows["vocab"]), "block_size"))
        if cfg.optimizer.impl != "megatron" and (cfg.optimizer.bucket > FLOORS["bucket"] or cfg.optimizer.slots > 2):
            candidates.append((_guaranteed(st.rows["optimizer"]), "bucket"))
        if cfg.tile.enabled and tile_tokens(run, cfg) > FLOORS["tile_tokens"] and "attention" in live:
            candidates.append((_guaranteed(st.rows["tile"]), "tile_tokens"))
        if not candidates:
            break
        _, knob = max(candidates)
        if knob == "chunk_cap":
            cap = max(FLOORS["chunk_cap"], cfg.dispatch.cap(shape.topk) // 2)
            cfg.dispatch = dataclasses.replace(cfg.dispatch, chunk_cap=cap,
                                               max_chunks=max(cfg.dispatch.max_chunks, _chunks_needed(shape, run, cap)))
        elif knob == "tile_tokens":
            cfg.tile = dataclasses.replace(cfg.tile, tokens=max(FLOORS["tile_tokens"], tile_tokens(run, cfg) // 2))
        elif knob == "block_size":
            cfg.vocab = dataclasses.replace(cfg.vocab, block_size=max(FLOORS["block_size"], block // 2))
        elif cfg.optimizer.bucket > FLOORS["bucket"]:
            cfg.optimizer = dataclasses.replace(cfg.optimizer, bucket=max(FLOORS["bucket"], cfg.optimizer.bucket // 2))
        else:
            cfg.optimizer = dataclasses.replace(cfg.optimizer, slots=2)
    p = plan(shape, run, cfg)
    off = f"start-up refuses OffloadStreamAdamW here: {blocked['optimizer']}" if "optimizer" in blocked else None
    return Recommendation(False, cfg, p, _flags(cfg, p) + extra, reasons + _why(p, off), layout_flags(p.run))
