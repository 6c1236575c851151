"""The planner's arguments: ``build(argv)`` reads the planner's flags (``python -m megatron_peakflat.plan``'s, a
Megatron command line in ``--megatron-args`` among them) into the model shape, the run and the peakflat knobs that
``planner.model.plan`` and ``planner.recommend.recommend`` take, refusing impossible sizes with the flag, the value
and the fix; and this machine's figures that stand in for the flags left out (``machine_gib``).

The library behind the planner's command line (``cli/plan.py``), ``--peakflat auto`` (``auto.py``),
``peakflat-check`` and the runtime peak report. No torch import.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import subprocess
from fractions import Fraction
from typing import Any, Sequence

from ..config import PeakflatConfig, add_args
from ..config_base import PeakflatConfigError
from ..integration import compat
from ..runtime import machine
from . import te_limits
from .megatron_args import PRESET_MARK, is_command_line, parse_megatron_args, run_fields_from_namespace, \
    shape_from_namespace
from .model import GIB, RunConfig, pipeline_split
from .recommend import blockers, startup_namespace
from .shapes import PRESETS, ModelShape, preset

__all__ = ["build", "default_parallel", "validate", "machine_gib", "local_hbm_gib", "local_host_gib", "token_count",
           "EXAMPLES"]

EXAMPLES = """Examples:

    python -m megatron_peakflat.plan --preset gpt-oss-120b --seq-len 1M --gpus 16
    python -m megatron_peakflat.plan --megatron-args "--num-layers 24 --hidden-size 2880 ..." --gpus 8 --json
    python -m megatron_peakflat.plan --preset deepseek-v3 --seq-len 128K --gpus 256 --plot peaks.png

(peakflat-plan is the same command.) Precedence: explicit planner flags > --megatron-args > --preset > defaults
chosen from --gpus. Answers in well under a second: no torch, no GPU, no process group. Exit status: 0 when the
recommendation fits, 3 when nothing does, 2 for a bad flag.
"""
"""The planner's --help epilog."""


def local_hbm_gib() -> float | None:
    """Total memory of local GPU 0 via nvidia-smi (no torch import); None without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=3, check=True).stdout.split()
        return float(out[0]) / 1024 if out else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def local_host_gib() -> float | None:
    """MemTotal of this machine in GiB (``runtime.machine.mem_total``: no torch import); None where /proc/meminfo
    is unreadable."""
    total = machine.mem_total()
    return None if total is None else total / GIB


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
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
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
    if run.global_batch is not None and run.global_batch % (run.micro_batch * run.dp):
        raise _err("--global-batch", run.global_batch, f"is not a multiple of micro-batch {run.micro_batch} x DP "
                   f"{run.dp}, which Megatron refuses", f"pass a multiple of {run.micro_batch * run.dp}, or another "
                   "data-parallel size (--gpus, or the line's parallel sizes)")
    if shape.experts and not 1 <= shape.topk <= shape.experts:
        raise _err("--moe-router-topk", shape.topk, f"must be between 1 and the {shape.experts} experts",
                   "pass a top-k no larger than --num-experts")
    if not (1.0 <= run.routing_skew < math.inf):
        raise _err("--routing-skew", run.routing_skew, "max/mean load is never below 1", "pass 1.0 or more")


def smallest_world(tp: int, pp: int, cp: int, ep: int = 1, etp: int | None = None) -> int:
    """The fewest GPUs Megatron accepts for these sizes: TP x PP x CP x DP with the smallest DP that lets
    EP x ETP (ETP: TP unless given) divide TP x CP x DP."""
    etp = etp or tp
    dp = 1
    while (tp * cp * dp) % (ep * etp) and dp < ep * etp:
        dp += 1
    return tp * pp * cp * dp


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
            gpus = smallest_world(given["tp"], given["pp"], given["cp"], given.get("ep") or 1, given.get("etp"))
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
    kw.update(te_limits.te_run_fields(shape, mns, precision=kw.get("precision", "bf16"), cp=par["cp"],
                                      preset=not (ns.megatron_args and is_command_line(mns))))
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
        optimizer=pf.optimizer if "optimizer" in off else dataclasses.replace(pf.optimizer, impl="offload-stream"),
        tile=dataclasses.replace(pf.tile, enabled="tile" not in off),
        general=pf.general)
