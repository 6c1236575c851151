"""The planner's whole-run prediction against the peak a training run measures, over many model shapes.

Each row is one training run through ``python -m megatron_peakflat.pretrain`` (as ``bench/e2e.py`` runs them): a
model shape, a length, a spec (``te``: Transformer Engine's layers; ``local``: Megatron's local spec with the SDPA
attention) and one of two configurations:

- ``planner``: ``--peakflat auto``, the components and knobs the planner recommends for that run on this card;
- ``planner-megatron``: plain Megatron, no component (only where the planner says it fits).

Every run trains ``--iters`` (3) iterations with ``--log-memory-interval 1``; ``measured_gib`` is the largest
``max allocated`` of Megatron's memory reports over the iterations (``torch.cuda.max_memory_allocated``, so after
the first optimizer step). ``predicted_gib`` is the planner's figure for the same flags, from its library API:
``auto.resolve`` for what ``--peakflat auto`` adds on this card (the flags the run logged it added are used when they
differ), then ``plan`` and ``allocated_prediction`` for the final flags, as the runtime peak report computes it. The
ratio predicted / measured is in ``extra.ratio``; the report's own figure, where it ran, in ``extra.peak_report``.

The shapes (``SHAPES``) are none of the planner's presets nor the e2e model: dense and MoE, many small experts (64 to
256, top-8) and few large ones, GQA ratios 1 to 16, vocabularies 32K to 256K tied and untied, 1 to 4 layers. Each
shape runs at three lengths up to the longest the planner says fits on this card (computed at run time from the card's
memory, for each configuration: ``--peakflat auto`` reaches further than plain Megatron; ``--max-seq`` caps it): a
quarter, a half and all of it.

``--max-minutes`` bounds an invocation: the runs are ordered so that the most informative come first (every shape at
its middle length, then its longest, then its shortest; the ``planner`` rows before the plain ones, TE's spec before
the local one), each row is written as soon as it is measured, and the next invocation resumes from the rows in the
file. The summary prints the worst row on each side and whether every ratio lies in [0.95, 1.10].

    python3 bench/planner_calibration.py --max-minutes 9          # one GPU; run again to go on
    python3 bench/planner_calibration.py --shapes moe-e128-top8 --specs local
    python3 bench/planner_calibration.py --shapes moe-e64-top8 --specs local --methods planner --lengths 64K --rerun
    python3 bench/planner_calibration.py --summary                # the rows already measured, running nothing
    python3 bench/planner_calibration.py --dry-run                # CPU, tiny shapes, the local spec
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.e2e import _te_importable, _where, parse, tokens, tokens_list  # noqa: E402
from bench.pretrain_compare import DRAIN_S, run_in_session  # noqa: E402
from megatron_peakflat.config_base import PeakflatConfigError  # noqa: E402
from megatron_peakflat.testing.pretrain_dryrun import with_cpu_flags  # noqa: E402
from megatron_peakflat.testing.subproc import memory_reports  # noqa: E402

RESULTS = ROOT / "bench" / "results"
GIB = 2**30
BAND = (0.95, 1.10)
"""The ratio predicted / measured that the planner aims for on every row."""
METHODS = ("planner", "planner-megatron")
SPECS = ("te", "local")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model shape in Megatron's flags."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    topk: int = 1
    moe_ffn: int = 0
    tied: bool = False

    def flags(self, seq: int) -> list[str]:
        moe = ["--num-experts", str(self.experts), "--moe-router-topk", str(self.topk),
               "--moe-ffn-hidden-size", str(self.moe_ffn), "--moe-token-dispatcher-type", "alltoall",
               "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"] if self.experts else []
        return [
            "--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
            "--num-attention-heads", str(self.heads),
            *(["--group-query-attention", "--num-query-groups", str(self.kv_heads)] if self.kv_heads != self.heads else []),
            "--kv-channels", str(self.head_dim), "--ffn-hidden-size", str(self.ffn), *moe,
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            *([] if self.tied else ["--untie-embeddings-and-output-weights"]),
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--seed", "1234",
            "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--log-memory-interval", "1",
            "--eval-iters", "0", "--eval-interval", "1000000", "--no-create-attention-mask-in-dataloader",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(self.vocab),
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--use-distributed-optimizer",
        ]


SHAPES = (
    Shape("dense-gqa8-v32k-tied", layers=2, hidden=2048, heads=16, kv_heads=2, head_dim=128, ffn=8192, vocab=32000,
          tied=True),
    Shape("dense-mha-v256k", layers=1, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008, vocab=256000),
    Shape("moe-e64-top8", layers=2, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=4096, vocab=128256,
          experts=64, topk=8, moe_ffn=512),
    Shape("moe-e128-top8", layers=2, hidden=2048, heads=32, kv_heads=2, head_dim=64, ffn=4096, vocab=151552,
          experts=128, topk=8, moe_ffn=384),
    Shape("moe-e256-top8-tied", layers=1, hidden=1536, heads=24, kv_heads=4, head_dim=64, ffn=4096, vocab=65536,
          experts=256, topk=8, moe_ffn=256, tied=True),
    Shape("moe-e8-top2-large", layers=2, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=32768,
          experts=8, topk=2, moe_ffn=14336),
    Shape("moe-e16-top2-gqa16-tied", layers=4, hidden=2048, heads=16, kv_heads=1, head_dim=128, ffn=8192,
          vocab=100352, experts=16, topk=2, moe_ffn=8192, tied=True),
    Shape("dense-4l-v200k", layers=4, hidden=3072, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=200064),
    Shape("moe-e32-top4-mha", layers=3, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=2816, vocab=49152,
          experts=32, topk=4, moe_ffn=1408),
)
"""Nine shapes: none a planner preset's or the e2e model's (``tests/test_planner_calibration.py`` checks)."""

TINY = (
    Shape("tiny-dense-tied", layers=1, hidden=64, heads=4, kv_heads=1, head_dim=16, ffn=128, vocab=1024, tied=True),
    Shape("tiny-moe", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=64, vocab=2048, experts=16, topk=8,
          moe_ffn=32),
)
"""The dry run's shapes: a dense and a MoE model the CPU trains in seconds."""


def spec_flags(spec: str, shape: Shape) -> list[str]:
    if spec == "te":
        return ["--transformer-impl", "transformer_engine",
                *(["--moe-grouped-gemm", "--moe-permute-fusion"] if shape.experts else [])]
    return ["--transformer-impl", "local", "--peakflat-attention", "sdpa"]


def method_flags(method: str) -> list[str]:
    return ["--peakflat", "auto", "--peakflat-report-peaks"] if method == "planner" else []


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the planner is told of this machine: the card's total memory, the node's RAM, the card's SMs."""

    card: str
    hbm_bytes: int
    host_bytes: int
    sm_count: int

    @staticmethod
    def here() -> "Machine":
        """This process's GPU 0 (80 GiB and 132 SMs without one: what ``--peakflat auto`` assumes on CPU)."""
        import torch

        from megatron_peakflat.runtime.machine import mem_total

        host = mem_total() or 2048 * GIB
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return Machine(props.name, int(torch.cuda.mem_get_info(0)[1]), host, props.multi_processor_count)
        return Machine("cpu", 80 * GIB, host, 132)


@dataclasses.dataclass
class Prediction:
    gib: float | None
    which: str
    added: list[str]
    fits: bool
    reason: str = ""


def predict(flags: list[str], machine: Machine, added: list[str] | None = None) -> Prediction:
    """The planner's allocated-bytes peak for a run of ``flags`` on one GPU of ``machine``, as the runtime peak report
    computes it (``allocated_prediction`` of the plan for the final flags). Under ``--peakflat auto``, the final flags
    are ``flags`` with what auto adds on this machine, or with ``added`` where given (what a run logged it added).
    ``fits``: auto found a configuration that fits, or, without auto, the plain run's plan fits."""
    from megatron_peakflat.auto import planner_argv, resolve, wants_auto
    from megatron_peakflat.config import PeakflatConfig
    from megatron_peakflat.integration.peaks import allocated_prediction
    from megatron_peakflat.planner.build import build
    from megatron_peakflat.planner.megatron_args import megatron_parser
    from megatron_peakflat.planner.model import plan

    auto = wants_auto(flags)
    final = list(flags)
    if auto:
        try:
            choice = resolve(flags, gpus=1, gpus_per_node=1, hbm_bytes=machine.hbm_bytes,
                             host_bytes_per_node=machine.host_bytes)
        except PeakflatConfigError as e:
            return Prediction(None, "peakflat", [], False, str(e)[:400])
        added = list(choice.added) if added is None else added
        final = planner_argv(flags, gpus=1, gpus_per_node=1, hbm_bytes=machine.hbm_bytes,
                             host_bytes_per_node=machine.host_bytes)
        final = [*shlex.split(final[0].split("=", 1)[1]), *added]  # planner_argv: ["--megatron-args=<line>", ...]
    shape, run, _, _, _ = build(planner_argv(final, gpus=1, gpus_per_node=1, hbm_bytes=machine.hbm_bytes,
                                             host_bytes_per_node=machine.host_bytes))
    run = dataclasses.replace(run, sm_count=machine.sm_count)
    ns, _ = megatron_parser().parse_known_args(final)
    cfg = PeakflatConfig.from_args(ns, validate=False)
    which = "peakflat" if any(cfg.enabled.values()) else "baseline"
    pl = plan(shape, run, cfg)
    return Prediction(round(allocated_prediction(pl, which) / GIB, 3), which, list(added or []),
                      pl.fits(which) if not auto else True)


def longest_fitting(shape: Shape, spec: str, machine: Machine, cap: int, floor: int = 1024,
                    method: str = "planner") -> int | None:
    """The longest length, of multiples of ``floor`` growing by about 1.5x and 2x up to ``cap``, at which the
    planner says ``method`` fits on ``machine`` (``--peakflat auto`` finds a configuration; plain Megatron's plan
    fits); fitting is taken as monotone in the length. None when not even ``floor`` fits."""
    grid = sorted({n for k in range(0, 40) for n in (floor * 2**k, floor * 3 * 2**k // 2) if floor <= n <= cap}
                  | {cap})
    fits = lambda n: predict([*shape.flags(n), *spec_flags(spec, shape), *method_flags(method)], machine).fits  # noqa: E731
    if not fits(grid[0]):
        return None
    lo, hi = 0, len(grid)  # grid[lo] fits; grid[hi] (if any) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(grid[mid]):
            lo = mid
        else:
            hi = mid
    return grid[lo]


def lengths_of(longest: int, floor: int) -> list[int]:
    """A quarter, a half and all of ``longest``, in multiples of ``floor`` (distinct, shortest first)."""
    return sorted({max(floor, longest // d // floor * floor) for d in (4, 2, 1)})


@dataclasses.dataclass(frozen=True)
class Job:
    shape: Shape
    seq: int
    spec: str
    method: str
    priority: tuple[int, ...]

    @property
    def case(self) -> str:
        return f"shape={self.shape.name},seq={self.seq},spec={self.spec}"


def plan_jobs(shapes: tuple[Shape, ...], specs: list[str], machine: Machine, cap: int, floor: int,
              methods: tuple[str, ...] = METHODS, lengths: list[int] | None = None
              ) -> tuple[list[Job], dict[tuple[str, str, str], int | None]]:
    """Every run, most informative first: each shape at its middle length, then its longest, then its shortest
    (each method's lengths up to the longest the planner says it fits; ``lengths``: those of them, in that order);
    within one, the ``planner`` rows before the plain ones, TE's spec before the local one, the shapes in order.
    Also each (shape, spec, method)'s longest fitting length."""
    jobs, longest = [], {}
    for i, shape in enumerate(shapes):
        for s, spec in enumerate(specs):
            for m, method in enumerate(methods):
                n = longest[(shape.name, spec, method)] = longest_fitting(shape, spec, machine, cap, floor, method)
                if n is None:
                    continue
                if lengths is not None:
                    lens = [seq for seq in lengths if seq <= n]
                    rank = {seq: k for k, seq in enumerate(lens)}
                else:
                    lens = lengths_of(n, floor)
                    rank = {lens[len(lens) // 2]: 0, lens[-1]: 1, lens[0]: 2} if len(lens) == 3 else \
                        {seq: k for k, seq in enumerate(reversed(lens))}
                for seq in lens:
                    jobs.append(Job(shape, seq, spec, method, (rank[seq], m, s, i)))
    return sorted(jobs, key=lambda j: j.priority), longest


class Calibration:
    """Runs jobs and keeps the results file (``runner`` is swapped in tests)."""

    def __init__(self, out: Path, machine: Machine, *, dry_run: bool, iters: int, timeout: float,
                 runner: Callable[[list[str], dict[str, str], float], tuple[int, str]] = run_in_session,
                 rerun: bool = False) -> None:
        self.out, self.machine, self.dry_run, self.iters, self.timeout, self.runner = \
            out, machine, dry_run, iters, timeout, runner
        self.rerun = rerun
        """Measure a job again even where its row is in the file (after a change to the code it measures)."""
        self._done: set[tuple[str, str]] = set()
        self.doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
        self.doc.setdefault("component", "planner_calibration")
        self.doc.setdefault("rows", [])
        self.doc.setdefault("commands", [])

    def pending(self, job: Job) -> bool:
        """Whether ``job`` is still to measure: no row for it, or ``rerun`` and not measured in this invocation."""
        if (job.case, job.method) in self._done:
            return False
        return self.row(job.case, job.method) is None or self.rerun

    def row(self, case: str, method: str) -> dict[str, Any] | None:
        return next((r for r in self.doc["rows"] if r["case"] == case and r["method"] == method), None)

    def put(self, row: dict[str, Any]) -> None:
        self.doc["rows"] = [r for r in self.doc["rows"]
                            if not (r["case"] == row["case"] and r["method"] == row["method"])] + [row]
        self.save()

    def save(self) -> None:
        text = json.dumps(self.doc, indent=1) + "\n"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], self.out.name).write_text(text)

    def command(self, flags: list[str]) -> list[str]:
        if self.dry_run:
            return [sys.executable, "-m", "megatron_peakflat.testing.pretrain_dryrun", *flags]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                "--master-port", str(29500 + random.randrange(400)), "-m", "megatron_peakflat.pretrain", *flags]

    def skip(self, job: Job, why: str, **extra: Any) -> None:
        self.put({"case": job.case, "method": job.method, "predicted_gib": None, "measured_gib": None,
                  "peak_gib": None, "ms": None, "exact": None,
                  "extra": {"outcome": "skipped", "skipped": why, **extra, **_where()}})
        print(f"{job.case:52s} {job.method:17s} skipped: {why}", flush=True)

    def run(self, job: Job, deadline: float) -> bool:
        """Measure ``job`` where it is ``pending``; False when the deadline leaves no time for it (nothing
        written, the next invocation runs it)."""
        if not self.pending(job):
            return True
        if job.spec == "te" and not self.dry_run and not _te_importable():
            self.skip(job, "Transformer Engine is not installed: the te spec needs it")
            return True
        flags = [*job.shape.flags(job.seq), *spec_flags(job.spec, job.shape), *method_flags(job.method),
                 "--train-iters", str(self.iters)]
        planned = with_cpu_flags(flags) if self.dry_run else flags  # what the dry run trains
        before = predict(planned, self.machine)
        if not before.fits:
            self.skip(job, "the planner says plain Megatron does not fit on this card" if job.method != "planner"
                      else f"the planner finds no configuration that fits: {before.reason}",
                      predicted_gib=before.gib, flags=flags)
            return True
        left = deadline - time.monotonic() - DRAIN_S
        if left < 45:
            return False
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
               "PYTHONUNBUFFERED": "1"}
        cmd = self.command(flags)
        print(f"=== {job.case} {job.method}: predicted {before.gib} GiB", flush=True)
        t0 = time.time()
        rc, text = self.runner(cmd, env, min(self.timeout, left))
        if rc == 124 and left < self.timeout:
            print("    stopped by --max-minutes: left for the next invocation", flush=True)
            return False
        a = parse(text, rc, time.time() - t0, self.iters)
        reports = memory_reports(text)
        measured = max((r["max_allocated"] for r in reports.values()), default=None)
        logged_added = a.auto.get("added", "").split() if a.auto.get("added") else []
        pred = before if job.method != "planner" or logged_added == before.added else \
            predict(planned, self.machine, added=logged_added)
        measured_gib = round(measured / 1024, 3) if measured is not None and a.outcome == "ok" else None
        ratio = round(pred.gib / measured_gib, 4) if pred.gib and measured_gib else None
        extra = {**_where(), "outcome": a.outcome, "ratio": ratio, "which": pred.which, "added": pred.added,
                 "card": self.machine.card, "hbm_gib": round(self.machine.hbm_bytes / GIB, 2),
                 "command": shlex.join(cmd), "flags": flags, "iters": self.iters,
                 "max_allocated_by_iteration_gib": {str(k): round(v["max_allocated"] / 1024, 3) for k, v in reports.items()},
                 "wall_s": a.wall_s, "iteration_ms_one_run": a.ms,
                 **({"peak_report": {k: list(v) for k, v in a.peaks.items()}} if a.peaks else {}),
                 **({"auto_logged": a.auto} if a.auto else {}),
                 **({"predicted_before_run_gib": before.gib} if pred is not before else {}),
                 **({"oom": a.oom} if a.oom else {}), **({"error_lines": a.error_lines} if a.error_lines else {})}
        self.put({"case": job.case, "method": job.method, "predicted_gib": pred.gib, "measured_gib": measured_gib,
                  "peak_gib": measured_gib, "ms": None, "exact": None, "extra": extra})  # a memory row: one run is no timing
        self._done.add((job.case, job.method))
        print(f"    {a.outcome} in {a.wall_s:.0f} s: measured {measured_gib} GiB, predicted {pred.gib} GiB, "
              f"ratio {ratio}", flush=True)
        return True


def summary(rows: list[dict[str, Any]], band: tuple[float, float] = BAND) -> dict[str, Any]:
    """The rows with a ratio predicted / measured: how many, the worst under and over 1.0, and whether every one lies
    in ``band``."""
    rated = [r for r in rows if r.get("extra", {}).get("ratio") is not None]
    low = min(rated, key=lambda r: r["extra"]["ratio"], default=None)
    high = max(rated, key=lambda r: r["extra"]["ratio"], default=None)
    outside = [r for r in rated if not band[0] <= r["extra"]["ratio"] <= band[1]]
    return {"rows": len(rated), "lowest": low, "highest": high, "outside": outside,
            "all_in_band": bool(rated) and not outside, "band": band,
            "not_measured": [r for r in rows if r.get("extra", {}).get("ratio") is None]}


def print_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    s = summary(rows)
    name = lambda r: f"{r['case']} {r['method']}: predicted {r['predicted_gib']} / measured {r['measured_gib']} GiB = " \
                     f"{r['extra']['ratio']}"  # noqa: E731
    print(f"planner calibration: {s['rows']} rows with both figures, {len(s['not_measured'])} without")
    if s["lowest"] is not None:
        print(f"  lowest ratio (most under-predicted): {name(s['lowest'])}")
        print(f"  highest ratio (most over-predicted): {name(s['highest'])}")
    print(f"  every ratio in [{s['band'][0]}, {s['band'][1]}]: {'yes' if s['all_in_band'] else 'no'}"
          + (f" ({len(s['outside'])} outside)" if s["outside"] else ""), flush=True)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the local spec, lengths up to --max-seq")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument("--specs", default=None, help="te,local (default: both; dry run local)")
    ap.add_argument("--methods", default=",".join(METHODS), help="default: %(default)s")
    ap.add_argument("--max-seq", type=tokens, default=None, help="longest length considered (default: 1M; dry run 256)")
    ap.add_argument("--lengths", type=tokens_list, default=None,
                    help="only these lengths (e.g. 64K,128K), each where the planner says it fits (default: a quarter, "
                         "a half and all of the longest that fits)")
    ap.add_argument("--rerun", action="store_true",
                    help="measure the chosen runs again, replacing their rows (after a change to the code they "
                         "measure)")
    ap.add_argument("--iters", type=int, default=3, help="iterations per run (default: 3)")
    ap.add_argument("--timeout", type=float, default=480, help="seconds one run may take (default: 480)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="minutes this invocation may run; the next resumes from the rows written (default: no limit)")
    ap.add_argument("--max-runs", type=int, default=None, help="training runs this invocation may start")
    ap.add_argument("--summary", action="store_true", help="print the summary of the rows in the file, running nothing")
    ap.add_argument("--out", default=None, help="results file under bench/results (default: planner_calibration.json; "
                                                "dry run planner_calibration_dryrun.json)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    out = RESULTS / (a.out or ("planner_calibration_dryrun.json" if dry else "planner_calibration.json"))
    if a.summary:
        print_summary(json.loads(out.read_text())["rows"] if out.exists() else [])
        return 0
    pool = TINY if dry else SHAPES
    names = [n.strip() for n in a.shapes.split(",")] if a.shapes else [s.name for s in pool]
    unknown = sorted(set(names) - {s.name for s in pool})
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(s.name for s in pool)}")
    specs = [s.strip() for s in (a.specs or ("local" if dry else ",".join(SPECS))).split(",")]
    methods = tuple(m.strip() for m in a.methods.split(","))
    if set(specs) - set(SPECS) or set(methods) - set(METHODS):
        ap.error(f"--specs takes {', '.join(SPECS)}; --methods takes {', '.join(METHODS)}")
    if a.iters < 2:
        ap.error(f"--iters {a.iters}: at least 2, so that a memory report follows an optimizer step")
    machine = Machine.here()
    cap, floor = a.max_seq or (256 if dry else 1024**2), (64 if dry else 1024)
    t0 = time.monotonic()
    deadline = t0 + a.max_minutes * 60 if a.max_minutes else float("inf")
    cal = Calibration(out, machine, dry_run=dry, iters=a.iters, timeout=a.timeout, rerun=a.rerun)
    cal.doc["commands"] = list(dict.fromkeys(cal.doc["commands"] + ["python3 " + shlex.join(sys.argv)]))
    jobs, longest = plan_jobs(tuple(s for s in pool if s.name in names), specs, machine, cap, floor, methods,
                              a.lengths)
    cal.doc.setdefault("longest_fitting", {})
    for (shape, spec, method), n in longest.items():
        cal.doc["longest_fitting"][f"{shape},spec={spec},method={method},card={machine.card}"] = n
        if n is None:
            print(f"{shape} spec={spec} {method}: the planner finds no length from {floor} that fits on {machine.card}")
    cal.save()
    print(f"{len(jobs)} runs planned on {machine.card} ({machine.hbm_bytes / GIB:.1f} GiB); "
          f"{sum(cal.row(j.case, j.method) is not None for j in jobs)} already in {out.name}", flush=True)
    started = 0
    for job in jobs:
        pending = cal.pending(job)
        if a.max_runs is not None and started >= a.max_runs and pending:
            print(f"--max-runs {a.max_runs} reached: run the same command again to go on", flush=True)
            break
        had = not pending
        if not cal.run(job, deadline):
            print(f"--max-minutes spent after {(time.monotonic() - t0) / 60:.1f} min: run the same command again to "
                  f"go on from the rows in {out.name}", flush=True)
            break
        row = cal.row(job.case, job.method)
        started += int(not had and row is not None and row["extra"]["outcome"] != "skipped")
    print_summary(cal.doc["rows"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
