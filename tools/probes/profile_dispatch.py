"""Where a MoE layer step spends its GPU time: the benchmark's layer (``bench/dispatch.py``) under
``torch.profiler``, one table of kernels per method, so that a time gap between methods can be
attributed to kernels (GEMMs, permutation, atomics, copies) rather than guessed.

    python3 tools/probes/profile_dispatch.py                          # H=4096, 32K tokens, full recompute
    python3 tools/probes/profile_dispatch.py --tokens 65536 --skew 95 --methods llep-unchunked,peakflat

Prints, per method, the step time (CUDA events), the GPU busy time the profiler saw, and the top
kernels by total GPU time with their call counts; no results file (this is a diagnostic).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import dispatch as bd  # noqa: E402
from bench import harness  # noqa: E402


def _category(name: str) -> str:
    n = name.lower()
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "grouped" in n:
        return "gemm"
    if "index" in n or "scatter" in n or "gather" in n:
        return "index/scatter"
    if "sort" in n or "radix" in n or "nonzero" in n or "cumsum" in n or "scan" in n:
        return "sort/scan"
    if "memcpy" in n or "copy" in n:
        return "copy"
    if "memset" in n or "fill" in n:
        return "fill"
    if "reduce" in n or "sum" in n:
        return "reduce"
    return "elementwise/other"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--skew", type=int, default=0)
    ap.add_argument("--hot", type=int, default=4)
    ap.add_argument("--regime", default="full")
    ap.add_argument("--methods", default="megatron-alltoall,llep-unchunked,peakflat")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts-impl", choices=bd.EXPERTS_IMPLS, default="sequential",
                    help="as bench/dispatch.py's flag (default: %(default)s)")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--trace", default="", help="folder: also write each method's Chrome trace there, with the host's "
                                                "Python calls (to see what the host did while the GPU idled)")
    args = ap.parse_args(argv)

    import megatron_peakflat

    bd.setup(cpu=False)
    methods = args.methods.split(",")
    cfgs = {m: bd.method_config(m) for m in [bd.OURS_DEFAULT, *methods] if m != "megatron-alltoall"}
    megatron_peakflat.apply(cfgs[bd.OURS_DEFAULT])
    ddp, layer = bd.build_layer(args.hidden, args.experts, args.topk, 1536, cpu=False, experts_impl=args.experts_impl)
    seq = 4096
    g = torch.Generator(device="cpu").manual_seed(args.tokens)
    x = (torch.randn(seq, args.tokens // seq, args.hidden, generator=g) * 0.5).cuda().to(torch.bfloat16)
    x.requires_grad_(True)
    gout = torch.randn(seq, args.tokens // seq, args.hidden, generator=g).cuda().to(torch.bfloat16)
    bd.skew_router(layer, args.skew / 100, args.hot)
    for method in methods:
        bd.select(layer, method, cfgs, args.regime)
        step = bd.make_step(ddp, x, gout, args.regime)
        _, step_ms = harness.measure(step, warmup=2, reps=3)
        acts = [torch.profiler.ProfilerActivity.CUDA]
        if args.trace:
            acts.append(torch.profiler.ProfilerActivity.CPU)
        with torch.profiler.profile(activities=acts, with_stack=bool(args.trace)) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"{method}.rank{harness.world()[1]}.json"))
        kern, spans = harness.cuda_kernels(prof, args.steps)
        busy = sum(v[0] for v in kern.values())
        span = (spans[-1][1] - spans[0][0]) / 1e3 / args.steps if spans else 0.0
        cats: dict[str, float] = defaultdict(float)
        for name, (ms, _) in kern.items():
            cats[_category(name)] += ms
        print(f"\n=== {method}: step {step_ms:.1f} ms (events), GPU busy {busy:.1f} ms/step, first kernel to last "
              f"{span:.1f} ms/step, {len(spans) / args.steps:.0f} kernels/step")
        print("    by category: " + ", ".join(f"{c} {ms:.1f}" for c, ms in sorted(cats.items(), key=lambda t: -t[1])))
        for name, (ms, calls) in sorted(kern.items(), key=lambda t: -t[1][0])[:args.top]:
            print(f"    {ms:8.2f} ms {calls:7.1f}x  {name[:150]}")
        print("    " + harness.gap_summary(spans, steps=args.steps))
    megatron_peakflat.remove()


if __name__ == "__main__":
    main()
