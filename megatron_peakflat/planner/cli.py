"""``python -m megatron_peakflat.plan``: per-rank memory of a Megatron MoE run, peakflat off and on.

Examples:

    python -m megatron_peakflat.plan --preset gpt-oss-120b --seq-len 1M --gpus 16
    python -m megatron_peakflat.plan --megatron-args "--num-layers 24 --hidden-size 2880 ..." --gpus 8 --json
    python -m megatron_peakflat.plan --preset deepseek-v3 --seq-len 128K --gpus 256 --plot peaks.png

(``peakflat-plan`` is the same command.) Precedence: explicit planner flags > --megatron-args > --preset > defaults
chosen from --gpus. Answers in well under a second: no torch, no GPU, no process group. Exit status: 0 when the
recommendation fits, 3 when nothing does, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from fractions import Fraction
from typing import Any, Sequence

from ..components import term_label
from ..config import PeakflatConfig, add_args
from ..integration import compat
from ..config_base import PeakflatConfigError
from . import te_limits
from .megatron_args import (PRESET_MARK, is_command_line, parse_megatron_args, run_fields_from_namespace,
                            shape_from_namespace)
from .model import COMPONENTS, GIB, Plan, RunConfig, pipeline_split, plan
from .recommend import Recommendation, blockers, recommend, startup_namespace
from .shapes import PRESETS, ModelShape, preset

__all__ = ["main", "build", "default_parallel"]


def local_hbm_gib() -> float | None:
    """Total memory of local GPU 0 via nvidia-smi (no torch import); None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=3, check=True).stdout.split()
        return float(out[0]) / 1024 if out else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def local_host_gib() -> float | None:
    """MemTotal of this machine in GiB (no torch import); None where /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def token_count(text: str) -> int:
    """A length in tokens, plain or with a binary unit: ``131072``, ``128K``, ``1M`` (K = 1024, M = 1024**2,
    G = 1024**3, either case). Raises ArgumentTypeError, which argparse reports with the flag, otherwise; a
    negative or zero count parses, for ``build`` to refuse with the flag, the value and the fix."""
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    value = None
    if m:
        number, unit = m.group(1), _UNITS[m.group(2).upper()]
        value = int(number) * unit if "." not in number else Fraction(number) * unit  # exact either way
    if value is None or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens: pass an integer, or one with K (x1024), "
                                         "M (x1024^2) or G (x1024^3), e.g. 128K or 1M")
    return int(value)


_SHORT_USAGE = ("usage: {prog} (--preset NAME | --megatron-args \"FLAGS\") [--seq-len 128K] [--gpus N] [--hbm-gib GIB] "
                "[--json] [--plot OUT.png] [--peakflat-* ...]\n       (--help lists every flag)\n")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose argument errors come with a two-line usage, not the whole flag list."""

    def format_usage(self) -> str:
        return _SHORT_USAGE.format(prog=self.prog)


def machine_gib(hbm_gib: float | None, host_gib: float | None) -> tuple[float, float]:
    """(GPU memory, a node's RAM) in GiB as given, else this machine's: the local GPU's (80 without one), and
    this machine's RAM where it has a GPU (a login node's RAM says nothing of the training nodes': 2048 there,
    a DGX H100/H200 node)."""
    hbm = hbm_gib if hbm_gib is not None else (local_hbm_gib() or 80.0)
    host = host_gib if host_gib is not None else ((local_host_gib() if local_hbm_gib() else None) or 2048.0)
    return hbm, host


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m megatron_peakflat.plan",
        description="Analytic per-rank memory of a Megatron MoE run with peakflat off and on; names the binding "
                    "peak and recommends the knobs that fit.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(__doc__ or "").replace("``", ""))
    g = p.add_argument_group("model")
    g.add_argument("--preset", help=f"a public model shape: {', '.join(PRESETS)}")
    g.add_argument("--megatron-args", default="", metavar='"FLAGS"',
                   help="the Megatron pretraining flags (and --peakflat-* flags) of the run, in one string")
    g.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    g = p.add_argument_group("run")
    g.add_argument("--seq-len", type=token_count, help="sequence length in tokens, e.g. 131072, 128K or 1M (K = 1024); "
                                                        "default: --seq-length or 4096")
    g.add_argument("--gpus", type=int, help="total GPUs; default: TPxPPxCPxDP, else 8")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node: the ranks that share a node's host RAM "
                                                                 "(default: 8)")
    g.add_argument("--hbm-gib", type=float, help="GPU memory per device; default: the local GPU's, else 80")
    g.add_argument("--host-gib", type=float, help="host RAM per node; default: this machine's when it has a GPU, "
                                                  "else 2048 (a DGX H100/H200 node)")
    for name in ("tp", "pp", "ep", "cp"):
        g.add_argument(f"--{name}", type=int,
                       help=f"{name.upper()} size (default: the command line's, else " +
                            ("chosen from --gpus; see --layout)" if name in ("ep", "cp") else "1)"))
    g.add_argument("--layout", choices=["pick", "given"], default="pick",
                   help="the CP and EP sizes that neither these flags nor --megatron-args set: 'pick' chooses them "
                        "for --gpus (CP to bring each rank to 128K tokens, EP as large as the experts allow); 'given' "
                        "takes Megatron's default, 1, as a run of that command line would (--peakflat auto and "
                        "peakflat-check plan so). TP and PP are 1 unless set. Default: pick")
    g.add_argument("--etp", type=int, help="expert tensor parallel size (default: --expert-tensor-parallel-size, else "
                                           "the TP size, as Megatron; PipelinedLLEP needs 1)")
    g.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: --micro-batch-size, else 1)")
    g.add_argument("--global-batch", type=int, help="sequences per step; with PP it sets the micro-batches in "
                                                    "flight (default: --global-batch-size, else Megatron's micro-batch x DP for "
                                                    "--megatron-args, else 2 x PP micro-batches for a preset)")
    g.add_argument("--recompute", choices=["none", "selective", "full"],
                   help="recompute granularity (default: full for presets, Megatron's flags otherwise)")
    g.add_argument("--recompute-num-layers", type=int, help="layers per full-recompute checkpoint (default: 1)")
    g.add_argument("--precision", choices=["bf16", "fp16", "fp32"], help="training precision (default: bf16, or "
                                                                         "what --megatron-args says)")
    g.add_argument("--adam", choices=["fused", "torch"],
                   help="the Adam Megatron runs: 'fused' (Transformer Engine's or apex's FusedAdam) or 'torch' "
                        "(torch.optim.AdamW, whose step allocates a temporary the size of its shard). Default: fused "
                        "for --transformer-impl transformer_engine (the training line's, Megatron's default), torch "
                        "for local; the planning machine's installation is not read")
    g.add_argument("--routing-skew", type=float, default=None,
                   help="max/mean tokens received per EP rank for the baseline dispatch (1 = balanced)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")
    g.add_argument("--plot", metavar="OUT.png", help="write a bar chart of the binding stage and its totals (needs "
                                                      "matplotlib: pip install 'megatron-peakflat[plot]')")
    add_args(p)
    return p


def _err(flag: str, value: Any, problem: str, fix: str) -> PeakflatConfigError:
    return PeakflatConfigError(flag, value, problem, fix)


def default_parallel(shape: ModelShape, gpus: int, seq_len: int, given: dict[str, int | None]) -> dict[str, int]:
    """Sensible sizes for ``gpus``: TP=1, PP=1, CP the smallest power of two that brings each rank's
    sequence to at most 128K tokens (capped by the GPUs), EP the largest power of two dividing the
    experts and TP x CP x DP, ETP the TP size (Megatron's default). Given sizes are kept."""
    tp, pp = given.get("tp") or 1, given.get("pp") or 1
    etp = given.get("etp") or tp
    cp = given.get("cp")
    if cp is None:
        cp = 1
        while seq_len / cp > 131072 and gpus % (tp * pp * cp * 2) == 0:
            cp *= 2
    dp = max(1, gpus // (tp * pp * cp))
    ep = given.get("ep")
    if ep is None:
        ep = 1
        if shape.experts:
            while shape.experts % (ep * 2) == 0 and (tp * cp * dp) % (ep * 2 * etp) == 0:
                ep *= 2
    return {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "ep": ep, "etp": etp}


def validate(shape: ModelShape, run: RunConfig, gpus: int) -> None:
    """Reject impossible sizes with the flag, the value and the fix."""
    for flag, value in (("--seq-len", run.seq_len), ("--gpus", gpus), ("--tp", run.tp), ("--pp", run.pp),
                        ("--ep", run.ep), ("--cp", run.cp), ("--etp", run.etp), ("--micro-batch", run.micro_batch),
                        ("--hidden-size", shape.hidden), ("--num-layers", shape.layers),
                        ("--num-attention-heads", shape.heads), ("--vocab-size", shape.vocab)):
        if value is None or value < 1:
            raise _err(flag, value, "must be a positive integer", f"pass {flag} 1 or more")
    for flag, value in (("--recompute-num-layers", run.recompute_num_layers), ("--global-batch", run.global_batch),
                        ("--gpus-per-node", run.gpus_per_node)):
        if value is not None and value < 1:
            raise _err(flag, value, "must be a positive integer", f"pass {flag} 1 or more, or leave it out")
    if shape.heads % run.tp:
        raise _err("--tp", run.tp, f"does not divide the {shape.heads} attention heads",
                   "choose a TP size that divides --num-attention-heads, e.g. " +
                   str(max(d for d in (1, 2, 4, 8) if shape.heads % d == 0)))
    if shape.mla is None and shape.kv_heads % run.tp:
        raise _err("--tp", run.tp, f"does not divide the {shape.kv_heads} query groups (kv heads)",
                   "choose a TP size that divides --num-query-groups")
    if shape.experts and shape.experts % run.ep:
        raise _err("--ep", run.ep, f"does not divide the {shape.experts} experts",
                   "choose an EP size that divides --num-experts")
    if not shape.experts and run.ep > 1:
        raise _err("--ep", run.ep, "the model has no experts", "drop --ep or pass --num-experts")
    if gpus % (run.tp * run.pp * run.cp):
        raise _err("--gpus", gpus, f"not divisible by TPxPPxCP = {run.tp}x{run.pp}x{run.cp}",
                   "make the GPU count a multiple of TPxPPxCP")
    if (run.tp * run.cp * run.dp) % (run.ep * run.etp):
        raise _err("--ep", run.ep, f"EPxETP = {run.ep * run.etp} does not divide TPxCPxDP = {run.tp * run.cp * run.dp}",
                   "choose EP so that EPxETP divides the GPUs of one pipeline stage")
    if run.pp > shape.layers:
        raise _err("--pp", run.pp, f"more stages than the {shape.layers} layers", "pass --pp <= --num-layers")
    pipeline_split(shape.layers, run)
    if run.cp > 1 and run.seq_len % (2 * run.cp):
        raise _err("--seq-len", run.seq_len, f"context parallelism {run.cp} needs a multiple of 2xCP",
                   f"pass a multiple of {2 * run.cp}")
    if shape.experts and not 1 <= shape.topk <= shape.experts:
        raise _err("--moe-router-topk", shape.topk, f"must be between 1 and the {shape.experts} experts",
                   "pass a top-k no larger than --num-experts")
    if not (1.0 <= run.routing_skew < math.inf):
        raise _err("--routing-skew", run.routing_skew, "max/mean load is never below 1", "pass 1.0 or more")


def build(argv: Sequence[str] | None = None) -> tuple[ModelShape, RunConfig, PeakflatConfig, argparse.Namespace, list[str]]:
    """Parse the command line into (shape, run, peakflat knobs, namespace, ignored Megatron flags)."""
    p = _parser()
    ns = p.parse_args(argv)
    if ns.list_presets:
        return None, None, None, ns, []  # type: ignore[return-value]
    base = None
    if ns.preset:
        try:
            base = preset(ns.preset)
        except KeyError:
            raise _err("--preset", ns.preset, "unknown preset", f"use one of {', '.join(PRESETS)}") from None
    mns, ignored = parse_megatron_args(ns.megatron_args) if ns.megatron_args else (argparse.Namespace(), [])
    if base is not None:  # flags beside a preset override it; the preset's other settings stay
        setattr(mns, PRESET_MARK, base.name)
    unknown = [u.split("=")[0] for u in ignored if u.startswith("--peakflat")]
    if unknown:
        raise _err(unknown[0], None, "is not a peakflat flag (pretraining would refuse it too)",
                   "check its spelling against docs/flags.md or --help")
    if base is None and not ns.megatron_args:
        raise _err("--preset", None, "no model given", f"pass --preset ({', '.join(PRESETS)}) or --megatron-args")
    shape = shape_from_namespace(mns, base) if ns.megatron_args else base
    fields = run_fields_from_namespace(mns)
    seq = ns.seq_len if ns.seq_len is not None else fields.pop("seq_len", 4096)
    fields.pop("seq_len", None)
    given = {k: getattr(ns, k) if getattr(ns, k) is not None else fields.get(k) for k in ("tp", "pp", "ep", "cp", "etp")}
    for k, v in given.items():
        if v is not None and v < 1:
            raise _err(f"--{k}", v, "must be a positive integer", f"pass --{k} 1 or more")
    if seq < 1:
        raise _err("--seq-len", seq, "must be a positive integer", "pass the sequence length in tokens, e.g. 131072")
    if ns.layout == "given":  # Megatron's defaults for what the line leaves out: the layout a run of it gets
        given = {k: v if v is not None or k == "etp" else 1 for k, v in given.items()}
    gpus = ns.gpus
    if gpus is None:
        if all(given.get(k) for k in ("tp", "pp", "cp")):
            gpus = given["tp"] * given["pp"] * given["cp"]
        else:
            gpus = 8
    if gpus < 1:
        raise _err("--gpus", gpus, "must be a positive integer", "pass the total GPU count, e.g. --gpus 16")
    par = default_parallel(shape, gpus, seq, given)
    hbm, host = machine_gib(ns.hbm_gib, ns.host_gib)
    for flag, value, example in (("--hbm-gib", hbm, "the GPU memory, e.g. --hbm-gib 141"),
                                 ("--host-gib", host, "the node's RAM, e.g. --host-gib 2048")):
        if not 0 < value < math.inf:
            raise _err(flag, value, "must be a positive number of GiB", f"pass {example}")
    kw: dict[str, Any] = dict(fields)
    kw.update(par)
    kw["seq_len"] = seq
    for src, dst in (("micro_batch", "micro_batch"), ("global_batch", "global_batch"), ("recompute", "recompute"),
                     ("recompute_num_layers", "recompute_num_layers"), ("precision", "precision"),
                     ("routing_skew", "routing_skew")):
        if getattr(ns, src) is not None:
            kw[dst] = getattr(ns, src)
    kw["hbm_bytes"] = int(hbm * GIB)
    kw["host_bytes_per_node"] = int(host * GIB)
    kw["gpus_per_node"] = ns.gpus_per_node
    kw.update(te_limits.te_run_fields(shape, mns, precision=kw.get("precision", "bf16"), cp=par["cp"]))
    kw["fused_adam"] = (ns.adam or ("fused" if kw["transformer_impl"] == "transformer_engine" else "torch")) == "fused"
    run = RunConfig(**kw)
    validate(shape, run, gpus)
    # --peakflat-* knobs: planner flags win over the ones inside --megatron-args.
    merged = argparse.Namespace(**{k: v for k, v in vars(mns).items() if k.startswith("peakflat_")})
    defaults = vars(_parser().parse_args([]))
    for k, v in vars(ns).items():
        if k.startswith("peakflat_") and (v != defaults.get(k) or not hasattr(merged, k)):
            setattr(merged, k, v)
    pf = PeakflatConfig.from_args(merged, validate=False).validate()
    ns.megatron_namespace = mns if ns.megatron_args else None
    if ns.megatron_args and is_command_line(mns):  # its own --peakflat-* flags, refused as start-up would
        own = argparse.Namespace(**{k: v for k, v in vars(mns).items() if k.startswith("peakflat_")})
        startup = startup_namespace(shape, run, mns)
        compat.check_args(PeakflatConfig.from_args(own, validate=False).validate(startup), startup)
    pf = _all_on(pf, shape, run, ns.megatron_namespace)
    return shape, run, pf, ns, ignored


def _all_on(pf: PeakflatConfig, shape: ModelShape, run: RunConfig, megatron_args: Any = None) -> PeakflatConfig:
    """The 'peakflat' column turns every component on with the knobs given, except those whose start-up check
    would refuse this run (``recommend.blockers``)."""
    off = blockers(shape, run, megatron_args)
    return PeakflatConfig(
        dispatch=pf.dispatch if "dispatch" in off else dataclasses.replace(pf.dispatch, impl="pipelined-llep"),
        vocab=pf.vocab if "vocab" in off else dataclasses.replace(pf.vocab, impl="ring-dtp"),
        sco=dataclasses.replace(pf.sco, enabled="sco" not in off),
        optimizer=dataclasses.replace(pf.optimizer, impl="offload-stream"),
        tile=dataclasses.replace(pf.tile, enabled="tile" not in off),
        general=pf.general)


def _gib(x: float | None) -> str:
    return f"{'-':>9s}" if x is None else f"{x / GIB:9.2f}"


def render(pl: Plan, rec: Recommendation) -> str:
    """The text report: each stage's rows, totals and binding peak, then the recommended flags and why."""
    s, r = pl.shape, pl.run
    out = []
    out.append(f"peakflat plan: {s.name}  seq {r.seq_len:,}  GPUs {r.world} (TP{r.tp} PP{r.pp} CP{r.cp} DP{r.dp} "
               f"EP{r.ep}{' ETP' + str(r.etp) if r.etp > 1 else ''})  micro-batch {r.micro_batch}  {r.precision}  "
               f"recompute {r.recompute}  HBM {r.hbm_bytes / GIB:.0f} GiB  host {r.host_bytes_per_node / GIB:.0f} GiB/node "
               f"({r.host_bytes_per_rank / GIB:.0f} GiB/rank)")
    out.append(f"assumed: --transformer-impl {r.transformer_impl}, Adam {'fused' if r.fused_adam else 'torch'} "
               f"(--adam), attention {'unfused (' + r.unfused_attention + ')' if r.unfused_attention else 'flash/fused'}")
    for st in pl.stages:
        out.append("")
        out.append(f"stage {st.stage}: {st.layers} layers ({st.moe_layers} MoE), {st.inflight:g} micro-batch(es) in flight;"
                   "  GiB per rank")
        width = max(18, *(len(term_label(n)) for n in st.rows))
        out.append(f"  {'term':{width}s} {'baseline':>9s} {'peakflat':>9s} {'bound':>9s} {'host':>9s}  phase")
        order = ["parameters", "gradients", "optimizer", "activations", "layer working set", "tile",
                 "attention scores",
                 "embedding gradient", "dispatcher probs", "dispatcher state", "sco", "dispatch", "vocab",
                 "reserve", "optimizer step", "probs at step", "model build"]
        for name in order + [n for n in st.rows if n not in order]:
            if name not in st.rows:
                continue
            row = st.rows[name]
            mark = "*" if name in COMPONENTS else " "
            out.append(f" {mark}{term_label(name):{width}s} {_gib(row.baseline)} {_gib(row.peakflat)} "
                       f"{_gib(row.bound)} {_gib(row.host_peakflat)}  {row.phase}")
        tb, tp_ = st.total("baseline"), st.total("peakflat")
        out.append(f"  {'total':{width}s} {_gib(tb)} {_gib(tp_)} {'':9s} {_gib(st.host('peakflat'))}"
                   f"  = max(persistent + max(layer + max(attention, moe, mlp), loss), step, build)")
        tg = st.total("peakflat", guaranteed=True)
        out.append(f"  binding peak: baseline '{term_label(st.binding('baseline'))}' "
                   f"({'fits' if tb <= r.hbm_bytes else 'OOM'}), "
                   f"peakflat '{term_label(st.binding('peakflat'))}' "
                   f"({'fits' if tp_ <= r.hbm_bytes else 'OOM'} as expected; "
                   f"{_gib(tg).strip()} GiB whatever the routing: {'fits' if tg <= r.hbm_bytes else 'OOM'})")
        for n in st.notes:
            out.append(f"  note: {n}")
    wb, wp = pl.worst("baseline"), pl.worst("peakflat")
    out.append("")
    out.append(f"baseline: {wb.total('baseline') / GIB:.1f} GiB per GPU, "
               f"binding peak '{term_label(wb.binding('baseline'))}' -> "
               f"{'fits' if pl.fits('baseline') else 'does NOT fit'} in {r.hbm_bytes / GIB:.0f} GiB")
    guar = max(x.total("peakflat", guaranteed=True) for x in pl.stages)
    out.append(f"peakflat (every component that applies, at the knobs given or their defaults): "
               f"{wp.total('peakflat') / GIB:.1f} GiB expected, binding peak '{term_label(wp.binding('peakflat'))}'; "
               f"{guar / GIB:.1f} GiB whatever the routing -> "
               f"{'fits' if pl.fits('peakflat', guaranteed=True) else 'does NOT fit'}")
    rw = rec.plan.worst("peakflat")
    if rec.fits:
        out.append(f"recommended (the components this run needs, their defaults shrunk until they fit): {rw.total('peakflat') / GIB:.1f} GiB per GPU expected, "
                   f"{max(x.total('peakflat', guaranteed=True) for x in rec.plan.stages) / GIB:.1f} GiB whatever "
                   "the routing, "
                   f"{max(x.host('peakflat') for x in rec.plan.stages) / GIB:.1f} GiB host per rank; "
                   f"binding peak '{term_label(rw.binding('peakflat'))}'")
    else:
        out.append("recommended: nothing fits")
    out.append(flags_line(rec))
    for reason in rec.reasons:
        out.append(f"  why: {reason}")
    return "\n".join(out)


FLAGS_LABEL = "  flags to add: "
"""The label of the recommended flags' line where they fit."""
TRIED_LABEL = "  tried, does NOT fit (not a line to run): "
"""The label of the closest configuration's flags where nothing fits."""


def flags_line(rec: Recommendation) -> str:
    """The recommendation's flags on one labelled line: to add where they fit, else what was tried."""
    return (FLAGS_LABEL if rec.fits else TRIED_LABEL) + " ".join([*rec.layout_flags, *rec.flags])


def to_json(pl: Plan, rec: Recommendation) -> dict[str, Any]:
    """``render``'s content as a JSON-serialisable dict (GiB floats, the recommended flags as a list)."""
    def stage(st: Any) -> dict[str, Any]:
        return {"stage": st.stage, "layers": st.layers, "inflight": st.inflight,
                "rows": {k: {"baseline_gib": v.baseline / GIB, "peakflat_gib": v.peakflat / GIB,
                             "bound_gib": None if v.bound is None else v.bound / GIB,
                             "host_gib": v.host_peakflat / GIB, "phase": v.phase, "source": v.source}
                         for k, v in st.rows.items()},
                "total_baseline_gib": st.total("baseline") / GIB, "total_peakflat_gib": st.total("peakflat") / GIB,
                "host_peakflat_gib": st.host("peakflat") / GIB,
                "binding_baseline": st.binding("baseline"), "binding_peakflat": st.binding("peakflat"),
                "notes": st.notes}
    return {
        "model": dataclasses.asdict(pl.shape), "run": dataclasses.asdict(pl.run),
        "stages": [stage(s) for s in pl.stages],
        "baseline": {"fits": pl.fits("baseline"), "binding": pl.worst("baseline").binding("baseline"),
                     "total_gib": pl.worst("baseline").total("baseline") / GIB},
        "peakflat": {"fits": pl.fits("peakflat", guaranteed=True), "binding": pl.worst("peakflat").binding("peakflat"),
                     "total_gib": pl.worst("peakflat").total("peakflat") / GIB},
        "recommended": {"fits": rec.fits, "flags": rec.flags, "layout_flags": rec.layout_flags, "reasons": rec.reasons,
                        "chunk_cap": rec.config.dispatch.cap(pl.shape.topk), "vocab_block_size": rec.config.vocab.block_size,
                        "vocab_schedule": rec.plan.vocab_schedule, "sco_budget_gib": (rec.config.sco.budget or 0) / GIB,
                        "optimizer_bucket": rec.config.optimizer.bucket, "optimizer_slots": rec.config.optimizer.slots,
                        "total_gib": rec.plan.worst("peakflat").total("peakflat") / GIB,
                        "guaranteed_total_gib": max(x.total("peakflat", guaranteed=True)
                                                    for x in rec.plan.stages) / GIB,
                        "binding": rec.plan.worst("peakflat").binding("peakflat")},
    }


def plot(pl: Plan, path: str) -> None:
    """Bar chart of the binding stage: baseline vs peakflat per term, then each column's total (the peak, not
    the sum of the terms: phases that do not overlap take their maximum), labelled in GiB; HBM as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = pl.worst("baseline")
    names = [n for n in st.rows]
    base = [st.rows[n].baseline / GIB for n in names]
    pfl = [st.rows[n].peakflat / GIB for n in names]
    totals = (st.total("baseline") / GIB, st.total("peakflat") / GIB)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = list(range(len(names)))
    xt = len(names) + 0.5  # the totals, set apart from the terms
    ax.bar([x - 0.2 for x in xs] + [xt - 0.2], base + [totals[0]], width=0.4, label="baseline", color="tab:blue")
    ax.bar([x + 0.2 for x in xs] + [xt + 0.2], pfl + [totals[1]], width=0.4, label="peakflat", color="tab:orange")
    for dx, total in zip((-0.2, 0.2), totals):
        ax.annotate(f"{total:.1f}", (xt + dx, total), ha="center", va="bottom", fontsize=8)
    ax.axvline(len(names) - 0.25, color="grey", linewidth=0.5)
    ax.axhline(pl.run.hbm_bytes / GIB, color="red", linestyle="--", label=f"HBM {pl.run.hbm_bytes / GIB:.0f} GiB")
    ax.set_xticks(xs + [xt], names + ["total (peak)"], rotation=30, ha="right")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{pl.shape.name}, seq {pl.run.seq_len:,}, {pl.run.world} GPUs ({st.stage} stage): "
                 f"total {totals[0]:.1f} -> {totals[1]:.1f} GiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


NOTHING_FITS = 3
"""Exit status when no configuration fits the GPU (2 is a bad flag, as argparse's)."""


def plot_available() -> bool:
    """Whether ``--plot`` can draw: matplotlib is importable (checked without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner; returns the exit status: 0 when the recommendation fits, ``NOTHING_FITS`` (3) when
    nothing does, 2 with the flag, value and fix on stderr for a bad flag. A reader that closes the pipe early
    (``| head``) ends the output quietly."""
    status = [0]  # set by _main before it prints, so that a closed pipe keeps the plan's status
    try:
        status[0] = _main(argv, status)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
    return status[0]


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's own flush at exit meets no closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured, replaced)
        pass


def _main(argv: Sequence[str] | None, status: list[int]) -> int:
    try:
        shape, run, pf, ns, ignored = build(argv)
        if ns.plot and not plot_available():
            raise _err("--plot", ns.plot, "needs matplotlib, which is not installed here",
                       "pip install 'megatron-peakflat[plot]' (or pip install matplotlib), or drop --plot")
    except PeakflatConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.list_presets:
        for name, s in PRESETS.items():
            print(f"{name:18s} layers {s.layers:3d}  hidden {s.hidden:5d}  heads {s.heads:3d}/{s.kv_heads:<3d} "
                  f"experts {s.experts:3d} top-{s.topk}  moe-ffn {s.moe_ffn:5d}  ffn {s.ffn:5d}  vocab {s.vocab}  "
                  f"({s.source})")
        return 0
    mns = ns.megatron_namespace
    if mns is not None and is_command_line(mns):
        refusal = te_limits.line_refusal(shape, run, mns)
        if refusal is not None:
            print(f"error: {refusal}", file=sys.stderr)
            return 2
    pl = plan(shape, run, pf)
    rec = recommend(shape, run, pf, mns)
    status[0] = 0 if rec.fits else NOTHING_FITS
    if ns.json:
        doc = to_json(pl, rec)
        doc["ignored_megatron_flags"] = ignored
        print(json.dumps(doc, indent=2))
    else:
        print(render(pl, rec))
        if ignored:
            print(f"(Megatron flags the planner does not read, taken as not changing memory: {' '.join(ignored)})")
    if ns.plot:
        plot(pl, ns.plot)
        if not ns.json:
            print(f"wrote {ns.plot}")
    return status[0]


if __name__ == "__main__":
    sys.exit(main())
