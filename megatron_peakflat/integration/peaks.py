"""Runtime peak report (``--peakflat-report-peaks``): measured peak of each component beside the planner's.

``megatron_peakflat.apply(args)`` calls ``setup(args)``, which turns ``runtime.meter`` on when
``--peakflat-report-peaks`` is given; the registry's 'report' entry wraps Megatron's ``training_log``
(``wrap_training_log``) so that every log interval calls::

    report(iteration, args, writer=tb_writer, wandb_writer=wandb_writer)

Components measure their region with ``runtime.meter.component_region(name)``, ``name`` one of their
``components.Component.meters`` or ``meter_aliases`` (each component's name, its planner row's: ``dispatch``,
``vocab``, ``sco``, ``optimizer``, ``tile``; SCO takes ``boundaries`` and ``recompute`` too, the tile
``attention backward``, their rows' former names). The
prediction per component is the planner's peakflat row when the component is on and its baseline
row when it is off, for this rank's pipeline stage, from Megatron's parsed args.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .. import components
from ..runtime import machine, meter
from ..planner.model import GIB, Plan, RunConfig, plan
from .. import stats
from .logs import PER_RANK

__all__ = ["setup", "report", "prediction", "advise", "allocated_prediction", "check_transformer_engine",
           "check_against_plan", "GUARD_MARGIN", "GUARD_FROM_ITERATION"]

log = logging.getLogger("megatron_peakflat")

_cache: dict[str, Any] = {}


def report_name(meter_name: str) -> str:
    """The name a region measured as ``meter_name`` is reported under: its component's planner row
    (``components.Component.meters``; ``boundaries`` and ``recompute`` report as ``sco``, ``attention backward`` as
    ``tile``); other names as they are."""
    return components.meter_names().get(meter_name, meter_name)


def _config(args: Any) -> Any:
    """The applied PeakflatConfig, else one read (unchecked) from ``args``."""
    from . import state

    cfg = state.get()
    if cfg is None:
        from ..config import PeakflatConfig

        cfg = PeakflatConfig.from_args(args, validate=False)
    return cfg


def setup(args: Any) -> bool:
    """Turn the per-component meter on when ``--peakflat-report-peaks`` is given; returns whether it is."""
    on = bool(_config(args).general.report_peaks)
    meter.enable(on)
    _cache.clear()
    _guard["warned"] = False
    meter.reset()
    if on:
        log.info("peakflat: reporting each component's measured peak beside the planner's every log interval")
    return on


def _device() -> Any:
    """This GPU's properties, or None without one."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device())
    except Exception:  # noqa: BLE001
        pass
    return None


def _hbm_bytes() -> int:
    """This GPU's memory; 80 GiB when there is none (the planner's default)."""
    dev = _device()
    return int(dev.total_memory) if dev is not None else 80 * GIB


def _sm_count() -> int:
    """This GPU's streaming multiprocessors; the planner's default (an H100's or H200's 132) without one."""
    dev = _device()
    return int(dev.multi_processor_count) if dev is not None else RunConfig.sm_count


def prediction(args: Any) -> tuple[Plan, str]:
    """The planner's plan for this run (cached) and this rank's stage name ('only', 'first', 'last', or the
    'middle N' stage the plan holds)."""
    if "plan" not in _cache:
        from ..planner.megatron_args import run_fields_from_namespace, shape_from_namespace

        shape = _shape(args, shape_from_namespace)
        fields = run_fields_from_namespace(args)
        fields.setdefault("seq_len", getattr(args, "seq_length", 4096))
        tp, pp, cp = fields.get("tp", 1), fields.get("pp", 1), fields.get("cp", 1)
        world = getattr(args, "world_size", None) or tp * pp * cp
        fields["dp"] = getattr(args, "data_parallel_size", None) or max(1, world // (tp * pp * cp))
        fields["hbm_bytes"] = _hbm_bytes()
        fields["host_bytes_per_node"] = machine.mem_total() or 1024 * GIB
        fields["gpus_per_node"] = machine.local_world_size(default=8)
        fields["fused_adam"] = _megatron_fused_adam()
        fields["sm_count"] = _sm_count()
        from ..planner.te_limits import te_run_fields

        fields.update(te_run_fields(shape, args, precision=fields.get("precision", "bf16"), cp=cp))
        run = RunConfig(**fields)
        _cache["plan"] = plan(shape, run, _as_run(_config(args)))
        _cache["stage"] = _stage_name(_cache["plan"])
    return _cache["plan"], _cache["stage"]


def _shape(args: Any, shape_from_namespace: Any) -> Any:
    """The model's shape from Megatron's args. Before Megatron has built its tokenizer (start-up, where
    ``padded_vocab_size`` is still unset) a tokenizer whose files this process cannot read leaves the vocabulary
    unknown: the plan then takes --vocab-size, else GPT-2's, and says so, rather than stopping a run that
    Megatron itself can start."""
    from ..config_base import PeakflatConfigError

    try:
        return shape_from_namespace(args)
    except PeakflatConfigError as e:
        if e.flag != "--tokenizer-type":
            raise
        log.warning("peakflat: the peak report's plan cannot read the tokenizer's vocabulary here (%s); it plans "
                    "--vocab-size, else GPT-2's vocabulary. Fix: pass --vocab-size with the tokenizer's", e.problem)
        return shape_from_namespace(argparse.Namespace(**{**vars(args), "tokenizer_type": None, "vocab_file": None}))


def _as_run(cfg: Any) -> Any:
    """The config with ``--peakflat-attention auto`` as it resolved in this process: 'sdpa' where the SDPA core
    attention is patched in (no Transformer Engine), so that the plan counts its gathered K/V under CP."""
    import dataclasses

    from .registry import applied

    if cfg.general.attention == "auto" and any("core_attention" in sym for sym in applied()):
        return dataclasses.replace(cfg, general=dataclasses.replace(cfg.general, attention="sdpa"))
    return cfg


def _megatron_fused_adam() -> bool:
    """Whether Megatron's optimizer module found TE's or apex's FusedAdam (else it uses torch.optim.AdamW)."""
    try:
        from megatron.core import optimizer as mcore_optimizer
    except ImportError:
        return False
    return not getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", True)


_HOST_FLAGS = {"optimizer": "--peakflat-optimizer offload-stream (and --optimizer-cpu-offload)", "sco": "--peakflat-sco"}


def advise(args: Any) -> str | None:
    """A start-up line when the run turns on a host component (SCO, the offloaded optimizer) that the planner
    says it fits without: both move bytes over PCIe at every step. None when there is nothing to say, or when
    the planner cannot read the run (it only advises; the run goes on as configured)."""
    from ..planner.recommend import recommend

    cfg = _config(args)
    on = [name for name in _HOST_FLAGS if cfg.enabled[name]]
    if not on:
        return None
    try:
        pl, _ = prediction(args)
        rec = recommend(pl.shape, pl.run, cfg, args, replace_offload=False)
    except Exception as e:  # noqa: BLE001
        log.debug("peakflat plan: no start-up advice (%s: %s)", type(e).__name__, e)
        return None
    left = [name for name in on if not rec.config.enabled[name]]
    if not rec.fits or not left:
        return None
    need = max(st.total("peakflat", guaranteed=True) for st in rec.plan.stages)
    return (f"peakflat plan: this run is predicted to fit without {' and '.join(_HOST_FLAGS[n] for n in left)} "
            f"({need / GIB:.1f} GiB per GPU whatever the routing, with the planner's reserve, of "
            f"{pl.run.hbm_bytes / GIB:.0f} GiB). They move bytes over PCIe at every step (the offloaded optimizer "
            "took 1.3 s of a 2.4 s step for 5.1B parameters on one H200); python -m megatron_peakflat.plan "
            "--megatron-args '<these flags>' shows the figures")


OPTIMIZER_HOST_MARGIN = 1.10
"""The planner's optimizer host term has matched the optimizer's own figure to 0.5%; past this factor of
this rank's share a start-up check refuses rather than warns."""


def check_optimizer_host(args: Any) -> str | None:
    """Before the model is built: the planner's pinned host bytes for OffloadStreamAdamW on this rank's stage
    against this rank's share of the host's available memory (``runtime.host.share``).

    The optimizer checks the exact figure itself when it first allocates, after the model is built and a
    step has run; this check moves a clear miss to start-up. Raises PeakflatConfigError when the prediction
    exceeds the share by more than ``OPTIMIZER_HOST_MARGIN``; returns a warning line when it exceeds it by
    less; None when it fits, when the optimizer is off, or when the planner or /proc/meminfo cannot say."""
    from ..config import PeakflatConfigError
    from ..runtime import host

    cfg = _config(args)
    if not cfg.enabled["optimizer"]:
        return None
    try:
        pl, stage = prediction(args)
    except Exception as e:  # noqa: BLE001
        log.debug("peakflat plan: no start-up host check (%s: %s)", type(e).__name__, e)
        return None
    mine = [st for st in pl.stages if st.stage == stage] or pl.stages
    need = max(st.rows["optimizer"].host_peakflat for st in mine)
    share = host.share()
    if share is None or need <= share:
        return None
    ranks = host.local_ranks()
    from ..config_base import format_bytes

    problem = (f"OffloadStreamAdamW is predicted to pin {format_bytes(need)} of host memory on this rank (fp32 "
               f"master weights and Adam moments of its optimizer shard), and this rank's share of the host's available "
               f"memory is {format_bytes(share)} (MemAvailable / LOCAL_WORLD_SIZE={ranks}): short by "
               f"{format_bytes(need - share)}")
    fix = ("shard the state over more data-parallel ranks, run fewer ranks per node, or keep the optimizer on the GPU "
           "(drop --peakflat-optimizer and --optimizer-cpu-offload)")
    if need > share * OPTIMIZER_HOST_MARGIN:
        raise PeakflatConfigError(cfg.optimizer.flag("impl"), cfg.optimizer.impl, problem, fix)
    return f"peakflat plan: {problem}; the optimizer will refuse at its first step if it does not fit. Fix: {fix}"


def check_transformer_engine(args: Any) -> None:
    """Before the model is built: refuse what Transformer Engine would fail on or run out of memory in
    (``planner.te_limits``): a kernel past its length limit (fused RoPE, the norms, the fused router and
    permutation: ``line_refusal``), and its unfused attention backend, or cuDNN's deterministic backward, where the
    plan with its s x s scores or workspace does not fit this GPU. A plan that cannot be made says nothing."""
    from ..planner.te_limits import line_refusal, scores_refusal

    try:
        pl, _ = prediction(args)
    except Exception as e:  # noqa: BLE001
        log.debug("peakflat plan: no Transformer Engine check (%s: %s)", type(e).__name__, e)
        return
    refusal = line_refusal(pl.shape, pl.run, args)
    if refusal is not None:
        raise refusal
    which = "peakflat" if any(_config(args).enabled.values()) else "baseline"
    scores = [st.rows["attention scores"].peakflat for st in pl.stages if "attention scores" in st.rows]
    if scores and not pl.fits(which, guaranteed=True):  # type: ignore[arg-type]
        raise scores_refusal(pl.run, max(scores))


GUARD_MARGIN = 1.05
"""The measured peak may exceed the plan by this factor before the runtime guard warns."""
GUARD_FROM_ITERATION = 2
"""The guard compares from this iteration on: the first holds the model build and the allocator's warm-up."""
MEANINGFUL_SHARE = 0.1
"""A measured term is named as the cause where its own excess is at least this share of the whole excess."""
_guard: dict[str, bool] = {"warned": False}


def check_against_plan(iteration: int, measured: float, pl: Plan, stage: Any, which: str,
                       terms: dict[str, float] | None = None) -> str | None:
    """After the second iteration: the warning, once per process, where the measured peak (``measured``: bytes,
    torch.cuda.max_memory_allocated) is more than ``GUARD_MARGIN`` over the plan's (``allocated_prediction``),
    naming the term whose measurement (``terms``: bytes by planner row) exceeds its row the most where that is a
    tenth of the excess or more (``MEANINGFUL_SHARE``), else the largest term not measured on its own. The plan's
    figure is the stage's peak, the model build's included, less its reserve. None otherwise (and on every call after the warning)."""
    if _guard["warned"] or iteration < GUARD_FROM_ITERATION:
        return None
    reserve = stage.rows.get("reserve")
    # a lifetime peak: the model build's counts too, less the reserve that allocated bytes never show
    planned = stage.total(which) - (getattr(reserve, which) if reserve is not None else 0.0)
    if measured <= planned * GUARD_MARGIN:
        return None
    rows = {n: r for n, r in stage.rows.items() if n != "reserve"}
    measured_rows = {n: v for n, v in (terms or {}).items() if n in rows}
    over = {n: v - getattr(rows[n], which) for n, v in measured_rows.items()}
    over = {n: d for n, d in over.items() if d > 0 and d >= MEANINGFUL_SHARE * (measured - planned)}
    if over:
        name = max(over, key=over.__getitem__)
        term = (f"the term that differs most is '{name}': measured {over[name] / GIB + getattr(rows[name], which) / GIB:.2f}"
                f" GiB, planned {getattr(rows[name], which) / GIB:.2f}")
    else:
        rest = {n: r for n, r in rows.items() if n not in measured_rows} or rows
        name = max(rest, key=lambda n: getattr(rest[n], which))
        largest = f"'{name}' ({getattr(rest[name], which) / GIB:.2f} GiB)"
        term = (f"the terms measured on their own ({', '.join(sorted(measured_rows))}) are within their plan, so the "
                f"difference is in the others, whose largest is {largest}" if measured_rows else
                f"no term was measured on its own; the plan's largest is {largest}")
    _guard["warned"] = True
    return (f"peakflat plan: at iteration {iteration} the measured peak (max allocated) is {measured / GIB:.2f} GiB, "
            f"{measured / planned - 1:.0%} over the plan's {planned / GIB:.2f} GiB ({stage.stage} stage); {term}. "
            "The run's memory is not what was planned: check that term's flags before raising the length")


def allocated_prediction(pl: Plan, which: str, stage: Any = None) -> float:
    """The planner's figure for a measured max-allocated peak: the steps' peak (training or optimizer step) of
    ``stage`` (default: the plan's worst for ``which``) less the reserve it keeps for the CUDA context and
    allocator fragmentation, which allocated bytes never show. The first interval's measurement also spans the
    model build, which the steps' peak leaves out."""
    st = stage if stage is not None else pl.worst(which)  # type: ignore[arg-type]
    reserve = st.rows.get("reserve")
    return st.total(which, build=False) - (getattr(reserve, which) if reserve is not None else 0.0)


def _stage_name(pl: Plan) -> str:
    """This rank's stage among those the plan holds: its own, or the planned one that bounds it (``Plan.stage_of``)."""
    if pl.run.pp == 1:
        return "only"
    try:
        from megatron.core import parallel_state

        rank = parallel_state.get_pipeline_model_parallel_rank()
    except Exception:  # noqa: BLE001
        return "last"
    return pl.stage_of[rank]


def _note(component: str) -> str:
    """Why a measured peak may sit far below the prediction, when this process knows: the planner counts
    the optimizer's GPU staging slots, which ``engine=auto`` leaves unused when it sends every bucket to
    the host kernel."""
    opt = stats.snapshot().get("optimizer", {})
    if component == "optimizer" and opt.get("gpu_buckets") == 0 and opt.get("cpu_buckets", 0) > 0:
        return " (GPU staging unused: every bucket ran on the host)"
    return ""


def report(iteration: int, args: Any, writer: Any = None, wandb_writer: Any = None) -> dict[str, dict[str, float]] | None:
    """Log measured vs predicted GiB per component, write them to tensorboard/wandb, start a new interval.

    Returns ``{component: {"measured_gib", "predicted_gib"}}`` (plus ``total``), or None when the report is off.
    """
    if not meter.enabled():
        return None
    pl, stage_name = prediction(args)
    st = next((s for s in pl.stages if s.stage == stage_name), pl.stages[-1])
    cfg = _config(args)
    on = cfg.enabled
    out: dict[str, dict[str, float]] = {}
    for name, peak in meter.measured().items():
        comp = report_name(name)
        row = st.rows.get(comp)
        predicted = row.peakflat if row is not None else None  # baseline for components that are off
        out[comp] = {"measured_gib": peak.delta / GIB, "predicted_gib": (predicted or 0.0) / GIB,
                     "absolute_gib": peak.absolute / GIB, "calls": float(peak.calls)}
    which = "peakflat" if any(on.values()) else "baseline"
    allocated = allocated_prediction(pl, which, st)
    out["total"] = {"measured_gib": meter.process_peak() / GIB, "predicted_gib": allocated / GIB}
    parts = [f"{k} {v['measured_gib']:.2f}/{v['predicted_gib']:.2f}{_note(k)}" for k, v in out.items()]
    import torch.distributed as dist

    # rank 0's figures, said to be rank 0's; the other ranks' come back with --peakflat-log-all-ranks
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    log.info("peakflat peaks iter %d (%s stage), GiB measured/predicted: %s", iteration, st.stage, ", ".join(parts),
             extra=PER_RANK if rank0 else None)
    for k, v in out.items():
        stats.record("peaks", f"{k}_measured_gib", v["measured_gib"])
        stats.record("peaks", f"{k}_predicted_gib", v["predicted_gib"])
        if writer is not None:
            writer.add_scalar(f"peakflat/peak_{k}_measured_gib", v["measured_gib"], iteration)
            writer.add_scalar(f"peakflat/peak_{k}_predicted_gib", v["predicted_gib"], iteration)
    if wandb_writer is not None:
        wandb_writer.log({f"peakflat/peak_{k}_{m}": v[m] for k, v in out.items()
                          for m in ("measured_gib", "predicted_gib")}, iteration)
    meter.reset()
    return out


def _guard_step(iteration: int, args: Any) -> None:
    """``check_against_plan`` for this iteration, logged as a warning from rank 0 (the same figures on every rank
    of a stage would repeat it)."""
    if _guard["warned"] or iteration < GUARD_FROM_ITERATION:
        return
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    try:
        pl, stage_name = prediction(args)
    except Exception as e:  # noqa: BLE001
        log.debug("peakflat plan: no runtime guard (%s: %s)", type(e).__name__, e)
        _guard["warned"] = True
        return
    st = next((s for s in pl.stages if s.stage == stage_name), pl.stages[-1])
    which = "peakflat" if any(_config(args).enabled.values()) else "baseline"
    terms = {report_name(n): float(p.delta) for n, p in meter.measured().items()}
    note = check_against_plan(iteration, float(meter.lifetime_peak()), pl, st, which, terms)
    if note:
        log.warning(note)


def wrap_training_log(original: Any) -> Any:
    """Replacement for Megatron's ``training_log``: after Megatron logs an interval, log the peaks too.
    Megatron's own memory report inside it gets the process's true peak as "max allocated" (the meter's
    regions reset the allocator's)."""

    def training_log(loss_dict: Any, total_loss_dict: Any, learning_rate: Any, iteration: int, *args: Any, **kwargs: Any) -> Any:
        with meter.allocator_reports_lifetime_peak():  # its memory report's "max allocated"
            out = original(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        from megatron.training import get_args
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        margs = get_args()
        _guard_step(iteration, margs)
        if iteration % max(1, margs.log_interval) == 0:
            report(iteration, margs, writer=get_tensorboard_writer(), wandb_writer=get_wandb_writer())
        return out

    return training_log
