"""End to end: ``examples/pretrain_moe.sh`` run once per configuration, Megatron's own log read back.

Each configuration is a name and its environment for the example (``PEAKFLAT``, ``PEAKFLAT_COMPONENTS``,
model sizes); all share ``--env`` and the extra Megatron flags after ``--``. For each run the results file
keeps every iteration's loss and grad norm, the median time per iteration after the first two, and
Megatron's memory report after two iterations (rank 0: allocated, which holds the weights, gradient
buffers and optimizer state, and max allocated), and, under ``--timing-log-level 1`` or higher, Megatron's
timers at every logged iteration (``timers_ms``: the maximum across ranks). Separate processes, one after another on the same
machine: the figures compare configurations, not peers inside one process (``bench/<component>.py`` do).
A run that dies of CUDA OOM keeps the allocator's message and the innermost frames it died in (``oom``);
``--compare a:b`` records how far two runs' losses are apart (runs that differ only in peakflat being on).

    python3 bench/pretrain_compare.py --env VOCAB=201088,HIDDEN=2048 \
        --run off:PEAKFLAT=off --run whole:PEAKFLAT_COMPONENTS=dispatch,vocab,sco \
        --run shard:PEAKFLAT_COMPONENTS=dispatch,vocab-ep,sco --compare off:whole -- --deterministic-mode
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import RESULTS, environment  # noqa: E402
from bench.memory_peak import short_path  # noqa: E402
from megatron_peakflat.testing.subproc import logged, memory_report  # noqa: E402


def _pairs(text: str, sep: str) -> dict[str, str]:
    """``KEY=VALUE`` items separated by ``sep``."""
    out = {}
    for item in filter(None, text.split(sep)):
        if "=" not in item:
            raise SystemExit(f"--env/--run: expected KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def _run_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``name:KEY=V;KEY=V``: the components list itself holds commas, so pairs are split on ';'."""
    name, _, rest = spec.partition(":")
    return name, _pairs(rest, ";")


_LOG_PREFIX = re.compile(r"^(?:[A-Z]+:megatron_peakflat:)?(?:\[rank \d+\] )?")
"""What Megatron's log format (``INFO:megatron_peakflat:``) and a per-rank line (``[rank N] ``) put before a line."""
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def oom_of(text: str, frames: int = 4) -> dict | None:
    """The first CUDA out-of-memory error in a log: the allocator's message (what it tried to allocate,
    what was free) and the innermost ``frames`` frames of the traceback above it, as ``file:line func``
    with the path from its package down, so that the peak it died in can be named. None without one."""
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if "OutOfMemoryError" in ln and "CUDA out of memory" in ln:
            found = [m for m in (_FRAME.search(x) for x in lines[max(0, i - 200):i]) if m]
            where = [f"{short_path(m.group(1))}:{m.group(2)} {m.group(3)}" for m in found[-frames:]]
            return {"message": ln.split("OutOfMemoryError:", 1)[-1].strip()[:400], "where": where}
    return None


_TIMER = re.compile(r"^(?:\[[^\]\s]+\]:? ?)?\s{4}(\S.*?) \.*: (?:\(([0-9.]+), ([0-9.]+)\)|([0-9.]+))\s*$")


def timers_of(text: str) -> dict[str, list[float]]:
    """Megatron's timer report lines (``--timing-log-level`` 1 or 2; both the "(min, max)" and the
    "max" forms): every value of each timer, in log order, as the maximum across ranks in ms."""
    out: dict[str, list[float]] = {}
    for ln in text.splitlines():
        m = _TIMER.match(ln)
        if m:
            out.setdefault(m.group(1), []).append(float(m.group(3) or m.group(4)))
    return out


def loss_gap(a: list[float], b: list[float]) -> dict:
    """How far two runs' per-iteration losses are apart: the largest relative difference, at which iteration, and
    the first iteration at which they are more than 1e-3 apart (where bf16 runs start to diverge, None if never)."""
    n = min(len(a), len(b))
    if n == 0:
        return {"iterations": 0, "max_rel_diff": None}
    rel = [abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a[:n], b[:n])]
    k = max(range(n), key=rel.__getitem__)
    above = next((i + 1 for i, r in enumerate(rel) if r > 1e-3), None)
    return {"iterations": n, "max_rel_diff": rel[k], "at_iteration": k + 1, "first_above_1e-3": above}


def parse_log(text: str) -> dict:
    """Losses, grad norms, per-iteration times and the memory report of one Megatron training log."""
    times = logged(text, "elapsed time per iteration (ms)")
    mem = memory_report(text)
    return {
        "lm_loss": logged(text, "lm loss"),
        "grad_norm": logged(text, "grad norm"),
        "ms_per_iter": statistics.median(times[2:]) if len(times) > 2 else None,
        "allocated_mib": mem[0] if mem else None,
        "max_allocated_mib": mem[1] if mem else None,
        "peakflat_lines": list(dict.fromkeys(  # what the components said they did, once each
            ln for ln in (_LOG_PREFIX.sub("", raw.strip()) for raw in text.splitlines())
            if ln.startswith(("peakflat dispatch:", "peakflat vocab:", "peakflat sco", "peakflat SCO",  # logs of 0.1.0
                              "peakflat optimizer:", "peakflat peaks"))))[:16],
        "oom": oom_of(text),
        "timers_ms": timers_of(text),
    }


DRAIN_S = 10.0
"""Seconds ``run_in_session`` reads a killed run's output before it gives up on processes outside the session."""


def run_in_session(cmd: list[str], env: dict[str, str], timeout: float | None,
                   drain: float = DRAIN_S) -> tuple[int, str]:
    """(exit status, stdout and stderr) of ``cmd`` run in a session of its own, so that a timeout kills
    every process it started (torchrun's ranks too), not the launcher alone; 124 on a timeout. After the kill
    the output is read for at most ``drain`` seconds more: a process that left the session (a worker that called
    setsid) may hold the pipe open, and the caller's own time budget must not wait on it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired as first:
        os.killpg(proc.pid, signal.SIGKILL)
        note = f"\n[pretrain_compare] killed after --timeout {timeout} s\n"
        try:
            out, _ = proc.communicate(timeout=drain)
        except subprocess.TimeoutExpired as held:
            partial = held.output or first.output or ""
            out = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            note += f"[pretrain_compare] output not closed {drain:g} s after the kill; the rest is lost\n"
            proc.stdout.close()
        return 124, out + note


def _machine() -> dict:
    """Where the runs ran: the harness's device and versions, GPU count and host memory."""
    import torch

    from megatron_peakflat.runtime.machine import mem_total

    mem = mem_total()
    return {**environment(), "gpus": torch.cuda.device_count(), "host_mem_gib": round(mem / 2**30, 1) if mem else None}


def _write(results: dict, name: str) -> Path:
    path = RESULTS / name
    path.write_text(json.dumps(results, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(json.dumps(results, indent=2) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="", help="KEY=VALUE,... for every run")
    ap.add_argument("--run", action="append", required=True, help="name:KEY=VALUE;KEY=VALUE (repeatable)")
    ap.add_argument("--out", default="pretrain_compare.json", help="file name under bench/results")
    ap.add_argument("--timeout", type=float, default=None, help="seconds a run may take before it is killed (rc 124)")
    ap.add_argument("--compare", action="append", default=[], help="a:b: record how far runs a and b's losses are apart")
    ap.add_argument("extra", nargs="*", help="Megatron flags for every run (after --)")
    a = ap.parse_args()
    common = _pairs(a.env, ",")
    pairs_to_compare = [tuple(c.split(":", 1)) for c in a.compare]
    names = [_run_spec(spec)[0] for spec in a.run]
    for pair in pairs_to_compare:
        if len(pair) != 2 or not set(pair) <= set(names):
            raise SystemExit(f"--compare {':'.join(pair)}: expected two of the runs' names {names}, as a:b")
    results = {"command": "python3 " + shlex.join(sys.argv), "env": common, "extra": a.extra, "environment": _machine(), "runs": {}}
    for spec in a.run:
        name, pairs = _run_spec(spec)
        env = {**os.environ, **common, **pairs, "MASTER_PORT": str(29600 + random.randrange(300))}  # a run's pairs win
        t0 = time.time()
        print(f"=== {name}: {pairs}", flush=True)
        rc, text = run_in_session(["bash", "examples/pretrain_moe.sh", *a.extra], env, a.timeout)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"pretrain_{name}.log").write_text(text)
        row = {"env": pairs, "rc": rc, "wall_s": round(time.time() - t0, 1), **parse_log(text)}
        if rc:
            row["tail"] = text[-3000:]
        results["runs"][name] = row
        print(json.dumps({k: v for k, v in row.items() if k != "tail"}, indent=1), flush=True)
        if rc:
            print(text[-3000:], flush=True)
        path = _write(results, a.out)  # after every run: a run that outlasts its machine keeps the others
    if pairs_to_compare:
        results["loss_gaps"] = {f"{x}:{y}": loss_gap(results["runs"][x]["lm_loss"], results["runs"][y]["lm_loss"])
                                for x, y in pairs_to_compare}
        print(json.dumps(results["loss_gaps"], indent=1), flush=True)
        path = _write(results, a.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
