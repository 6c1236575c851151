"""Shared benchmark harness: peak memory and median time of one callable, and the results JSON.

Peak is ``max_memory_allocated`` minus the memory allocated before the call, inputs already on the
device (DESIGN.md, Benchmarks). Time is the median of ``reps`` runs after ``warmup`` runs, each
bracketed by CUDA events. A method that runs out of memory is recorded with ``peak_gib=None`` and
``error='OOM'`` instead of ending the benchmark.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
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
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
    return peak, statistics.median(times)


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


def environment() -> dict[str, Any]:
    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001
        mcore = None
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": dev, "torch": torch.__version__, "megatron_core": mcore}


def write(component: str, rows: list[Row], *, command: str | None = None, out: Path | None = None) -> Path:
    """Write ``bench/results/<component>.json`` (and a copy under $OUT when set)."""
    doc = {"component": component, **environment(), "command": command or " ".join([sys.executable, *sys.argv]),
           "rows": [asdict(r) for r in rows]}
    path = out or RESULTS / f"{component}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{component}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return path
