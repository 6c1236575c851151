"""What the host was doing while the GPU idled: GPU gaps in a Chrome trace, attributed to host frames.

    torchrun --nproc-per-node 2 tools/probes/profile_dispatch.py --methods llep-unchunked,peakflat --steps 1 --trace /tmp/t
    python3 tools/probes/trace_gaps.py /tmp/t/peakflat.rank0.json --min-gap-ms 0.2 --top 40

A gap is the time between one GPU event (kernel, copy, memset) ending and the next starting, when it is
longer than ``--min-gap-ms``. Every host event (Python frame, ATen op, annotation) is charged the part of
the gaps it overlaps, so the frames that kept the GPU waiting rise to the top; read the list from the top
(whole steps) down to the leaves.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import idle_gaps  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("python_function", "cpu_op", "user_annotation")


def gpu_gaps(events: Iterable[dict[str, Any]], min_gap_us: float) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every stretch longer than ``min_gap_us`` with no GPU event running."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    return [(a, b) for a, b, _, _ in idle_gaps(spans, min_gap_us)]


def charge(events: Iterable[dict[str, Any]], gaps: list[tuple[float, float]]) -> collections.Counter:
    """{(category, name): microseconds of the gaps that host event overlapped}, summed over its calls."""
    out: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in HOST_CATS:
            continue
        s, t = e["ts"], e["ts"] + e.get("dur", 0)
        overlap = sum(max(0.0, min(t, b) - max(s, a)) for a, b in gaps)
        if overlap > 0:
            out[(e["cat"], e["name"])] += overlap
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a Chrome trace written by torch.profiler (profile_dispatch.py --trace)")
    ap.add_argument("--min-gap-ms", type=float, default=0.2)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    gaps = gpu_gaps(events, args.min_gap_ms * 1e3)
    print(f"{len(gaps)} GPU gaps over {args.min_gap_ms} ms, {sum(b - a for a, b in gaps) / 1e3:.2f} ms in all")
    for (cat, name), us in charge(events, gaps).most_common(args.top):
        print(f"{us / 1e3:8.2f} ms  {cat[:3]}  {name[:120]}")


if __name__ == "__main__":
    main()
