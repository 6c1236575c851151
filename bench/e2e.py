"""End to end on one GPU: how long a context trains with Megatron tuned for memory, and with peakflat.

Three methods train the same gpt-oss-20b-shaped MoE (hidden 2880; 64 query heads and 8 KV heads of 64; 32
experts top-4 of FFN 2880, SwiGLU; vocabulary 201088, untied; RoPE; bf16; ``--layers`` layers, mock data,
micro-batch 1), all on Transformer Engine's layers (TE attention, ``--moe-grouped-gemm``, ``--moe-permute-fusion``):

- ``megatron-te``: Megatron-Core tuned for memory as its documentation advises: full recompute, the distributed
  optimizer, ``expandable_segments``. At each length it takes the fastest stock configuration that fits, trying
  in turn: the optimizer on the GPU; ``--optimizer-cpu-offload --use-precision-aware-optimizer
  --overlap-cpu-optimizer-d2h-h2d``; that plus fine-grained activation offloading. Each row records which ran.
  Megatron's TE cross-entropy fusion is refused by megatron-core 0.19 ("disabled due to stability issues"), and
  its native fusion keeps a larger fp32 softmax than the unfused loss (``bench/results/vocab.json``), so neither
  lowers the peak and neither is used.
- ``peakflat-auto``: megatron-te's configuration at that length (beyond megatron-te's reach, its offloaded one)
  plus ``--peakflat auto``.
- ``peakflat-all``: the offloaded configuration plus every component.

Reach: for each method, the longest sequence that trains ``--iters`` iterations (2): doubling from ``--min-seq``, then
bisecting at ``--granularity``, up to ``--max-seq``; or, with ``--lengths 512K,768K,1M``, those lengths only, shortest
first. Every length runs in its own process, so an OOM ends only that length, and every row is written to the results
file as soon as it is measured; a second invocation resumes from the rows already there. A length's row is one run:
its peak is the result, its time stays in ``extra.one_run_ms`` with ``ms`` null (a timing is the time phase's). Times
are each iteration's own, all but the first: Megatron logs iteration 2 as the mean of iterations 1 and 2, which
``iteration_ms`` undoes. A
length that ``--peakflat auto`` refuses at start-up (nothing fits) is 'refused', with the planner's reason in
``extra.error_lines``. ``--background`` starts the
command as a detached process and returns (its rows go into ``--background-dir``); ``--collect`` prints what it has
done and copies its results file back, so a length longer than one shell command can run across several.

Same loss: the three methods train ``--same-loss-iters`` iterations at ``--same-loss-seq`` with
``--deterministic-mode``; the largest relative difference of the loss and grad norm against megatron-te is recorded.
In bf16, beside a control: megatron-te in its other optimizer configuration, the spread that bf16 rounding alone
makes between two computations of one training step. With ``--dtype fp32`` (TF32 off), beside the targets
``FP32_TARGETS``; where Transformer Engine refuses fp32, ``--spec local`` runs every method on Megatron's local spec.
A case names its dtype and learning rate where they are not bf16 at 3e-4.

Time: each method at each of ``--time-seqs`` (8K, 16K, 32K, 48K) for ``--time-iters`` iterations, ``--repeats`` (3)
times, each run its own process and the methods in turn; megatron-te on its fastest configuration that fits there,
peakflat on megatron-te's. A run's time is the median of its iterations but the first; the row's ``ms`` is the median
of the runs (each in ``extra.runs_ms``, their spread in ``extra.spread``), and the ratio to megatron-te's median is
flagged where the runs' range holds 1.0x. ``peakflat-tile`` is peakflat-auto plus ``--peakflat-tile`` (refused
until megatron_peakflat defines that flag); ``--extra-flags METHOD=FLAGS`` appends flags to one method's command line.
``--dry-run`` runs the whole driver on CPU with tiny shapes (Megatron's local spec through the CPU shim) and writes
``e2e_dryrun.json``.

    python3 bench/e2e.py                          # the search, then the same-loss runs, then the plot
    python3 bench/e2e.py --phases reach --methods megatron-te --max-seq 512K
    python3 bench/e2e.py --phases same-loss --same-loss-seq 8K --lr 1e-5
    python3 bench/e2e.py --phases same-loss --dtype fp32 --out e2e_fp32.json
    python3 bench/e2e.py --phases time --methods megatron-te,peakflat-auto --repeats 3
    python3 bench/e2e.py --phases reach --methods peakflat-auto --lengths 512K,1M --timeout 1500 --background
    python3 bench/e2e.py --collect
    python3 bench/e2e.py --dry-run
    python3 bench/e2e.py --cp 2 --phases reach,time --methods megatron-te,peakflat-auto   # two GPUs: e2e_cp2.json
    python3 bench/e2e.py --dry-run --cp 2 --phases reach --max-seq 64                     # the same, two gloo ranks

``--cp N`` runs every length at ``--context-parallel-size N`` on N GPUs of one host (Transformer Engine's CP attention
with ``--cp-comm-type p2p``; the local spec's SDPA attention): its rows record ``extra.gpus`` and go to a file of their
own (``e2e_cp<N>.json``), and no ratio is taken between rows of two GPU counts. Every measured row records the
planner's figure for its flags (``extra.planner_gib``) beside its peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pretrain_compare import DRAIN_S, loss_gap, oom_of, run_in_session  # noqa: E402
from megatron_peakflat.config_base import PeakflatConfigError  # noqa: E402
from megatron_peakflat.testing.subproc import iteration_ms, logged, memory_reports  # noqa: E402

RESULTS = ROOT / "bench" / "results"
METHODS = ("megatron-te", "peakflat-auto", "peakflat-all")
TILE_FLAG = "--peakflat-tile"
VARIANTS = {"peakflat-tile": ["--peakflat", "auto", TILE_FLAG]}
"""Further methods: a variant of peakflat-auto with the flags it adds (run on peakflat-auto's configuration)."""
ALL_METHODS = METHODS + tuple(VARIANTS)
CONTROL = "megatron-te-control"
DEFAULT_LR = 3e-4
"""The learning rate of the reach and time phases; a same-loss case at another one names it."""
FP32_TARGETS = {"loss": 1e-5, "grad_norm": 1e-4}
"""fp32 same-loss: the largest relative loss and grad-norm gaps against megatron-te that rounding explains."""
"""Same loss only: megatron-te in its other stock memory configuration."""
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Model:
    """The model's shape: gpt-oss-20b's layers, fewer of them."""

    layers: int = 2
    hidden: int = 2880
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    experts: int = 32
    topk: int = 4
    moe_ffn: int = 2880
    vocab: int = 201088
    bf16: bool = True
    lr: float = DEFAULT_LR
    warmup: int = 1

    def flags(self, seq: int) -> list[str]:
        return [
            "--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
            "--num-attention-heads", str(self.heads), "--group-query-attention", "--num-query-groups", str(self.kv_heads),
            "--kv-channels", str(self.head_dim), "--ffn-hidden-size", str(self.moe_ffn),
            "--num-experts", str(self.experts), "--moe-router-topk", str(self.topk),
            "--moe-ffn-hidden-size", str(self.moe_ffn), "--swiglu", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-2", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", *(["--bf16"] if self.bf16 else []), "--seed", "1234",
            "--lr", f"{self.lr:g}", "--min-lr", f"{self.lr / 10:g}", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(self.warmup),
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", "1000000", "--no-create-attention-mask-in-dataloader",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(self.vocab),
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--use-distributed-optimizer",
        ]


TINY = Model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=32, topk=4, moe_ffn=64, vocab=1024)
"""The dry run's model: gpt-oss-20b's routing (32 experts, top-4) at a width the CPU trains in seconds."""

TE_FLAGS = ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm", "--moe-permute-fusion"]
OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]
ACT_OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "qkv_linear", "core_attn",
               "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
ALL_ON = ["--peakflat-dispatch", "pipelined-llep", "--peakflat-vocab", "ring-dtp", "--peakflat-sco",
          "--peakflat-optimizer", "offload-stream"]


def method_flags(method: str) -> list[str]:
    """What a method adds to its stock configuration's flags."""
    added = {"megatron-te": [], CONTROL: [], "peakflat-auto": ["--peakflat", "auto"], "peakflat-all": ALL_ON,
             **VARIANTS}
    return list(added[method])


def peakflat_flag_exists(flag: str) -> bool:
    """Whether this version of megatron_peakflat defines ``flag`` (its ``add_args`` parser knows it)."""
    import argparse

    from megatron_peakflat.config import add_args

    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return flag in parser._option_string_actions


def missing_variant_flags(methods: list[str]) -> list[str]:
    """One line per method asked for whose flag this version of megatron_peakflat lacks."""
    return [f"method {m} runs peakflat-auto with {TILE_FLAG}, which this version of megatron_peakflat does not "
            f"define; drop {m} from --methods until it does" for m in methods
            if m in VARIANTS and not peakflat_flag_exists(TILE_FLAG)]


@dataclasses.dataclass(frozen=True)
class Stock:
    """One of Megatron's own memory configurations: its extra flags and environment."""

    name: str
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


LADDER = (
    Stock("gpu-optimizer", ()),
    Stock("cpu-offload", tuple(OFFLOAD)),
    Stock("cpu-offload+activation-offload", tuple(OFFLOAD + ACT_OFFLOAD), (("NVTE_CPU_OFFLOAD_V1", "1"),)),
)
"""megatron-te's configurations, fastest first; each lowers the peak further and costs time."""
PEAKFLAT_BASES = ("gpu-optimizer", "cpu-offload")
"""The stock configurations peakflat runs on top of (fine-grained activation offloading hooks Megatron's expert
modules, which PipelinedLLEP replaces)."""


@dataclasses.dataclass
class Attempt:
    """One process: what ran and how it ended ('ok', 'oom', 'timeout', 'error')."""

    outcome: str
    wall_s: float
    losses: list[float]
    grad_norms: list[float]
    ms: float | None
    memory_mib: dict[str, float]
    peaks: dict[str, tuple[float, float]]
    auto: dict[str, Any]
    oom: dict[str, Any] | None
    tail: str
    command: str = ""
    """The command line that ran (its master port is drawn per process)."""
    error_lines: list[str] = dataclasses.field(default_factory=list)
    """A failed run's own error: the lines up to and just after its first exception or CUDA error."""
    iter_ms: list[float] = dataclasses.field(default_factory=list)
    """Every iteration's own time (``iteration_ms``: iteration 2's taken out of Megatron's mean of 1 and 2);
    ``ms`` is the median of all but the first."""


_ERROR = re.compile(r"(^|\s|\]:\s?)([\w.]*(Error|Exception)\b(?!:?\s*$)|Traceback \(most recent call last\)|"
                    r"CUDA error|illegal memory access|device-side assert|Segmentation fault|core dumped|"
                    r"terminate called|Fatal Python error)")
_REFUSAL = re.compile(r"^(?:\[rank\d+\]:\s?)?megatron-peakflat: .* Fix: ")
"""A start-up refusal (``PeakflatConfigError`` as ``megatron_peakflat.pretrain`` prints it): 'megatron-peakflat:
<flag>=<value>: <why>. Fix: <fix>'."""
_LAUNCHER = re.compile(r"ChildFailedError|torch\.distributed\.elastic|torch/distributed/run\.py|torchrun|"
                       r"Root Cause|error_file|exitcode|To enable traceback|elastic/multiprocessing|"
                       r"^\s*(time|host|rank|local_rank)\s*:|^=+$|Failures:")


def error_lines(text: str, lines: int = 30) -> list[str]:
    """The failing rank's own error, not the launcher's summary after it: peakflat's start-up refusal where it
    stopped the run (``_REFUSAL``; the launcher's traceback below it is not the failure); else up to ``lines``
    lines ending a few lines after the first exception or CUDA error line that torchrun's report did not write,
    after the first traceback of the run's own (a warning naming an ImportError before it is not the failure), with
    that traceback above it; the last ``lines`` lines where none is found."""
    all_lines = text.splitlines()
    refusal = [ln for ln in all_lines if _REFUSAL.match(ln)]
    if refusal:  # peakflat's start-up refusal: flag, value, why and fix in one line, then a clean exit
        return refusal[:lines]
    own = [i for i, ln in enumerate(all_lines) if not _LAUNCHER.search(ln)]
    traceback = next((i for i in own if "Traceback (most recent call last)" in all_lines[i]), -1)
    final = next((i for i in own if i > traceback and re.search(r"(^|\s|\]:\s?)[\w.]*(Error|Exception)\b:|CUDA error|"
                                               r"illegal memory access|device-side assert|Segmentation fault|"
                                               r"Fatal Python error|terminate called", all_lines[i])), None)
    if final is None:
        final = next((i for i in reversed(own) if _ERROR.search(all_lines[i])), None)
    if final is None:  # no exception line (a clean refusal): the last lines, less Python's warnings
        return [ln for ln in all_lines if ln.strip() and "Warning:" not in ln and "warnings.warn(" not in ln][-lines:]
    begin = traceback if 0 <= traceback <= final and final - traceback < lines - 4 else max(0, final - lines + 4)
    keep = [ln for ln in all_lines[begin:final + 4] if ln.strip() and not _LAUNCHER.search(ln)]
    return keep[:lines]


_PEAKS = re.compile(r"peakflat peaks iter \d+ .*?measured/predicted: (.*)$", re.M)
_PAIR = re.compile(r"([a-z_ ]+?) ([0-9.]+)/([0-9.]+)")


_REFUSED = re.compile(r"--peakflat='auto': nothing fits")
"""The line ``python -m megatron_peakflat.pretrain`` prints where ``--peakflat auto`` finds nothing that fits."""
FAILED = ("oom", "refused", "error")
"""The outcomes of a length that did not train (a timeout is not one: the reach is then bounded by time)."""


def parse(text: str, rc: int, wall: float, iters: int) -> Attempt:
    """What one training log says: losses, grad norms, the last iteration's time, Megatron's memory report after
    the second iteration, the runtime peak report's last line, and ``--peakflat auto``'s decision."""
    losses = logged(text, "lm loss")
    times = iteration_ms(text)
    mem = memory_reports(text).get(min(2, iters), {})
    peaks: dict[str, tuple[float, float]] = {}
    found = _PEAKS.findall(text)
    if found:
        peaks = {k.strip(): (float(a), float(b)) for k, a, b in _PAIR.findall(found[-1])}
    auto: dict[str, Any] = {}
    added = re.search(r"^\s*added: (.*)$", text, re.M)
    if added:
        auto["added"] = added.group(1).strip()
    predicted = re.search(r"predicted peak ([0-9.]+) GiB per GPU \(([0-9.]+) whatever the routing\)", text)
    if predicted:
        auto["planner_total_gib"], auto["planner_guaranteed_gib"] = float(predicted.group(1)), float(predicted.group(2))
    oom = oom_of(text)
    if oom is None and ("CUDA out of memory" in text or "OutOfMemoryError" in text):
        oom = {"message": next(ln for ln in text.splitlines() if "out of memory" in ln.lower())[-400:], "where": []}
    if rc == 0 and len(losses) >= iters:
        outcome = "ok"
    elif oom is not None:
        outcome = "oom"
    elif rc == 124:
        outcome = "timeout"
    elif not losses and _REFUSED.search(text):
        outcome = "refused"  # --peakflat auto found nothing that fits, at start-up: the planner's verdict
    else:
        outcome = "error"
    timed = times[1:] if len(times) > 1 else times  # the first iteration holds the warm-up
    ms = statistics.median(timed) if timed else None
    return Attempt(outcome, round(wall, 1), losses, logged(text, "grad norm"), ms, mem,
                   peaks, auto, oom, "" if outcome == "ok" else text[-2500:],
                   error_lines=error_lines(text) if outcome in ("error", "timeout", "refused") else [], iter_ms=times)


class BudgetSpent(Exception):
    """The invocation's time budget ran out before a length finished; that length is measured by the next one."""


@dataclasses.dataclass
class Driver:
    """Runs lengths and keeps the results file; ``runner`` is swapped in tests. ``deadline`` (time.monotonic) is
    when this invocation stops: a length that would run past it is killed and left for the next invocation,
    not recorded as a timeout."""

    out: Path
    model: Model
    spec: str
    dry_run: bool
    timeout: float
    runner: Callable[[list[str], dict[str, str], float], tuple[int, str]] = run_in_session
    doc: dict[str, Any] = dataclasses.field(default_factory=dict)
    deadline: float = float("inf")
    iters: int = 2
    """Iterations per length: a length trains when all of them do; the time is the median of all but the first."""
    extra_flags: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Flags appended to a method's command line (``--extra-flags METHOD=FLAGS``), recorded in its rows."""
    cp: int = 1
    """Context-parallel size: each length runs on this many GPUs of one host (torchrun ranks), every row records it
    as ``extra.gpus``, and a results file holds rows of one GPU count only."""

    def __post_init__(self) -> None:
        if self.out.exists():
            self.doc = json.loads(self.out.read_text())
        self.doc.setdefault("component", "e2e")
        self.doc.setdefault("rows", [])
        self.doc.setdefault("commands", [])
        if self.doc["rows"] and self.doc.get("gpus", 1) != self.cp:
            raise PeakflatConfigError("--cp", self.cp, f"{self.out} holds rows measured on {self.doc.get('gpus', 1)} "
                                      "GPU(s), and rows of two GPU counts must not share a file (their ratios would "
                                      "compare the machines)", "pass another --out, or the --cp of that file")
        self.doc["gpus"] = self.cp
        # the shape only: the learning rate differs between phases, and each row's command holds its own
        self.doc["model"] = {k: v for k, v in dataclasses.asdict(self.model).items() if k not in ("lr", "warmup")}
        self.doc["spec"] = self.spec

    # results file -------------------------------------------------------------------------------------
    def row(self, case: str, method: str) -> dict[str, Any] | None:
        return next((r for r in self.doc["rows"] if r["case"] == case and r["method"] == method), None)

    def put(self, row: dict[str, Any]) -> None:
        """Replace or add a row and write the file at once (a cut-off run keeps every row before it)."""
        row["extra"].setdefault("gpus", self.cp)
        rows = [r for r in self.doc["rows"] if not (r["case"] == row["case"] and r["method"] == row["method"])]
        self.doc["rows"] = rows + [row]
        self.save()

    def save(self) -> None:
        text = json.dumps(self.doc, indent=1) + "\n"
        self.out.write_text(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], self.out.name).write_text(text)

    # one process --------------------------------------------------------------------------------------
    def command(self, flags: list[str]) -> list[str]:
        entry = "megatron_peakflat.testing.pretrain_dryrun" if self.dry_run else "megatron_peakflat.pretrain"
        if self.dry_run and self.cp == 1:
            return [sys.executable, "-m", entry, *flags]
        capped = ["bench.hbm_cap"] if os.environ.get(HBM_CAP_ENV) and not self.dry_run else []
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.cp),
                "--master-port", str(29500 + random.randrange(400)), "-m", *capped, entry, *flags]

    def attempt(self, flags: list[str], env: dict[str, str], iters: int) -> Attempt:
        full_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                    "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1", **self.dtype_env(), **env}
        left = self.deadline - time.monotonic() - DRAIN_S  # a killed run's output is read for up to DRAIN_S more
        if left < 30:
            raise BudgetSpent()
        t0 = time.time()
        cmd = self.command(flags)
        rc, text = self.runner(cmd, full_env, min(self.timeout, left))
        if rc == 124 and left < self.timeout:
            raise BudgetSpent()
        if os.environ.get("OUT") and not self.dry_run:
            Path(os.environ["OUT"], "e2e_last.log").write_text(text[-200_000:])
        return dataclasses.replace(parse(text, rc, time.time() - t0, iters), command=shlex.join(cmd))

    def dtype_env(self) -> dict[str, str]:
        """fp32 training: TF32 off in cuBLAS (``NVIDIA_TF32_OVERRIDE=0``) for every method alike, so that a matmul
        is fp32 whichever library calls it and the same-loss gaps show the methods, not TF32's 10-bit mantissa."""
        return {} if self.model.bf16 else {"NVIDIA_TF32_OVERRIDE": "0"}

    def flags(self, seq: int, stock: Stock, extra: list[str], iters: int, method: str | None = None) -> list[str]:
        spec = TE_FLAGS if self.spec == "te" else ["--transformer-impl", "local", "--peakflat-attention", "sdpa"]
        added = self.extra_flags.get(method, []) if method else []
        cp = ["--context-parallel-size", str(self.cp), *(["--cp-comm-type", "p2p"] if self.spec == "te" else [])] \
            if self.cp > 1 else []
        return [*self.model.flags(seq), *spec, *cp, *stock.flags, *extra, *added, "--train-iters", str(iters)]

    # a length, per method -----------------------------------------------------------------------------
    def case(self, seq: int) -> str:
        return f"seq={seq},spec={self.spec}"

    def measure(self, method: str, seq: int) -> dict[str, Any]:
        """The row of ``method`` at ``seq``, measured now unless the results file holds it."""
        done = self.row(self.case(seq), method)
        if done is not None and done["extra"]["outcome"] != "pending":
            return done
        tried = {a["config"] for a in (done or {"extra": {"attempts": []}})["extra"]["attempts"]}
        if method == "megatron-te":
            stocks = [s for s in LADDER[self._first_stock(seq):] if s.name not in tried]
            extra: list[str] = []
        else:
            stocks = [self._peakflat_base(seq, method)]
            extra = [*method_flags(method), "--peakflat-report-peaks"]
        if method in VARIANTS and not peakflat_flag_exists(TILE_FLAG):
            raise PeakflatConfigError("--methods", method, f"runs peakflat-auto with {TILE_FLAG}, which this version "
                                      "of megatron_peakflat does not define", f"drop {method} from --methods")
        attempts = list((done or {"extra": {"attempts": []}})["extra"]["attempts"])
        row: dict[str, Any] = {}
        for stock in stocks:
            flags = self.flags(seq, stock, extra, self.iters, method)
            print(f"=== {method} seq={seq} config={stock.name}", flush=True)
            a = self.attempt(flags, dict(stock.env), self.iters)
            attempts.append({"config": stock.name, "outcome": a.outcome, "wall_s": a.wall_s,
                             **({"oom": a.oom} if a.oom else {}), **({"tail": a.tail} if a.outcome == "error" else {}),
                             **({"error_lines": a.error_lines} if a.error_lines else {})})
            row = self._row(method, seq, stock, flags, a, attempts)
            print(f"    {a.outcome} in {a.wall_s:.0f} s; peak {row['peak_gib']} GiB, {a.ms} ms/iter (one run)", flush=True)
            if a.outcome in ("ok", "timeout"):
                break
            self.put({**row, "extra": {**row["extra"], "outcome": "pending"}})
        if not row:  # every configuration was tried before this invocation
            row = {**done, "extra": {**done["extra"], "outcome": "oom"}}  # type: ignore[dict-item]
        elif row["extra"]["outcome"] == "error" and any(x["outcome"] == "oom" for x in attempts):
            row["extra"]["outcome"] = "oom"  # the last configuration could not run; the ones before it did not fit
        self.put(row)
        return row

    def _row(self, method: str, seq: int, stock: Stock, flags: list[str], a: Attempt,
             attempts: list[dict[str, Any]]) -> dict[str, Any]:
        mem = a.memory_mib
        top, measured = _measured(seq, a)
        extra: dict[str, Any] = {
            "outcome": a.outcome, "config": stock.name, "attempts": attempts, "iters": self.iters,
            "allocated_after_gib": round(mem["allocated"] / 1024, 3) if mem else None,
            "planner_gib": self._planner_gib(method, flags, a), **measured,
            **({"error_lines": a.error_lines} if a.error_lines else {}), **self._added(method),
        }
        return one_run({"case": self.case(seq), "method": method, **top, "extra": extra})

    def _added(self, method: str) -> dict[str, Any]:
        """What a row records of ``--extra-flags`` and of the fp32 environment."""
        return {**({"extra_flags": self.extra_flags[method]} if self.extra_flags.get(method) else {}),
                **({"env": self.dtype_env()} if self.dtype_env() else {})}

    def _planner_gib(self, method: str, flags: list[str], a: Attempt) -> float | None:
        """The planner's allocated bytes for this run, as the runtime report compares them: the report's own figure
        where peakflat ran with it, else the planner's baseline column for these flags on this GPU."""
        if "total" in a.peaks:
            return a.peaks["total"][1]
        if method not in ("megatron-te", CONTROL):
            return None
        try:
            from megatron_peakflat.integration.peaks import allocated_prediction
            from megatron_peakflat.planner.build import build
            from megatron_peakflat.planner.model import plan

            hbm = _gpu_bytes() or 80 * GIB
            shape, run, pf, _, _ = build(["--megatron-args", shlex.join(flags), "--gpus", str(self.cp),
                                          "--gpus-per-node", str(self.cp),
                                          "--hbm-gib", repr(hbm / GIB)])
            return round(allocated_prediction(plan(shape, run, pf), "baseline") / GIB, 3)
        except PeakflatConfigError as e:
            print(f"    planner: {e}", flush=True)
            return None

    def _first_stock(self, seq: int) -> int:
        """megatron-te starts from the configuration that fitted the longest shorter length (memory only grows)."""
        best = 0
        for r in self.doc["rows"]:
            m = re.match(r"seq=(\d+),", r["case"])
            if r["method"] == "megatron-te" and m and int(m.group(1)) < seq and r["extra"]["outcome"] == "ok":
                best = max(best, [s.name for s in LADDER].index(r["extra"]["config"]))
        return best

    def _peakflat_base(self, seq: int, method: str) -> Stock:
        """peakflat-auto: megatron-te's configuration at ``seq`` where it trained, else the offloaded one;
        peakflat-all: the offloaded one (OffloadStreamAdamW takes the place of Megatron's offloaded optimizer)."""
        stock = next((s for s in LADDER if s.name == "cpu-offload"))
        te = self.row(self.case(seq), "megatron-te")
        if method in ("peakflat-auto", *VARIANTS) and te is not None and te["extra"]["outcome"] == "ok" \
                and te["extra"]["config"] in PEAKFLAT_BASES:
            stock = next(s for s in LADDER if s.name == te["extra"]["config"])
        return stock

    # the search -----------------------------------------------------------------------------------------
    def reach(self, method: str, lo: int, hi: int, step: int) -> dict[str, Any]:
        """Double from ``lo`` while it trains, then bisect between the last length that trained and the first that
        did not, at ``step`` granularity. A timeout stops the search (the reach is then bounded by time)."""
        ok = max((n for n, o in self.lengths(method).items() if o == "ok" and n < lo), default=0)
        bad, limit = None, "search cap"
        seq = lo
        while seq <= hi:
            outcome = self.measure(method, seq)["extra"]["outcome"]
            if outcome == "ok":
                ok, seq = seq, seq * 2
                continue
            bad, limit = seq, ("time" if outcome == "timeout" else outcome)
            break
        if ok and hi < seq and ok < hi:  # the doubling overshot the cap: try the cap itself
            bad = hi + step
        while bad is not None and limit != "time" and bad - ok > step:
            mid = max(ok + step, min(bad - step, (ok + bad) // 2 // step * step))
            outcome = self.measure(method, mid)["extra"]["outcome"]
            if outcome == "ok":
                ok = mid
            elif outcome == "timeout":
                limit = "time"
                break
            else:
                bad = mid
        return self.reach_row(method, {"min": lo, "max": hi, "step": step}, time_bound=limit == "time")

    def reach_lengths(self, method: str, lengths: list[int]) -> dict[str, Any]:
        """``method`` at each of ``lengths`` (shortest first, instead of the doubling search), stopping at the first
        that does not train; then the reach row from every row measured."""
        for seq in sorted(lengths):
            if self.measure(method, seq)["extra"]["outcome"] != "ok":
                break
        search = {"min": min(lengths), "max": max(lengths), "step": 0, "lengths": sorted(lengths)}
        return self.reach_row(method, search)

    def lengths(self, method: str) -> dict[int, str]:
        """Each length measured for ``method`` and its outcome ('ok', 'oom', 'refused', 'error', 'timeout',
        'pending')."""
        out = {}
        for r in self.doc["rows"]:
            m = re.match(r"seq=(\d+),spec=" + re.escape(self.spec) + "$", r["case"])
            if m and r["method"] == method:
                out[int(m.group(1))] = r["extra"]["outcome"]
        return out

    def reach_row(self, method: str, search: dict[str, int] | None = None, time_bound: bool = False) -> dict[str, Any]:
        """The reach row, derived from the rows measured: the longest length that trained, what stopped the search
        above it (the first length that did not fit, a timeout, or the search's cap) and any length left unfinished."""
        seen = self.lengths(method)
        ok = max((n for n, o in seen.items() if o == "ok"), default=0)
        above = sorted((n, o) for n, o in seen.items() if n > ok and o != "ok")
        failing = next((n for n, o in above if o in FAILED), None)
        if time_bound or any(o == "timeout" for _, o in above):
            limit = "time"
        elif failing is not None:
            limit = f"{seen[failing]} at {failing}"
        else:
            limit = "search cap" if search is None or ok >= search["max"] or not above else "unfinished"
        row = {"case": f"reach,spec={self.spec}", "method": method, "peak_gib": None, "ms": None, "exact": None,
               "reach_tokens": ok, "extra": {"limited_by": limit, "first_failing": failing,
                                             "unfinished": [n for n, o in above if o == "pending"],
                                             "search": search or self._search_of(method),
                                             "card": ", ".join(sorted(self._cards(method))) or None}}
        self.put(row)
        print(f"=== reach {method}: {ok} tokens (limited by {limit})", flush=True)
        return row

    def _cards(self, method: str) -> set[str]:
        """The cards the method's length rows ran on (a reach is only read off rows of one card)."""
        return {r["extra"].get("card", "?") for r in self.doc["rows"]
                if r["method"] == method and re.match(r"seq=\d+,spec=" + re.escape(self.spec) + "$", r["case"])}

    def _search_of(self, method: str) -> dict[str, int] | None:
        old = self.row(f"reach,spec={self.spec}", method)
        return old["extra"].get("search") if old else None

    def stock_at(self, seq: int, method: str) -> Stock:
        """The stock configuration ``method`` ran on at ``seq`` in the search: megatron-te's own where it trained
        there (else the optimizer on the GPU), peakflat's as ``_peakflat_base`` picks it."""
        if method != "megatron-te":
            return self._peakflat_base(seq, method)
        te = self.row(self.case(seq), "megatron-te")
        if te is None or te["extra"]["outcome"] != "ok":
            return LADDER[0]
        return next(s for s in LADDER if s.name == te["extra"]["config"])

    def _control_stock(self, seq: int) -> Stock:
        """The control: megatron-te in its other memory configuration that computes the same training step
        (the optimizer offloaded where megatron-te keeps it on the GPU, else on the GPU)."""
        name = "cpu-offload" if self.stock_at(seq, "megatron-te").name == "gpu-optimizer" else "gpu-optimizer"
        return next(s for s in LADDER if s.name == name)

    def _fixed(self, case: str, method: str, stock: Stock, flags: list[str], iters: int) -> Attempt:
        """One process of ``method`` on ``stock``, its row written under ``case`` (kept when already there)."""
        done = self.row(case, method)
        if done is not None and done["extra"]["outcome"] != "pending":
            return Attempt(done["extra"]["outcome"], 0, done["extra"]["losses"], done["extra"]["grad_norms"],
                           done["ms"], {}, {}, {}, None, "")
        print(f"=== {case}: {method} config={stock.name}", flush=True)
        a = self.attempt(flags, dict(stock.env), iters)
        top, measured = _measured(int(re.search(r"seq=(\d+)", case).group(1)), a)
        self.put({"case": case, "method": method, **top,
                  "extra": {"outcome": a.outcome, "config": stock.name, "iters": iters, **measured,
                            "planner_gib": self._planner_gib(method, flags, a),
                            **({"tail": a.tail} if a.outcome != "ok" else {}), **({"oom": a.oom} if a.oom else {}),
                            **({"error_lines": a.error_lines} if a.error_lines else {}), **self._added(method)}})
        print(f"    {a.outcome} in {a.wall_s:.0f} s: {a.ms} ms/iter, losses {a.losses[:2]}...{a.losses[-2:]}",
              flush=True)
        return a

    def same_loss_case(self, seq: int, iters: int) -> str:
        """The same-loss case: its length, spec and iterations, then ``dtype`` and ``lr`` where either differs from
        the bf16 run at the default learning rate (whose rows keep the shorter name)."""
        case = f"same_loss,seq={seq},spec={self.spec},iters={iters}"
        dtype = "bf16" if self.model.bf16 else "fp32"
        if dtype != "bf16" or self.model.lr != DEFAULT_LR:
            case += f",dtype={dtype}"
        if self.model.lr != DEFAULT_LR:
            case += f",lr={self.model.lr:g}"
        return case

    def same_loss(self, seq: int, iters: int) -> None:
        """The three methods, and in bf16 megatron-te's control, at one length for ``iters`` iterations with
        ``--deterministic-mode``; each one's largest relative loss and grad-norm difference against megatron-te.
        The control (megatron-te in another of its own configurations) is the spread that bf16 rounding alone
        gives between two computations of the same step: a method within it is as exact as Megatron is with itself.
        In fp32 (TF32 off) rounding hides far less: each gap is recorded beside ``FP32_TARGETS``."""
        case = self.same_loss_case(seq, iters)
        runs: dict[str, Attempt] = {}
        methods = [*METHODS, CONTROL] if self.model.bf16 else list(METHODS)
        if self.dry_run and CONTROL in methods and self._control_stock(seq).name == "cpu-offload":
            print("    no control in a dry run: Megatron's offloaded optimizer needs CUDA", flush=True)
            methods.remove(CONTROL)
        for method in methods:
            stock = self._control_stock(seq) if method == CONTROL else self.stock_at(seq, method)
            te = self.row(case, "megatron-te")
            if method in ("peakflat-auto", *VARIANTS) and te is not None and te["extra"]["outcome"] == "ok" \
                    and te["extra"]["config"] in PEAKFLAT_BASES:  # megatron-te's configuration in this very case
                stock = next(s for s in LADDER if s.name == te["extra"]["config"])
            flags = self.flags(seq, stock, [*method_flags(method), "--deterministic-mode"], iters, method)
            runs[method] = self._fixed(case, method, stock, flags, iters)
            if method == "megatron-te" and runs[method].outcome != "ok":
                if not self.model.bf16 and self.spec == "te":
                    print("    megatron-te did not train in fp32 on Transformer Engine's layers (its error is in the "
                          "row's error_lines): run this phase with --spec local", flush=True)
                print("    nothing to compare with: the other methods are not run", flush=True)
                break
        ref = runs["megatron-te"]
        control = None
        if ref.losses and CONTROL in runs and runs[CONTROL].losses:
            control = loss_gap(ref.losses, runs[CONTROL].losses)
            row = self.row(case, CONTROL)
            row["extra"]["vs_megatron_te"] = {"loss": control,
                                              "grad_norm": loss_gap(ref.grad_norms, runs[CONTROL].grad_norms)}
            self.put(row)
            print(f"    control ({row['extra']['config']}) vs megatron-te: loss {control}", flush=True)
        for method in METHODS[1:]:
            row = self.row(case, method)
            if row is None or not ref.losses or not runs[method].losses:
                continue
            loss, norm = loss_gap(ref.losses, runs[method].losses), loss_gap(ref.grad_norms, runs[method].grad_norms)
            complete = loss["iterations"] == iters and loss["max_rel_diff"] is not None
            row["extra"]["vs_megatron_te"] = {"loss": loss, "grad_norm": norm}
            if self.model.bf16:
                row["exact"] = bool(complete and loss["max_rel_diff"] <= 5e-4)
            else:
                within = bool(complete and norm["max_rel_diff"] is not None
                              and loss["max_rel_diff"] <= FP32_TARGETS["loss"]
                              and norm["max_rel_diff"] <= FP32_TARGETS["grad_norm"])
                row["exact"] = within
                row["extra"]["targets"] = dict(FP32_TARGETS)
                row["extra"]["within_targets"] = within
            if control is not None and control["max_rel_diff"] is not None:
                row["extra"]["within_control"] = bool(complete and loss["max_rel_diff"] <= control["max_rel_diff"])
            self.put(row)
            print(f"    {method} vs megatron-te: loss {loss}, grad norm {norm}", flush=True)

    def timing(self, seqs: int | list[int], methods: list[str], iters: int, repeats: int = 1) -> None:
        """Each method at each length of ``seqs`` for ``iters`` iterations, ``repeats`` times, each run its own
        process, the methods in turn (so a drift of the GPU's clocks falls on each alike). megatron-te takes the
        fastest of its configurations that fits there (the one it trained with in the search, else it climbs its
        ladder on the first run); the others take theirs from it (``_peakflat_base``); a length where megatron-te
        fits in none is skipped. A run's time is the median of all its iterations but the first, so one-time costs
        (allocator growth, the first offloaded step) stay out of it; the row's ``ms`` is the median of the runs,
        each in ``extra.runs_ms``, their (max - min) / median in ``extra.spread``."""
        for seq in [seqs] if isinstance(seqs, int) else seqs:
            case = f"time,seq={seq},spec={self.spec},iters={iters}"
            order = sorted(methods, key=lambda m: (m != "megatron-te", ALL_METHODS.index(m)))
            for r in range(repeats):
                for method in order:
                    if method != "megatron-te" and "megatron-te" in order and not self._timed_ok(case, "megatron-te"):
                        break  # megatron-te fits in none of its configurations here: nothing to compare with
                    self._time_run(case, seq, method, iters, repeats)
            if "megatron-te" in order and not self._timed_ok(case, "megatron-te"):
                print(f"    {seq}: megatron-te fits in none of its configurations; the others are not timed here",
                      flush=True)
                continue
            self._time_ratios(case, order)

    def _timed_ok(self, case: str, method: str) -> bool:
        row = self.row(case, method)
        return row is not None and bool(row["extra"].get("runs_ms"))

    def _time_run(self, case: str, seq: int, method: str, iters: int, repeats: int) -> None:
        """One more run of ``method`` in ``case`` unless its row has ``repeats`` runs (or ended in a failure)."""
        row = self.row(case, method)
        if row is not None and "runs" not in row["extra"]:
            row = None  # a row of one run, written before rows kept their runs: measured again
        runs = list(row["extra"]["runs"]) if row else []
        if len(runs) >= repeats or (row and row["extra"]["outcome"] not in ("ok", "pending")):
            return
        attempts = list(row["extra"].get("attempts", [])) if row else []
        if method == "megatron-te":
            if row and row["extra"].get("config"):
                stocks = [next(s for s in LADDER if s.name == row["extra"]["config"])]
            else:
                searched = self.row(self.case(seq), "megatron-te")
                if searched and searched["extra"]["outcome"] == "ok":
                    stocks = [self.stock_at(seq, method)]
                else:
                    tried = {x["config"] for x in attempts}
                    stocks = [s for s in LADDER[self._first_stock(seq):] if s.name not in tried]
            extra: list[str] = []
        else:
            te = self.row(case, "megatron-te")
            if te is not None and te["extra"].get("runs_ms") and te["extra"]["config"] in PEAKFLAT_BASES \
                    and method in ("peakflat-auto", *VARIANTS):
                stocks = [next(s for s in LADDER if s.name == te["extra"]["config"])]
            else:
                stocks = [self._peakflat_base(seq, method)]
            extra = [*method_flags(method), "--peakflat-report-peaks"]
        a, stock, flags = None, stocks[0], []
        for stock in stocks:
            flags = self.flags(seq, stock, extra, iters, method)
            print(f"=== {case}: {method} config={stock.name} run {len(runs) + 1} of {repeats}", flush=True)
            a = self.attempt(flags, dict(stock.env), iters)
            if not runs:
                attempts.append({"config": stock.name, "outcome": a.outcome, "wall_s": a.wall_s,
                                 **({"oom": a.oom} if a.oom else {}),
                                 **({"error_lines": a.error_lines} if a.error_lines else {})})
            print(f"    {a.outcome} in {a.wall_s:.0f} s: {a.ms} ms/iter", flush=True)
            if a.outcome != "oom":
                break
        if a is None:
            return
        top, measured = _measured(seq, a)
        if a.outcome == "ok":
            runs.append({"ms": a.ms, "iter_ms": a.iter_ms, "peak_gib": top["peak_gib"], "wall_s": a.wall_s,
                         "command": a.command, "losses": a.losses})
        outcome = ("ok" if len(runs) >= repeats else "pending") if a.outcome == "ok" else a.outcome
        out = {"case": case, "method": method, **top, "extra": {
            **measured, "outcome": outcome, "config": stock.name, "iters": iters, "repeats": repeats,
            "planner_gib": self._planner_gib(method, flags, a),
            "runs": runs, "attempts": attempts, **self._added(method),
            **({"error_lines": a.error_lines} if a.error_lines else {}),
            **({"tail": a.tail} if a.outcome not in ("ok", "oom") else {})}}
        if runs:
            ms = [x["ms"] for x in runs]
            out["ms"] = round(statistics.median(ms), 3)
            out["peak_gib"] = max((x["peak_gib"] for x in runs if x["peak_gib"] is not None), default=None)
            out["extra"]["runs_ms"] = ms
            out["extra"]["spread"] = round((max(ms) - min(ms)) / statistics.median(ms), 4) if ms else None
            out["extra"]["tokens_per_s"] = round(seq / (out["ms"] / 1000), 1)
        self.put(out)

    def _time_ratios(self, case: str, methods: list[str]) -> None:
        """Each method's tokens/s against megatron-te's, between medians of one card, with the range the runs give
        (``harness.ratio_checks``): a range that holds 1.0x is flagged, the runs not telling the two apart."""
        from bench.harness import ratio_checks

        base = self.row(case, "megatron-te")
        if base is None or not base["ms"]:
            return
        for method in methods:
            row = self.row(case, method)
            if method == "megatron-te" or row is None or not row["ms"]:
                continue
            checks = ratio_checks([row, base], ours=lambda m, me=method: m == me, peers=lambda m: m == "megatron-te")
            if not checks:
                row["extra"].pop("tokens_per_s_vs_megatron_te", None)
                self.put(row)
                continue  # a ratio only between rows of one card
            c = checks[0]
            row["extra"]["tokens_per_s_vs_megatron_te"] = round(base["ms"] / row["ms"], 3)
            row["extra"]["tokens_per_s_vs_megatron_te_range"] = [round(1 / c.high, 3), round(1 / c.low, 3)]
            row["extra"]["overlaps_1x"] = c.overlaps_one
            row["extra"]["megatron_te_config"] = base["extra"]["config"]
            self.put(row)
            print(f"    {method}: {row['extra']['tokens_per_s_vs_megatron_te']}x megatron-te's tokens/s at "
                  f"{case} (range {row['extra']['tokens_per_s_vs_megatron_te_range']}"
                  f"{', overlaps 1.0x' if c.overlaps_one else ''}; megatron-te on {base['extra']['config']})",
                  flush=True)

    def time_summary(self) -> list[Any]:
        """Print the time rows' ratios (``harness.print_ratio_summary``: ours against megatron-te, one card) and
        return the checks."""
        from bench.harness import print_ratio_summary

        rows = [r for r in self.doc["rows"] if r["case"].startswith("time,")]
        return print_ratio_summary(rows, peers=lambda m: m == "megatron-te")


def _measured(seq: int, a: Attempt) -> tuple[dict[str, Any], dict[str, Any]]:
    """What every row of one process records: its peak and time (the row's own fields), and for ``extra`` its
    tokens/s, reserved memory, peak report, losses, grad norms, wall time, command, where it ran and, under
    ``--peakflat auto``, the decision."""
    mem = a.memory_mib
    top = {"peak_gib": round(mem["max_allocated"] / 1024, 3) if mem else None,
           "ms": a.ms if a.outcome == "ok" else None, "exact": None}
    extra = {"tokens_per_s": round(seq / (a.ms / 1000), 1) if a.ms and a.outcome == "ok" else None,
             "reserved_gib": round(mem["max_reserved"] / 1024, 3) if mem else None,
             "component_peaks_gib": a.peaks or None, "losses": a.losses, "grad_norms": a.grad_norms,
             "wall_s": a.wall_s, "command": a.command, **_where(),
             **({"auto": a.auto} if a.auto else {})}
    return top, extra


def one_run(row: dict[str, Any]) -> dict[str, Any]:
    """A row measured by one process (a reach length): its time moves from ``ms`` to ``extra.one_run_ms`` and its
    tokens/s to ``extra.one_run_tokens_per_s``, because a timing is the median of at least three runs (the time
    phase's rows); its peak stays, since the peak is what the reach measures. Idempotent."""
    extra = row["extra"]
    if row.get("ms") is not None:
        extra["one_run_ms"] = row["ms"]
    if extra.get("tokens_per_s") is not None:
        extra["one_run_tokens_per_s"] = extra["tokens_per_s"]
    row["ms"], extra["tokens_per_s"] = None, None
    return row


HBM_CAP_ENV = "PEAKFLAT_BENCH_HBM_GIB"
"""Set by ``--hbm-cap-gib``: every run goes through ``bench.hbm_cap``, which holds the allocator to that many GiB."""


def _gpu_bytes() -> int | None:
    try:
        import torch

        total = int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None
    cap = os.environ.get(HBM_CAP_ENV)
    return min(total, int(float(cap) * GIB)) if total is not None and cap else total


_WHERE: dict[str, Any] = {}


def _where() -> dict[str, Any]:
    """Where a row ran: the harness's card and commit (``where_ran``), the host's cores, torch's version, the
    keys from which the SDPA attention runs one call per K/V head (``attention.calls``), that the tiled
    sublayer does the same with Transformer Engine's attention (``te_tile_kv_head_calls``; rows without it ran one
    TE call per tile) and that the SDPA attention copies views of the packed QKV output
    (``sdpa_copies_packed_views``; rows without it saved v's view), kept in every row, so merged files keep them:
    the planner needs them to plan the row's run as it ran. ``iteration_2_own``: iteration 2's time is its own
    (``iteration_ms``); rows without it took Megatron's figure, the mean of iterations 1 and 2."""
    if not _WHERE:
        import torch

        from bench.harness import where_ran
        from megatron_peakflat.attention.calls import GROUPED_CALL_MIN_KEYS

        ran = where_ran()
        _WHERE.update(card=ran["card"], host_threads=os.cpu_count(), commit=ran["commit"], torch=torch.__version__,
                      grouped_call_min_keys=GROUPED_CALL_MIN_KEYS, te_tile_kv_head_calls=True,
                      sdpa_copies_packed_views=True, iteration_2_own=True)
        if os.environ.get(HBM_CAP_ENV):
            _WHERE["hbm_cap_gib"] = float(os.environ[HBM_CAP_ENV])
    return dict(_WHERE)


def plot(doc: dict[str, Any], path: Path) -> bool:
    """Peak memory and tokens/s against the sequence length, one line per method, OOM marked; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    cards = sorted({r["extra"].get("card", "?") for r in doc["rows"] if r["case"].startswith("seq=")})
    length = re.compile(r"seq=(\d+),spec=[a-z]+$")  # the current code's rows (not a superseded one's)
    for method in ALL_METHODS:
        rows = sorted(((int(length.match(r["case"]).group(1)), r) for r in doc["rows"]
                       if r["method"] == method and length.match(r["case"])), key=lambda x: x[0])
        ok = [(s, r) for s, r in rows if r["extra"]["outcome"] == "ok"]
        if ok:
            line, = top.plot([s for s, _ in ok], [r["peak_gib"] for _, r in ok], marker="o", label=method)
            for s, r in ok:
                top.annotate(r["extra"]["config"], (s, r["peak_gib"]), fontsize=6, textcoords="offset points",
                             xytext=(0, 5), ha="center", color=line.get_color())
            bottom.plot([s for s, _ in ok], [r["extra"].get("one_run_tokens_per_s") for _, r in ok], marker="o",
                        color=line.get_color(), label=f"{method}, one run")
            color = line.get_color()
        else:
            color = None
        timed = [(int(re.match(r"time,seq=(\d+)", r["case"]).group(1)), r) for r in doc["rows"]
                 if r["method"] == method and r["case"].startswith("time,") and r["extra"]["outcome"] == "ok"
                 and r["extra"].get("runs_ms")]
        if timed:
            tps = [[s * 1000 / ms for ms in r["extra"]["runs_ms"]] for s, r in timed]
            mid = [r["extra"]["tokens_per_s"] for _, r in timed]
            bottom.errorbar([s for s, _ in timed], mid, fmt="*", markersize=11, color=color, capsize=3,
                            yerr=[[m - min(t) for m, t in zip(mid, tps)], [max(t) - m for m, t in zip(mid, tps)]],
                            label=f"{method}, median and range of {len(tps[0])} runs")
        failed = [s for s, r in rows if r["extra"]["outcome"] in FAILED]
        if failed:
            top.scatter(failed, [0] * len(failed), marker="x", color=color, label=f"{method}: did not fit")
    reach = {r["method"]: r["reach_tokens"] for r in doc["rows"] if r["case"].startswith("reach,")}
    top.set_title(f"{doc.get('model', {}).get('layers', '?')}-layer gpt-oss-20b-shaped MoE, one {', '.join(cards)}\n"
                  "longest trained: " + ", ".join(f"{m} {n // 1024}K" for m, n in reach.items()), fontsize=10)
    top.set_ylabel("max allocated, GiB")
    bottom.set_ylabel("tokens / s (lines: iteration 2 of one run)")
    bottom.set_xlabel("tokens per sequence")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_bytes(path.read_bytes())
    return True


def tokens(text: str) -> int:
    """A length in tokens: ``8192``, ``8K``, ``1M`` (binary: 1K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length in tokens (e.g. 8192, 8K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]


def tokens_list(text: str) -> list[int]:
    """Comma-separated lengths in tokens (``8K,16K,1M``)."""
    return [tokens(t) for t in text.split(",") if t.strip()]


def method_flag_pairs(items: list[str], known: tuple[str, ...]) -> dict[str, list[str]]:
    """``--extra-flags METHOD=FLAGS`` items as {method: flags}, FLAGS split as a shell would; repeated methods add."""
    out: dict[str, list[str]] = {}
    for item in items:
        method, sep, flags = item.partition("=")
        if not sep or method not in known:
            raise argparse.ArgumentTypeError(
                f"--extra-flags {item!r}: expected METHOD=FLAGS with METHOD one of {', '.join(known)}, "
                "e.g. --extra-flags \"peakflat-auto=--peakflat-dispatch-chunk-cap 32768\"")
        out.setdefault(method, []).extend(shlex.split(flags))
    return out


BACKGROUND_DIR = Path("/tmp/peakflat_e2e_background")
"""Where ``--background`` keeps its results file, log and process record: outside the repository, so that a fresh
copy of the working tree (a remote machine's next command) leaves a running length and its rows alone."""


def run_record(out: Path, where: Path) -> Path:
    """The background run's process record (pid, start, command): a file of its own beside the results file, which
    the run rewrites row by row."""
    return where / f"{out.stem}.run.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def background(argv: list[str], out: Path, where: Path) -> int:
    """Start this command, less ``--background``, as a detached process (its own session: it outlives the shell
    that started it) writing its rows into ``where/<out name>``, seeded from ``out``; its log and pid in ``where``.
    Refused while an earlier one on the same results file still runs."""
    import shutil
    import subprocess

    where.mkdir(parents=True, exist_ok=True)
    record, log, results = run_record(out, where), where / f"{out.stem}.log", where / out.name
    if record.exists():
        old = json.loads(record.read_text())
        if _alive(old["pid"]):
            print(f"a background run on {out.name} is still going (pid {old['pid']}, started {old['started']}): "
                  f"see python3 bench/e2e.py --collect --out {out.name}", flush=True)
            return 1
    if out.exists() and not results.exists():
        shutil.copy(out, results)
    child = [a for a in argv if a != "--background"]
    child = [*_without_option(child, "--out"), "--out", str(results)]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # $OUT belongs to the command that started it
    with open(log, "ab") as fh:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *child], cwd=ROOT, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    record.write_text(json.dumps({"pid": proc.pid, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                  "argv": child, "log": str(log), "results": str(results)}, indent=1) + "\n")
    print(f"started in the background: pid {proc.pid}, log {log}, rows into {results}; "
          f"python3 bench/e2e.py --collect --out {out.name} reads them", flush=True)
    return 0


def collect(out: Path, where: Path, lines: int = 25) -> int:
    """What a ``--background`` run has done: whether it still runs, its log's last lines, and every row of its
    results file (copied to ``out`` and to $OUT). Exit status 0 once it has ended, 3 while it runs, 1 without one."""
    record, results = run_record(out, where), where / out.name
    if not record.exists():
        print(f"no background run on {out.name} in {where}", flush=True)
        return 1
    info = json.loads(record.read_text())
    running = _alive(info["pid"])
    print(f"background run pid {info['pid']} (started {info['started']}): {'running' if running else 'ended'}")
    log = Path(info["log"])
    if log.exists():
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:]), end="", flush=True)
    if results.exists():
        text = results.read_text()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], out.name).write_text(text)
            if log.exists():
                Path(os.environ["OUT"], log.name).write_text(log.read_text(errors="replace")[-200_000:])
        for r in json.loads(text)["rows"]:
            if r["case"].startswith(("seq=", "reach,")):
                outcome = r["extra"].get("outcome", r["extra"].get("limited_by"))
                ms = r["ms"] or r["extra"].get("one_run_ms")
                reach = f" reach {r['reach_tokens']}" if "reach_tokens" in r else ""
                print(f"  {r['case']:24s} {r['method']:16s} {outcome!s:10s} peak {r['peak_gib']} GiB {ms} ms/iter{reach}")
        print(f"wrote {out}", flush=True)
    return 3 if running else 0


def _without_option(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if not a.startswith(flag + "="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, local spec: exercise the driver")
    ap.add_argument("--phases", default="reach,same-loss,plot",
                    help="any of reach, same-loss, time (each method at --time-seqs for --time-iters iterations, "
                         "--repeats times), summary (the reach rows from the rows already measured and the time "
                         "ratios, running nothing), plot (comma separated)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"which methods to run, of {', '.join(ALL_METHODS)} (default: %(default)s)")
    ap.add_argument("--extra-flags", action="append", default=[], metavar="METHOD=FLAGS",
                    help="flags appended to METHOD's command line, recorded in its rows (repeatable), e.g. "
                         "\"peakflat-auto=--peakflat-dispatch-chunk-cap 32768\"")
    ap.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                    help="context-parallel size: every length on this many GPUs of one host (TE: --cp-comm-type p2p); "
                         "rows record the GPU count; default results file e2e_cp<N>.json (default: 1)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the model (default: 2)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="bf16 (--bf16) or fp32 (no --bf16, TF32 off: NVIDIA_TF32_OVERRIDE=0), for every method")
    ap.add_argument("--fp32", dest="dtype", action="store_const", const="fp32", help="the same as --dtype fp32")
    ap.add_argument("--spec", choices=["te", "local"], default=None,
                    help="te: Transformer Engine's layers; local: Megatron's local spec with the SDPA attention for "
                         "every method (default: te when Transformer Engine imports)")
    ap.add_argument("--min-seq", type=tokens, default=None, help="first length (default: 8K; dry run 64)")
    ap.add_argument("--max-seq", type=tokens, default=None, help="last length (default: 1M; dry run 128)")
    ap.add_argument("--granularity", type=tokens, default=None, help="bisection step (default: 8K; dry run 64)")
    ap.add_argument("--lengths", type=tokens_list, default=None,
                    help="reach: these lengths only (e.g. 512K,768K,1M), shortest first, in place of the search")
    ap.add_argument("--same-loss-seq", type=tokens, default=None, help="default: --min-seq")
    ap.add_argument("--same-loss-iters", type=int, default=None, help="default: 50; dry run 3")
    ap.add_argument("--time-seqs", type=tokens_list, default=None,
                    help="the time phase's lengths (default: 8K,16K,32K,48K; dry run 64)")
    ap.add_argument("--time-seq", type=tokens, default=None, help="one length for the time phase (overrides --time-seqs)")
    ap.add_argument("--time-iters", type=int, default=5, help="the time phase's iterations (default: 5)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="time phase: runs of each method at each length, each its own process, the methods in turn; "
                         "ms is their median (default: 3)")
    ap.add_argument("--timeout", type=float, default=480, help="seconds one length may take (default: 480)")
    ap.add_argument("--hbm-cap-gib", type=float, default=None,
                    help="emulate a card with this much memory: each run's allocator is held to it and the planner "
                         "sees it (bench/hbm_cap.py); rows record the cap beside the real card")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR, help="peak learning rate (default: 3e-4; min-lr a tenth of it)")
    ap.add_argument("--lr-warmup-iters", type=int, default=1, help="warm-up iterations (default: 1)")
    ap.add_argument("--iters", type=int, default=2,
                    help="iterations per length (default: 2): it trains when all do, and its time is the median of "
                         "all but the first, so more than 2 give a time with less of the one-time costs")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds this invocation may run: a length that would run past it is left for the next "
                         "invocation, which resumes from the rows written (default: no limit)")
    ap.add_argument("--background", action="store_true",
                    help="start this command as a detached process (its own session) and return at once; its rows go "
                         "into --background-dir, which --collect reads (for a length longer than one shell command)")
    ap.add_argument("--collect", action="store_true",
                    help="print what the --background run on --out has done and copy its results file to "
                         "bench/results and $OUT (exit status 3 while it still runs)")
    ap.add_argument("--background-dir", type=Path, default=BACKGROUND_DIR, help=f"default: {BACKGROUND_DIR}")
    ap.add_argument("--out", default=None, help="results file name under bench/results (default: e2e.json; dry run "
                                                "e2e_dryrun.json)")
    a = ap.parse_args(raw)
    if a.hbm_cap_gib is not None:
        if a.hbm_cap_gib <= 0:
            ap.error(f"--hbm-cap-gib {a.hbm_cap_gib}: a card holds a positive number of GiB")
        os.environ[HBM_CAP_ENV] = repr(a.hbm_cap_gib)  # the runs inherit it; bench.hbm_cap reads it
    dry = a.dry_run
    if a.cp < 1:
        ap.error(f"--cp {a.cp}: pass 1 or more")
    suffix = f"_cp{a.cp}" if a.cp > 1 else ""
    out = RESULTS / (a.out or (f"e2e_dryrun{suffix}.json" if dry else f"e2e{suffix}.json"))
    if a.collect:
        return collect(RESULTS / out.name, a.background_dir)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    phases = {p.strip() for p in a.phases.split(",") if p.strip()}
    unknown = sorted(set(methods) - set(ALL_METHODS)) + sorted(phases - {"reach", "same-loss", "time", "summary", "plot"})
    if unknown:
        ap.error(f"unknown method or phase: {', '.join(unknown)}")
    missing = missing_variant_flags(methods)
    if missing:
        ap.error("; ".join(missing))
    try:
        extra_flags = method_flag_pairs(a.extra_flags, ALL_METHODS + (CONTROL,))
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: pass 1 or more (3 or more for a time whose spread is known)")
    if min(a.iters, a.time_iters) < 2:
        ap.error("--iters and --time-iters must be at least 2 (the first iteration is not timed)")
    runs = {"reach": ("--iters", a.iters), "same-loss": ("--same-loss-iters", a.same_loss_iters or (3 if dry else 50)),
            "time": ("--time-iters", a.time_iters)}
    for flag, n in (runs[p] for p in sorted(phases & runs.keys())):
        if a.lr_warmup_iters >= n:
            ap.error(f"--lr-warmup-iters {a.lr_warmup_iters}: Megatron needs fewer warm-up iterations than the "
                     f"{n} of {flag}; lower --lr-warmup-iters below {n}, or run that phase in its own invocation")
    if a.background:
        return background(raw, out, a.background_dir)
    kept = json.loads(out.read_text()).get("spec") if out.exists() else None  # a later invocation resumes that spec
    spec = a.spec or kept or ("local" if dry or not _te_importable() else "te")
    lo = a.min_seq or (64 if dry else 8192)
    hi = a.max_seq or (128 if dry else 1024**2)
    step = a.granularity or (64 if dry else 8192)
    model = TINY if dry else Model(layers=a.layers)
    bad = [n for n in [lo, hi, step, *(a.lengths or []), *(a.time_seqs or []), *([a.time_seq] if a.time_seq else [])]
           if n % (2 * a.cp)]
    if bad:
        ap.error(f"--cp {a.cp}: every length must divide by 2 x CP = {2 * a.cp} (Megatron's load-balanced chunks); "
                 f"{bad[0]} does not")
    try:
        driver = Driver(out, dataclasses.replace(model, bf16=a.dtype == "bf16", lr=a.lr, warmup=a.lr_warmup_iters),
                        spec, dry, a.timeout, extra_flags=extra_flags, cp=a.cp)
    except PeakflatConfigError as e:
        ap.error(str(e))
    driver.iters = a.iters
    if a.budget is not None:
        driver.deadline = time.monotonic() + a.budget
    driver.doc["commands"] = list(dict.fromkeys(driver.doc["commands"] + ["python3 " + shlex.join(sys.argv)]))
    driver.save()
    try:
        for phase in [p for p in ("reach", "same-loss", "time") if p in phases]:
            if phase == "reach":
                for method in sorted(methods, key=ALL_METHODS.index):  # megatron-te first: the others use its configuration
                    if a.lengths:
                        driver.reach_lengths(method, a.lengths)
                    else:
                        driver.reach(method, lo, hi, step)
            elif phase == "same-loss":
                driver.same_loss(a.same_loss_seq or lo, a.same_loss_iters or (3 if dry else 50))
            else:
                seqs = [a.time_seq] if a.time_seq else (a.time_seqs or ([64] if dry else [8192, 16384, 32768, 49152]))
                driver.timing(seqs, sorted(methods, key=ALL_METHODS.index), a.time_iters, a.repeats)
    except BudgetSpent:
        print(f"--budget spent: run the same command again to resume from the rows in {out}", flush=True)
    if "summary" in phases:
        for method in ALL_METHODS:
            if driver.lengths(method):
                driver.reach_row(method)
    if "summary" in phases or "time" in phases:
        driver.time_summary()
    if "plot" in phases:
        plot(driver.doc, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def _te_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


if __name__ == "__main__":
    sys.exit(main())
