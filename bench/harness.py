"""Shared benchmark harness: peak memory and median time of one callable, and the results JSON.

Peak is ``max_memory_allocated`` minus the memory allocated before the call, inputs already on the
device. Time is the median of ``reps`` runs after ``warmup`` runs, each
bracketed by CUDA events. A method that runs out of memory is recorded with ``peak_gib=None`` and
``error='OOM'`` instead of ending the benchmark.

Every row written records where it ran: its card, the GPUs, the host threads and the commit (``stamp``); a ratio
between rows is taken only between rows of the same card and GPU count (``ratio``).

``write(..., merge=True)`` adds rows to an existing results file (replacing rows of the same case and
method), so a separate invocation (e.g. ``bench/sco.py --max-seq``) keeps the rows of the main run.
``largest_fitting`` is the search behind "largest size that fits a memory limit" rows.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    case: str
    method: str
    peak_gib: float | None
    ms: float | None
    exact: bool | None
    extra: dict[str, Any] = field(default_factory=dict)
    card: str | None = None
    """Where the row ran: ``torch.cuda.get_device_name()``, or 'cpu' (``write`` fills in this process's)."""
    threads: int | None = None
    """Host threads (``torch.get_num_threads()``) of the process that measured it."""
    commit: str | None = None
    """``git rev-parse --short HEAD`` of the tree that measured it, or 'unknown'."""
    gpus: int | None = None
    """GPUs the measurement ran on (the benchmark's ranks, ``world()``); a row without it ran on one."""


COMMIT_ENV = "PEAKFLAT_COMMIT"
"""The commit a row names where the tree that ran is a copy whose git metadata is another commit's (a copy of a
checkout sent to a GPU machine): set by the caller to the commit the copy was made from, and taken as given."""


def where_ran() -> dict[str, Any]:
    """This process's card (``torch.cuda.get_device_name()`` or 'cpu'), host threads and commit ('unknown'
    outside a git checkout; '+modified' appended where tracked files outside bench/results differ from it, so a
    row never names a commit that is not the code that ran): the fields that ``write`` stamps on each row."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                              text=True, timeout=10).stdout.strip()

    try:
        commit = os.environ.get(COMMIT_ENV) or git("rev-parse", "--short", "HEAD") or "unknown"
        if commit != "unknown" and not os.environ.get(COMMIT_ENV) and git(
                "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"):
            commit += "+modified"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"card": card, "threads": torch.get_num_threads(), "commit": commit, "gpus": world()[0]}


def stamp(rows: list[Row], where: dict[str, Any] | None = None) -> list[Row]:
    """``rows`` with this process's ``where_ran()`` fields filled in wherever a row has none (a row that
    already says where it ran keeps it)."""
    where = where or where_ran()
    for r in rows:
        for k, v in where.items():
            if getattr(r, k) is None:
                setattr(r, k, v)
    return rows


def card_of(row: Row | dict[str, Any]) -> str | None:
    """The card a row records, or None for a row written before rows recorded one (its file's top-level
    ``device`` names only the file's main run, so it is not taken for the row's)."""
    return row.card if isinstance(row, Row) else row.get("card")


def gpus_of(row: Row | dict[str, Any]) -> int:
    """The GPUs a row ran on: its own field, else ``extra.gpus`` (e2e rows), else 1 (rows written before rows
    recorded it ran on one GPU)."""
    if isinstance(row, Row):
        return row.gpus or 1
    return int(row.get("gpus") or row.get("extra", {}).get("gpus") or 1)


def ratio(a: Row | dict[str, Any], b: Row | dict[str, Any], key: str = "ms") -> float:
    """``a[key] / b[key]``, only between two rows that record the same card: a ratio across cards (or with a
    row that records none) compares the machines, not the methods, so it raises ValueError naming both."""
    ca, cb = card_of(a), card_of(b)
    if ca is None or cb is None or ca != cb:
        name = lambda r: f"{r.method if isinstance(r, Row) else r['method']}@{card_of(r) or 'no card recorded'}"  # noqa: E731
        raise ValueError(f"no {key} ratio between rows of different cards: {name(a)} vs {name(b)}; "
                         "compare rows measured on the same card")
    if gpus_of(a) != gpus_of(b):
        raise ValueError(f"no {key} ratio between a row on {gpus_of(a)} GPU(s) and one on {gpus_of(b)}; compare rows "
                         "measured on the same number of GPUs")
    va, vb = (getattr(r, key) if isinstance(r, Row) else r[key] for r in (a, b))
    if va is None or vb is None or not vb:
        raise ValueError(f"no {key} ratio: {va!r} / {vb!r}")
    return va / vb


def measure(fn: Callable[[], Any], *, warmup: int = 2, reps: int = 5) -> tuple[float, float]:
    """Return (peak GiB above the baseline, median ms) of ``fn()`` on the current CUDA device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    peak = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times.append(timed_call(fn))
        peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
    return peak, statistics.median(times)


def timed_call(fn: Callable[[], Any]) -> float:
    """Milliseconds of one ``fn()`` on the current stream (CUDA events), synchronized after."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def peak_once(fn: Callable[[], Any], *, cpu: bool = False) -> tuple[int, int]:
    """(peak bytes, peak bytes above what was allocated before ``fn``) of one call of ``fn``.

    CUDA: the caching allocator's statistics, after freeing cached blocks. ``cpu``: LiveBytesMeter,
    which sees only what ``fn`` allocates, so both numbers are that peak.
    """
    gc.collect()
    if cpu:
        from megatron_peakflat.testing.live_bytes import LiveBytesMeter

        with LiveBytesMeter() as m:
            fn()
        return m.peak, m.peak
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak, peak - base


def cuda_kernels(prof: Any, steps: int = 1) -> tuple[dict[str, list[float]], list[tuple[float, float, str]]]:
    """The CUDA kernels a ``torch.profiler`` run saw: {name: [ms per step, calls per step]}, and every
    kernel's (start us, end us, name) sorted by start, for finding the GPU's idle gaps. The GPU-side
    ranges of ``record_function`` annotations are not kernels and are left out."""
    kern: dict[str, list[float]] = {}
    spans = []
    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    annotations = {ev.name for ev in events if ev.device_type != cuda and getattr(ev, "is_user_annotation", False)}
    for ev in events:
        if ev.device_type == cuda and not getattr(ev, "is_user_annotation", False) and ev.name not in annotations:
            k = kern.setdefault(ev.name, [0.0, 0.0])
            k[0] += ev.device_time / steps / 1e3
            k[1] += 1 / steps
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    return kern, sorted(spans)


def idle_gaps(spans: list[tuple[float, float, str]], min_gap: float = 0.0) -> list[tuple[float, float, str, str]]:
    """(start, end, last kernel before, first kernel after) of every stretch longer than ``min_gap`` in
    which no GPU event of ``spans`` (start, end, name; sorted by start) runs. Events of several streams
    may overlap: a stretch is idle only when none of them runs."""
    gaps: list[tuple[float, float, str, str]] = []
    busy_until, last = None, ""
    for start, end, name in spans:
        if busy_until is not None and start - busy_until > min_gap:
            gaps.append((busy_until, start, last, name))
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    return gaps


def gap_summary(spans: list[tuple[float, float, str]], top: int = 6, steps: int = 1) -> str:
    """The GPU's idle time between kernels (``cuda_kernels``' spans, in us): its total per step and the
    largest gaps, each named by the kernels before and after it."""
    gaps = sorted(((b - a) / 1e3, before, after) for a, b, before, after in idle_gaps(spans))[::-1]
    total = sum(g for g, _, _ in gaps) / steps
    return (f"idle between kernels {total:.2f} ms/step; largest: "
            + "; ".join(f"{g:.2f} ms after {a[:40]} before {b[:40]}" for g, a, b in gaps[:top]))


def run_row(case: str, method: str, fn: Callable[[], Any], *, exact: bool | None = None,
            warmup: int = 2, reps: int = 5, **extra: Any) -> Row:
    """Measure ``fn`` and return its row; an OOM becomes a row with ``error='OOM'``."""
    try:
        peak, ms = measure(fn, warmup=warmup, reps=reps)
        row = Row(case, method, round(peak, 4), round(ms, 3), exact, dict(extra))
    except torch.OutOfMemoryError:
        row = Row(case, method, None, None, exact, {"error": "OOM", **extra})
    torch.cuda.empty_cache()
    print(f"{case:48s} {method:28s} peak={row.peak_gib!s:>10} GiB  ms={row.ms!s:>10}  exact={row.exact}", flush=True)
    return row


def more_rounds(first: list[Row], step_of: Callable[[Row], Callable[[], Any]], rounds: int, *,
                warmup: int, reps: int, label: int = 48) -> list[Row]:
    """Rounds 2..``rounds`` of a case: every row of ``first`` that has a time is timed again, the methods in
    turn (``step_of(row)`` gives its step), and its ``ms`` becomes the median of its rounds' medians, each
    kept in ``extra.ms_rounds``. Methods timed in turn share any drift of the GPU's clocks, which between
    separate runs of one method reaches several percent. Under torchrun every rank must call this with the
    same rows (after ``across_ranks``), and each round's time is the slowest rank's. Every timed row also gets
    ``extra.runs_ms`` (its rounds) and ``extra.spread`` (``repeated``)."""
    timed = [row for row in first if row.ms is not None]
    if rounds <= 1 or not timed:
        for row in timed:
            repeated(row, [row.ms])
        return first
    for row in timed:
        row.extra["ms_rounds"] = [row.ms]
    for r in range(2, rounds + 1):
        for row in timed:
            ms = across_ranks([measure(step_of(row), warmup=warmup, reps=reps)[1]])[0]
            torch.cuda.empty_cache()
            row.extra["ms_rounds"].append(round(ms, 3))
            print(f"{row.case:{label}s} {row.method:28s} round {r}: ms={ms:.3f}", flush=True)
    for row in timed:
        repeated(row, row.extra["ms_rounds"])
        print(f"{row.case:{label}s} {row.method:28s} median of {rounds} rounds: ms={row.ms} "
              f"(spread {row.extra['spread']:.1%})", flush=True)
    return first


DEFAULT_REPEATS = 3
"""Every timed configuration runs at least this many times (``--repeats``); its ``ms`` is their median."""


def repeats_arg(ap: Any, *, dest: str = "rounds", default: int = DEFAULT_REPEATS) -> None:
    """Add ``--repeats`` (alias ``--rounds``) to a benchmark's parser: how many times each timed configuration
    runs, the methods in turn; the row's ``ms`` is the median, ``extra.runs_ms`` every run, ``extra.spread``
    (max - min) / median."""
    ap.add_argument("--repeats", "--rounds", dest=dest, type=int, default=default,
                    help=f"times each timed configuration runs, the methods in turn; ms is the median, every run in "
                         f"extra.runs_ms (default: {default})")


def spread(runs: list[float]) -> float:
    """(max - min) / median of a configuration's runs: how far apart its repeats fell."""
    med = statistics.median(runs)
    return (max(runs) - min(runs)) / med if med else 0.0


def repeated(row: Row, runs: list[float]) -> Row:
    """``row`` with ``ms`` the median of ``runs`` (ms of separate runs of one configuration), every run in
    ``extra.runs_ms`` and ``extra.spread`` their (max - min) / median."""
    runs = [round(float(r), 3) for r in runs]
    row.ms = round(statistics.median(runs), 3)
    row.extra["runs_ms"] = runs
    row.extra["spread"] = round(spread(runs), 4)
    return row


def runs_of(row: Row | dict[str, Any], key: str = "ms") -> list[float]:
    """The runs behind a row's ``ms``: ``extra.runs_ms``, else ``extra.ms_rounds`` (older rows), else the one ``ms``."""
    extra = row.extra if isinstance(row, Row) else row.get("extra", {})
    value = row.ms if isinstance(row, Row) else row.get(key)
    for name in ("runs_ms", "ms_rounds"):
        if key == "ms" and extra.get(name):
            return [float(x) for x in extra[name]]
    return [] if value is None else [float(value)]


def _card_any(row: Row | dict[str, Any]) -> str | None:
    """A row's card: its own field (``harness`` rows) or ``extra.card`` (e2e rows)."""
    return card_of(row) or (None if isinstance(row, Row) else row.get("extra", {}).get("card"))


@dataclass
class RatioCheck:
    """One method's median time over a peer's, on one card, with the range its repeats allow."""

    case: str
    method: str
    peer: str
    card: str
    ratio: float
    """median(method) / median(peer): below 1, the method is faster."""
    low: float
    """min(method runs) / max(peer runs)."""
    high: float
    """max(method runs) / min(peer runs)."""
    runs: tuple[int, int]

    @property
    def overlaps_one(self) -> bool:
        """True when the repeats cannot tell the two apart: the range holds 1.0x."""
        return self.low <= 1.0 <= self.high

    def line(self) -> str:
        flag = "  OVERLAPS 1.0x: not resolved by these runs" if self.overlaps_one else ""
        few = f"  (fewer than {DEFAULT_REPEATS} runs)" if min(self.runs) < DEFAULT_REPEATS else ""
        return (f"{self.case:44s} {self.method:24s} / {self.peer:24s} {self.ratio:6.3f}x "
                f"[{self.low:.3f}, {self.high:.3f}] on {self.card}{flag}{few}")


def ratio_checks(rows: list[Row] | list[dict[str, Any]], ours: Callable[[str], bool] | None = None,
                 peers: Callable[[str], bool] | None = None) -> list[RatioCheck]:
    """Every (method, peer) pair of timed rows of one case and one card: ``ours(method)`` (default: a name starting
    with 'peakflat') against each row ``peers`` accepts (default: every other name). Ratios are between medians;
    a row with no card or no time gives none (a ratio across cards compares the machines)."""
    ours = ours or (lambda m: m.startswith("peakflat"))
    peers = peers or (lambda m: not ours(m))
    name = lambda r: r.method if isinstance(r, Row) else r["method"]  # noqa: E731
    case = lambda r: r.case if isinstance(r, Row) else r["case"]  # noqa: E731
    out: list[RatioCheck] = []
    for a in rows:
        if not ours(name(a)) or not runs_of(a):
            continue
        for b in rows:
            if b is a or case(b) != case(a) or not peers(name(b)) or not runs_of(b):
                continue
            card = _card_any(a)
            if card is None or card != _card_any(b) or gpus_of(a) != gpus_of(b):
                continue  # a ratio across cards or GPU counts compares the machines
            ra, rb = runs_of(a), runs_of(b)
            ma, mb = statistics.median(ra), statistics.median(rb)
            if not mb or not min(rb):
                continue
            out.append(RatioCheck(case(a), name(a), name(b), card, round(ma / mb, 4), round(min(ra) / max(rb), 4),
                                  round(max(ra) / min(rb), 4), (len(ra), len(rb))))
    return out


def print_ratio_summary(rows: list[Row] | list[dict[str, Any]], **kw: Any) -> list[RatioCheck]:
    """Print ``ratio_checks`` (time of ours over each peer, median and the range of the repeats), flagging every
    ratio whose range holds 1.0x; returns the checks."""
    checks = ratio_checks(rows, **kw)
    if checks:
        print("time ratios (median over median, [min/max, max/min] of the runs):", flush=True)
        for c in checks:
            print("  " + c.line(), flush=True)
        unresolved = [c for c in checks if c.overlaps_one]
        print(f"  {len(unresolved)} of {len(checks)} ratios overlap 1.0x", flush=True)
    return checks


def world() -> tuple[int, int]:
    """(ranks, this rank) from torchrun's environment; (1, 0) in a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def finish_distributed() -> None:
    """Leave torch.distributed in order at the end of a multi-rank benchmark (a barrier, then every
    process group destroyed), so that no rank tears down a group the others still use at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def across_ranks(values: list[float | None]) -> list[float | None]:
    """The max of each value over the ranks (the slowest rank's time, the largest peak, the worst error);
    None where any rank has None. Identity in a plain process."""
    import torch.distributed as dist

    if world()[0] == 1:
        return values
    dev = torch.device("cuda") if torch.cuda.is_available() and dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float("nan") if v is None else v for v in values], device=dev, dtype=torch.float64)
    missing = torch.isnan(t).to(torch.float64)
    both = torch.stack([torch.nan_to_num(t, nan=0.0), missing])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return [None if m > 0 else float(v) for v, m in zip(both[0].tolist(), both[1].tolist())]


def megatron_ce(fn: Callable[..., torch.Tensor], logits: torch.Tensor, target: torch.Tensor, group: Any
                ) -> torch.Tensor:
    """Megatron's cross-entropy ``fn`` (``vocab_parallel_cross_entropy`` or its fused twin) over ``group``,
    passed as ``tp_group`` where the installed megatron-core takes it (0.19). megatron-core 0.18's
    ``vocab_parallel_cross_entropy`` reads the group from parallel_state, so callers on 0.18 must have
    made ``group`` Megatron's tensor-parallel group, as every benchmark here does."""
    import inspect

    if "tp_group" in inspect.signature(fn).parameters:
        return fn(logits, target, tp_group=group)
    return fn(logits, target)


def environment() -> dict[str, Any]:
    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001
        mcore = None
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": dev, "torch": torch.__version__, "megatron_core": mcore}


def _command_line() -> str:
    """This process's command line; under torchrun, the torchrun line (every rank sees only the script)."""
    world_size = world()[0]
    launcher = f"torchrun --nproc-per-node {world_size}" if world_size > 1 else Path(sys.executable).name
    return " ".join([launcher, *sys.argv])


def write(component: str, rows: list[Row], *, command: str | None = None, out: Path | None = None,
          merge: bool = False) -> Path:
    """Write ``bench/results/<component>.json`` (and a copy under $OUT when set).

    Every row records where it ran (``card``, ``threads``, ``commit``: ``stamp``). ``merge``: when the file
    exists, keep its rows, each with its own fields, and its top-level fields, and put ``rows`` in: a row
    with the case and method of an existing one replaces it in place, the others are appended; the command
    line is added to ``merged_commands`` (the file's own ``command``, ``device`` and ``torch`` stay those of
    its main run: read a row's card from the row)."""
    command = command or _command_line()
    path = out or RESULTS / f"{component}.json"
    stamp(rows)
    doc = {"component": component, **environment(), "command": command, "rows": [asdict(r) for r in rows]}
    if merge and path.exists():
        doc = merged(json.loads(path.read_text()), rows, command)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{component}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}" + (" (merged)" if merge else ""))
    return path


def merged(doc: dict[str, Any], rows: list[Row], command: str) -> dict[str, Any]:
    """``doc`` (a results file's content) with ``rows`` merged in by (case, method); see ``write``."""
    doc = dict(doc)
    old = list(doc.get("rows", []))
    index = {(r["case"], r["method"]): i for i, r in enumerate(old)}
    for r in rows:
        d = asdict(r)
        key = (d["case"], d["method"])
        if key in index:
            old[index[key]] = d
        else:
            index[key] = len(old)
            old.append(d)
    doc["rows"] = old
    cmds = list(doc.get("merged_commands", []))
    if command not in cmds and command != doc.get("command"):
        cmds.append(command)
    if cmds:
        doc["merged_commands"] = cmds
    return doc


@dataclass
class Trial:
    """One try of a size against a memory limit."""

    size: int
    fits: bool
    peak_gib: float | None = None
    """The peak the try reached (None when it failed before the end, e.g. out of memory)."""
    seconds: float = 0.0
    error: str | None = None


def largest_fitting(attempt: Callable[[int], Trial], *, step: int, start: int, limit_size: int,
                    known: list[Trial] | tuple[Trial, ...] = (), deadline: float | None = None,
                    cost: Callable[[int], float] | None = None,
                    clock: Callable[[], float] = time.monotonic) -> tuple[int | None, int | None, list[Trial], bool]:
    """The largest multiple of ``step`` in [step, limit_size] for which ``attempt`` fits.

    Assumes fitting is monotone (a size that fits means every smaller one fits). Searches from
    ``start``: doubling the distance, in steps, while tries stay on the same side, then bisecting the
    bracket. ``known`` tries (any sizes) seed the bracket and are never repeated. Before each try, stops
    when ``clock()`` is past ``deadline``, or would be after ``cost(size)`` more seconds.

    Returns (largest size that fits, or None when even ``step`` does not; the smallest multiple of
    ``step`` known not to fit, or None; every try in order, ``known`` first; complete), where
    ``complete`` is False when the deadline cut the search short (the answer is then a lower bound).
    """
    if step < 1 or limit_size < step:
        raise ValueError(f"step={step}, limit_size={limit_size}: need 1 <= step <= limit_size")
    tries = list(known)
    lo = max((t.size // step for t in tries if t.fits), default=0)  # in steps; 0: nothing fits yet
    hi_units = [-(-t.size // step) for t in tries if not t.fits]
    top = limit_size // step
    hi: int | None = min(hi_units) if hi_units else None
    seen = {t.size for t in tries}
    complete = True

    def run(units: int) -> bool | None:
        nonlocal complete
        size = units * step
        if size in seen:
            return next(t.fits for t in tries if t.size == size)
        now = clock()
        if deadline is not None and (now > deadline or (cost is not None and now + cost(size) > deadline)):
            complete = False
            return None
        t = attempt(size)
        tries.append(t)
        seen.add(size)
        return t.fits

    if hi is not None and hi <= 1:
        return None, step, tries, True
    up = True
    u = min(max(1, start // step), top)
    if hi is not None:
        u = min(u, hi - 1)
    if u > lo:
        ok = run(u)
        if ok is None:
            return (lo * step or None), (hi * step if hi is not None else None), tries, False
        if ok:
            lo = u
        else:
            hi, up = u, False
    d = 1
    if up:  # gallop up from the largest fit: lo + 1, lo + 2, lo + 4, ... until one does not fit
        while (hi is None or hi - lo > 1) and lo < top:
            cand = min(lo + d, top if hi is None else hi - 1)
            ok = run(cand)
            if ok is None:
                break
            if not ok:
                hi = cand
                break
            lo, d = cand, 2 * d
    else:  # gallop down from the smallest failure until one fits
        while hi - lo > 1:
            cand = max(hi - d, lo + 1)
            ok = run(cand)
            if ok is None:
                break
            if ok:
                lo = cand
                break
            hi, d = cand, 2 * d
    while complete and hi is not None and hi - lo > 1:  # bisect the bracket
        mid = (lo + hi) // 2
        ok = run(mid)
        if ok is None:
            break
        if ok:
            lo = mid
        else:
            hi = mid
    if hi is None and lo < top:
        complete = False
    return (lo * step or None), (hi * step if hi is not None else None), tries, complete


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.harness ratios FILE...``: the time ratios of each results file's rows (``print_ratio_summary``);
    exit status 1 when any ratio's range holds 1.0x."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("what", choices=["ratios"])
    ap.add_argument("files", nargs="+", type=Path)
    a = ap.parse_args(argv)
    unresolved = 0
    for f in a.files:
        print(f"== {f}")
        unresolved += sum(c.overlaps_one for c in print_ratio_summary(json.loads(f.read_text())["rows"]))
    return 1 if unresolved else 0


if __name__ == "__main__":
    sys.exit(main())
