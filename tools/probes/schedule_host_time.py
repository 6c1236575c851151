"""Probe (EP=1, CPU is enough): how long the host plans a PipelinedLLEP call between its one device-to-host copy
and its upload of the schedule's host arrays, at K=1 and with more chunks.

On the GPU that span is idle GPU time (the device waits for the host's first kernel after the copy). It is
the numpy of ``dispatch/schedule.py`` (plan, routes, flow cuts, upload packing), timed here with the copy
and the upload marked by wrapping them; median of 7 calls. Results: ``docs/evidence/probes/schedule_host_time.txt``.

    python3 tools/probes/schedule_host_time.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_peakflat.dispatch import schedule as sched  # noqa: E402


def main(tokens: int = 32768, experts: int = 64, topk: int = 8, reps: int = 7) -> None:
    g = torch.Generator().manual_seed(0)
    idx = torch.randn(tokens, experts, generator=g).topk(topk, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    marks: dict[str, float] = {}
    gather, send = sched.comm.all_gather_rows, sched.Uploads.send

    def marked_gather(x, group):
        out = gather(x, group)
        marks["copy"] = time.perf_counter()
        return out

    def marked_send(self, dev):
        marks["upload"] = time.perf_counter()
        return send(self, dev)

    sched.comm.all_gather_rows, sched.Uploads.send = marked_gather, marked_send
    try:
        print(f"T={tokens}, {experts} experts top-{topk}, EP=1, membership expert; host ms from the count copy "
              f"to the upload, median of {reps}")
        for cap, max_chunks in ((65536, 1), (65536, 64), (32768, 64)):
            times = []
            for _ in range(reps):
                s = sched.build_schedule(routing, num_local_experts=experts, group=None, chunk_cap=cap,
                                         max_chunks=max_chunks, alpha=1.0, min_spill=1024, imbalance_threshold=1.3)
                times.append((marks["upload"] - marks["copy"]) * 1e3)
            print(f"  chunk cap {cap}, max chunks {max_chunks}: K={s.K}, {sorted(times)[reps // 2]:.3f} ms")
    finally:
        sched.comm.all_gather_rows, sched.Uploads.send = gather, send


if __name__ == "__main__":
    main()
