"""End to end: ``examples/pretrain_moe.sh`` run once per configuration, Megatron's own log read back.

Each configuration is a name and its environment for the example (``PEAKFLAT``, ``PEAKFLAT_COMPONENTS``,
model sizes); all share ``--env`` and the extra Megatron flags after ``--``. For each run the results file
keeps every iteration's loss and grad norm, the median time per iteration after the first two, and
Megatron's memory report after two iterations (rank 0: allocated, which holds the weights, gradient
buffers and optimizer state, and max allocated). Separate processes, one after another on the same
machine: the figures compare configurations, not peers inside one process (``bench/<component>.py`` do).

    python3 bench/pretrain_compare.py --env VOCAB=201088,HIDDEN=2048 \
        --run off:PEAKFLAT=off --run whole:PEAKFLAT_COMPONENTS=dispatch,vocab,sco \
        --run shard:PEAKFLAT_COMPONENTS=dispatch,vocab-ep,sco -- --deterministic-mode
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import RESULTS  # noqa: E402
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
            ln.strip() for ln in text.splitlines()
            if ln.startswith(("peakflat dispatch:", "peakflat vocab:", "peakflat SCO", "peakflat optimizer:", "peakflat peaks"))))[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="", help="KEY=VALUE,... for every run")
    ap.add_argument("--run", action="append", required=True, help="name:KEY=VALUE;KEY=VALUE (repeatable)")
    ap.add_argument("--out", default="pretrain_compare.json", help="file name under bench/results")
    ap.add_argument("extra", nargs="*", help="Megatron flags for every run (after --)")
    a = ap.parse_args()
    common = _pairs(a.env, ",")
    results = {"command": " ".join(sys.argv), "env": common, "extra": a.extra, "runs": {}}
    for spec in a.run:
        name, pairs = _run_spec(spec)
        env = {**os.environ, **common, **pairs, "MASTER_PORT": str(29600 + random.randrange(300))}  # a run's pairs win
        t0 = time.time()
        print(f"=== {name}: {pairs}", flush=True)
        proc = subprocess.run(["bash", "examples/pretrain_moe.sh", *a.extra], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"pretrain_{name}.log").write_text(text)
        row = {"env": pairs, "rc": proc.returncode, "wall_s": round(time.time() - t0, 1), **parse_log(text)}
        if proc.returncode:
            row["tail"] = text[-3000:]
        results["runs"][name] = row
        print(json.dumps({k: v for k, v in row.items() if k != "tail"}, indent=1), flush=True)
        if proc.returncode:
            print(text[-3000:], flush=True)
    path = RESULTS / a.out
    path.write_text(json.dumps(results, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], a.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
