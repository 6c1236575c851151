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
bisecting at ``--granularity``, up to ``--max-seq``. Every length runs in its own process, so an OOM ends only
that length, and every row is written to the results file as soon as it is measured; a second invocation
resumes from the rows already there. Same loss: the three methods train ``--same-loss-iters`` iterations at
``--same-loss-seq`` with ``--deterministic-mode``; the largest relative difference of the loss and grad norm
against megatron-te is recorded, beside a control: megatron-te in its other optimizer configuration, the spread
that bf16 rounding alone makes between two computations of one training step. Time: each method at
megatron-te's reach (or ``--time-seq``) for ``--time-iters`` iterations on the configuration it trained with
there, timed as the median of all iterations but the first. ``--dry-run`` runs the whole driver on CPU with tiny
shapes (Megatron's local spec through the CPU shim) and writes ``e2e_dryrun.json``.

    python3 bench/e2e.py                          # the search, then the same-loss runs, then the plot
    python3 bench/e2e.py --phases reach --methods megatron-te --max-seq 512K
    python3 bench/e2e.py --phases same-loss --same-loss-seq 8K --lr 1e-4 --lr-warmup-iters 10
    python3 bench/e2e.py --phases time --methods megatron-te,peakflat-auto
    python3 bench/e2e.py --dry-run
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
from megatron_peakflat.testing.subproc import logged, memory_reports  # noqa: E402

RESULTS = ROOT / "bench" / "results"
METHODS = ("megatron-te", "peakflat-auto", "peakflat-all")
CONTROL = "megatron-te-control"
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
    lr: float = 3e-4
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
    added = {"megatron-te": [], CONTROL: [], "peakflat-auto": ["--peakflat", "auto"], "peakflat-all": ALL_ON}
    return list(added[method])


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


_PEAKS = re.compile(r"peakflat peaks iter \d+ .*?measured/predicted: (.*)$", re.M)
_PAIR = re.compile(r"([a-z_ ]+?) ([0-9.]+)/([0-9.]+)")


def parse(text: str, rc: int, wall: float, iters: int) -> Attempt:
    """What one training log says: losses, grad norms, the last iteration's time, Megatron's memory report after
    the second iteration, the runtime peak report's last line, and ``--peakflat auto``'s decision."""
    losses = logged(text, "lm loss")
    times = logged(text, "elapsed time per iteration (ms)")
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
    else:
        outcome = "error"
    timed = times[1:] if len(times) > 1 else times  # the first iteration holds the warm-up
    ms = statistics.median(timed) if timed else None
    return Attempt(outcome, round(wall, 1), losses, logged(text, "grad norm"), ms, mem,
                   peaks, auto, oom, "" if outcome == "ok" else text[-2500:])


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

    def __post_init__(self) -> None:
        if self.out.exists():
            self.doc = json.loads(self.out.read_text())
        self.doc.setdefault("component", "e2e")
        self.doc.setdefault("rows", [])
        self.doc.setdefault("commands", [])
        # the shape only: the learning rate differs between phases, and each row's command holds its own
        self.doc["model"] = {k: v for k, v in dataclasses.asdict(self.model).items() if k not in ("lr", "warmup")}
        self.doc["spec"] = self.spec

    # results file -------------------------------------------------------------------------------------
    def row(self, case: str, method: str) -> dict[str, Any] | None:
        return next((r for r in self.doc["rows"] if r["case"] == case and r["method"] == method), None)

    def put(self, row: dict[str, Any]) -> None:
        """Replace or add a row and write the file at once (a cut-off run keeps every row before it)."""
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
        if self.dry_run:
            return [sys.executable, "-m", "megatron_peakflat.testing.pretrain_dryrun", *flags]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                "--master-port", str(29500 + random.randrange(400)), "-m", "megatron_peakflat.pretrain", *flags]

    def attempt(self, flags: list[str], env: dict[str, str], iters: int) -> Attempt:
        full_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                    "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1", **env}
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

    def flags(self, seq: int, stock: Stock, extra: list[str], iters: int) -> list[str]:
        spec = TE_FLAGS if self.spec == "te" else ["--transformer-impl", "local", "--peakflat-attention", "sdpa"]
        return [*self.model.flags(seq), *spec, *stock.flags, *extra, "--train-iters", str(iters)]

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
        attempts = list((done or {"extra": {"attempts": []}})["extra"]["attempts"])
        row: dict[str, Any] = {}
        for stock in stocks:
            flags = self.flags(seq, stock, extra, self.iters)
            print(f"=== {method} seq={seq} config={stock.name}", flush=True)
            a = self.attempt(flags, dict(stock.env), self.iters)
            attempts.append({"config": stock.name, "outcome": a.outcome, "wall_s": a.wall_s,
                             **({"oom": a.oom} if a.oom else {}), **({"tail": a.tail} if a.outcome == "error" else {})})
            row = self._row(method, seq, stock, flags, a, attempts)
            print(f"    {a.outcome} in {a.wall_s:.0f} s; peak {row['peak_gib']} GiB, {row['ms']} ms/iter", flush=True)
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
        }
        return {"case": self.case(seq), "method": method, **top, "extra": extra}

    def _planner_gib(self, method: str, flags: list[str], a: Attempt) -> float | None:
        """The planner's allocated bytes for this run, as the runtime report compares them: the report's own figure
        where peakflat ran with it, else the planner's baseline column for these flags on this GPU."""
        if "total" in a.peaks:
            return a.peaks["total"][1]
        if method != "megatron-te":
            return None
        try:
            from megatron_peakflat.integration.peaks import allocated_prediction
            from megatron_peakflat.planner.cli import build
            from megatron_peakflat.planner.model import plan

            hbm = _gpu_bytes() or 80 * GIB
            shape, run, pf, _, _ = build(["--megatron-args", shlex.join(flags), "--gpus", "1", "--gpus-per-node", "1",
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
        if method == "peakflat-auto" and te is not None and te["extra"]["outcome"] == "ok" \
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

    def lengths(self, method: str) -> dict[int, str]:
        """Each length measured for ``method`` and its outcome ('ok', 'oom', 'error', 'timeout', 'pending')."""
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
        failing = next((n for n, o in above if o in ("oom", "error")), None)
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
                            **({"tail": a.tail} if a.outcome != "ok" else {})}})
        print(f"    {a.outcome} in {a.wall_s:.0f} s: {a.ms} ms/iter, losses {a.losses[:2]}...{a.losses[-2:]}",
              flush=True)
        return a

    def same_loss(self, seq: int, iters: int) -> None:
        """The three methods, and megatron-te's control, at one length for ``iters`` iterations with
        ``--deterministic-mode``; each one's largest relative loss and grad-norm difference against megatron-te.
        The control (megatron-te in another of its own configurations) is the spread that bf16 rounding alone
        gives between two computations of the same step: a method within it is as exact as Megatron is with itself."""
        case = f"same_loss,seq={seq},spec={self.spec},iters={iters}"
        runs: dict[str, Attempt] = {}
        methods = [*METHODS, CONTROL]
        if self.dry_run and self._control_stock(seq).name == "cpu-offload":
            print("    no control in a dry run: Megatron's offloaded optimizer needs CUDA", flush=True)
            methods.remove(CONTROL)
        for method in methods:
            stock = self._control_stock(seq) if method == CONTROL else self.stock_at(seq, method)
            flags = self.flags(seq, stock, [*method_flags(method), "--deterministic-mode"], iters)
            runs[method] = self._fixed(case, method, stock, flags, iters)
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
            row["exact"] = bool(complete and loss["max_rel_diff"] <= 5e-4)
            row["extra"]["vs_megatron_te"] = {"loss": loss, "grad_norm": norm}
            if control is not None and control["max_rel_diff"] is not None:
                row["extra"]["within_control"] = bool(complete and loss["max_rel_diff"] <= control["max_rel_diff"])
            self.put(row)
            print(f"    {method} vs megatron-te: loss {loss}, grad norm {norm}", flush=True)

    def timing(self, seq: int, methods: list[str], iters: int) -> None:
        """Each method at ``seq`` for ``iters`` iterations on the configuration it trained with in the search; the
        time is the median of all iterations but the first, so one-time costs (allocator growth, the first
        offloaded step) stay out of it."""
        case = f"time,seq={seq},spec={self.spec},iters={iters}"
        for method in methods:
            stock = self.stock_at(seq, method)
            extra = method_flags(method) + (["--peakflat-report-peaks"] if method.startswith("peakflat") else [])
            self._fixed(case, method, stock, self.flags(seq, stock, extra, iters), iters)
        rows = {m: self.row(case, m) for m in methods}
        base = rows.get("megatron-te")
        for method, row in rows.items():
            if method == "megatron-te" or row is None or base is None or not (row["ms"] and base["ms"]):
                continue
            if row["extra"]["card"] != base["extra"]["card"]:
                continue  # a ratio only between rows of one card
            row["extra"]["tokens_per_s_vs_megatron_te"] = round(base["ms"] / row["ms"], 3)
            self.put(row)
            print(f"    {method}: {row['extra']['tokens_per_s_vs_megatron_te']}x megatron-te's tokens/s at {seq}",
                  flush=True)


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


def _gpu_bytes() -> int | None:
    try:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


_WHERE: dict[str, Any] = {}


def _where() -> dict[str, Any]:
    """Where a row ran: the harness's card and commit (``where_ran``), the host's cores and torch's version (kept
    in every row, so merged files keep them)."""
    if not _WHERE:
        import torch

        from bench.harness import where_ran

        ran = where_ran()
        _WHERE.update(card=ran["card"], host_threads=os.cpu_count(), commit=ran["commit"], torch=torch.__version__)
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
    for method in METHODS:
        rows = sorted(((int(re.match(r"seq=(\d+)", r["case"]).group(1)), r) for r in doc["rows"]
                       if r["method"] == method and r["case"].startswith("seq=")), key=lambda x: x[0])
        ok = [(s, r) for s, r in rows if r["extra"]["outcome"] == "ok"]
        if ok:
            line, = top.plot([s for s, _ in ok], [r["peak_gib"] for _, r in ok], marker="o", label=method)
            for s, r in ok:
                top.annotate(r["extra"]["config"], (s, r["peak_gib"]), fontsize=6, textcoords="offset points",
                             xytext=(0, 5), ha="center", color=line.get_color())
            bottom.plot([s for s, _ in ok], [r["extra"]["tokens_per_s"] for _, r in ok], marker="o",
                        color=line.get_color(), label=method)
            color = line.get_color()
        else:
            color = None
        timed = [(int(re.match(r"time,seq=(\d+)", r["case"]).group(1)), r) for r in doc["rows"]
                 if r["method"] == method and r["case"].startswith("time,") and r["extra"]["tokens_per_s"]]
        if timed:
            bottom.scatter([s for s, _ in timed], [r["extra"]["tokens_per_s"] for _, r in timed], marker="*", s=120,
                           color=color, label=f"{method}, median of iterations 2-{timed[0][1]['extra']['iters']}")
        failed = [s for s, r in rows if r["extra"]["outcome"] in ("oom", "error")]
        if failed:
            top.scatter(failed, [0] * len(failed), marker="x", color=color, label=f"{method}: did not fit")
    reach = {r["method"]: r["reach_tokens"] for r in doc["rows"] if r["case"].startswith("reach,")}
    top.set_title(f"{doc.get('model', {}).get('layers', '?')}-layer gpt-oss-20b-shaped MoE, one {', '.join(cards)}\n"
                  "longest trained: " + ", ".join(f"{m} {n // 1024}K" for m, n in reach.items()), fontsize=10)
    top.set_ylabel("max allocated, GiB")
    bottom.set_ylabel("tokens / s (lines: iteration 2)")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, local spec: exercise the driver")
    ap.add_argument("--phases", default="reach,same-loss,plot",
                    help="any of reach, same-loss, time (each method at --time-seq for --time-iters iterations), "
                         "summary (the reach rows from the rows already measured, running nothing), plot (comma "
                         "separated)")
    ap.add_argument("--methods", default=",".join(METHODS), help="which methods' reach to search")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the model (default: 2)")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 (no --bf16): with --dry-run, the same-loss "
                                                        "phase then shows the composition's exactness without bf16 rounding")
    ap.add_argument("--spec", choices=["te", "local"], default=None,
                    help="te: Transformer Engine's layers; local: Megatron's local spec with the SDPA attention for "
                         "every method (default: te when Transformer Engine imports)")
    ap.add_argument("--min-seq", type=tokens, default=None, help="first length (default: 8K; dry run 64)")
    ap.add_argument("--max-seq", type=tokens, default=None, help="last length (default: 1M; dry run 128)")
    ap.add_argument("--granularity", type=tokens, default=None, help="bisection step (default: 8K; dry run 64)")
    ap.add_argument("--same-loss-seq", type=tokens, default=None, help="default: --min-seq")
    ap.add_argument("--same-loss-iters", type=int, default=None, help="default: 50; dry run 3")
    ap.add_argument("--time-seq", type=tokens, default=None,
                    help="the time phase's length (default: megatron-te's reach, from the rows measured)")
    ap.add_argument("--time-iters", type=int, default=5, help="the time phase's iterations (default: 5)")
    ap.add_argument("--timeout", type=float, default=480, help="seconds one length may take (default: 480)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default: 3e-4; min-lr a tenth of it)")
    ap.add_argument("--lr-warmup-iters", type=int, default=1, help="warm-up iterations (default: 1)")
    ap.add_argument("--iters", type=int, default=2,
                    help="iterations per length (default: 2): it trains when all do, and its time is the median of "
                         "all but the first, so more than 2 give a time with less of the one-time costs")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds this invocation may run: a length that would run past it is left for the next "
                         "invocation, which resumes from the rows written (default: no limit)")
    ap.add_argument("--out", default=None, help="results file name under bench/results (default: e2e.json; dry run "
                                                "e2e_dryrun.json)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    out = RESULTS / (a.out or ("e2e_dryrun.json" if dry else "e2e.json"))
    kept = json.loads(out.read_text()).get("spec") if out.exists() else None  # a later invocation resumes that spec
    spec = a.spec or kept or ("local" if dry or not _te_importable() else "te")
    lo = a.min_seq or (64 if dry else 8192)
    hi = a.max_seq or (128 if dry else 1024**2)
    step = a.granularity or (64 if dry else 8192)
    model = TINY if dry else Model(layers=a.layers)
    driver = Driver(out, dataclasses.replace(model, bf16=not a.fp32, lr=a.lr, warmup=a.lr_warmup_iters), spec, dry,
                    a.timeout)
    if min(a.iters, a.time_iters) < 2:
        ap.error("--iters and --time-iters must be at least 2 (the first iteration is not timed)")
    phases = {p.strip() for p in a.phases.split(",") if p.strip()}
    runs = {"reach": ("--iters", a.iters), "same-loss": ("--same-loss-iters", a.same_loss_iters or (3 if dry else 50)),
            "time": ("--time-iters", a.time_iters)}
    for flag, n in (runs[p] for p in sorted(phases & runs.keys())):
        if a.lr_warmup_iters >= n:
            ap.error(f"--lr-warmup-iters {a.lr_warmup_iters}: Megatron needs fewer warm-up iterations than the "
                     f"{n} of {flag}; lower --lr-warmup-iters below {n}, or run that phase in its own invocation")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS)) + sorted(phases - {"reach", "same-loss", "time", "summary", "plot"})
    if unknown:
        ap.error(f"unknown method or phase: {', '.join(unknown)}")
    driver.iters = a.iters
    if a.budget is not None:
        driver.deadline = time.monotonic() + a.budget
    driver.doc["commands"] = list(dict.fromkeys(driver.doc["commands"] + ["python3 " + shlex.join(sys.argv)]))
    driver.save()
    try:
        for phase in [p for p in ("reach", "same-loss", "time") if p in phases]:
            if phase == "reach":
                for method in sorted(methods, key=METHODS.index):  # megatron-te first: the others use its configuration
                    driver.reach(method, lo, hi, step)
            elif phase == "same-loss":
                driver.same_loss(a.same_loss_seq or lo, a.same_loss_iters or (3 if dry else 50))
            else:
                seq = a.time_seq or driver.reach_row("megatron-te")["reach_tokens"]
                if not seq:
                    ap.error("the time phase needs --time-seq, or megatron-te's reach measured first")
                driver.timing(seq, sorted(methods, key=METHODS.index), a.time_iters)
    except BudgetSpent:
        print(f"--budget spent: run the same command again to resume from the rows in {out}", flush=True)
    if "summary" in phases:
        for method in METHODS:
            if driver.lengths(method):
                driver.reach_row(method)
    if "plot" in phases:
        plot(driver.doc, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def _te_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


if __name__ == "__main__":
    sys.exit(main())
