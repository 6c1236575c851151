"""Optimizer-step benchmark on one GPU: OffloadStreamAdamW against Megatron's HybridDeviceOptimizer and
GPU-resident fused AdamW, on the same bf16 parameters and fp32 gradients (Megatron's precision-aware
path: ``param.decoupled_grad``).

Methods (bench/results/optimizer.json):
- ``peakflat``: OffloadStreamAdamW, engine 'auto' (the flags' default; split measured in warm-up);
- ``peakflat-gpu`` / ``peakflat-cpu``: the stream engine alone / the host kernel alone;
- ``megatron-hybrid-optimizer`` / ``-nooverlap``: HybridDeviceOptimizer, offload_fraction 1.0, with
  torch.optim.AdamW(fused=True) on the host, exactly as megatron.core.optimizer builds it;
- ``gpu-fused-adamw``: torch.optim.AdamW(fused=True) with fp32 masters and moments on the GPU.

Cases: 1.0B and 2.6B parameters (50M-element tensors, like DistributedOptimizer shards), bucket 100M,
with all host cores and with 4 (8 GPUs sharing a 32-core-per-socket host). ``exact`` comes from one
step on a 64M-parameter copy of the same setup, compared with fused GPU AdamW on fp32 masters
(bitwise for peakflat-gpu, max relative error <= 1e-6 for the others). The roofline printed per case
is max(PCIe bytes / 55 GB/s, host-kernel time) at the best GPU/host split.

    python -m bench.optimizer                       # ~5-6 min on one H200 (builds csrc/ first if needed)
    PEAKFLAT_JIT=1 python -m bench.optimizer        # same, JIT-building csrc/ instead of setup.py
    python -m bench.optimizer --sizes 1.0 --threads 16
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import harness

ROOT = Path(__file__).resolve().parent.parent
TENSOR = 50_000_000
PCIE = 55e9  # pinned copies, one direction at a time (DESIGN.md)
DUPLEX = 50.3e9  # each direction when both run at once
ENGINE = {"peakflat": "auto", "peakflat-gpu": "gpu", "peakflat-cpu": "cpu"}
"""OffloadStreamAdamW's engine per benchmarked method."""


def ensure_extension() -> str:
    """Build megatron_peakflat._C in place when missing (about a minute on the GPU machine);
    with PEAKFLAT_JIT=1, leave it to the JIT build of megatron_peakflat._ext instead."""
    try:
        import megatron_peakflat._C  # noqa: F401

        return "prebuilt"
    except ImportError:
        pass
    if os.environ.get("PEAKFLAT_JIT") == "1":
        return "jit (PEAKFLAT_JIT=1)"
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    t0 = time.time()
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode == 0:
        import importlib

        importlib.invalidate_caches()
        return f"built in {time.time() - t0:.0f}s"
    print("setup.py build_ext failed, falling back to PEAKFLAT_JIT=1:\n", r.stderr[-2000:], flush=True)
    os.environ["PEAKFLAT_JIT"] = "1"
    return "jit"


def make_params(n: int, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    sizes = [TENSOR] * (n // TENSOR) + ([n % TENSOR] if n % TENSOR else [])
    ps = []
    for s in sizes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", generator=g, dtype=torch.float32).mul_(0.02).bfloat16())
        p.decoupled_grad = torch.randn(s, device="cuda", generator=g).mul_(1e-3)
        ps.append(p)
    return ps


def groups(ps):
    return [{"params": ps[: len(ps) // 2], "weight_decay": 0.1}, {"params": ps[len(ps) // 2:], "weight_decay": 0.0}]


HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)


def build(method: str, ps, *, bucket: int, threads: int):
    from megatron_peakflat.optimizer import OffloadStreamAdamW

    if method.startswith("peakflat"):
        return OffloadStreamAdamW(groups(ps), **HYPER, bucket=bucket, engine=ENGINE[method], host_threads=threads)
    if method.startswith("megatron-hybrid-optimizer"):
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

        return HybridDeviceOptimizer(groups(ps), offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
                                     gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                                     overlap_cpu_optimizer_d2h_h2d=not method.endswith("nooverlap"),
                                     lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=0.1,
                                     fused=True)
    if method == "gpu-fused-adamw":
        fp32 = [torch.nn.Parameter(p.detach().float()) for p in ps]
        for m, p in zip(fp32, ps):
            m.grad = p.decoupled_grad
        opt = torch.optim.AdamW(groups(fp32), **HYPER, fused=True)

        class _WithCopyBack:
            masters = fp32

            def step(self):
                opt.step()
                torch._foreach_copy_([p.data for p in ps], [m.data for m in fp32])

        return _WithCopyBack()
    raise ValueError(method)


def free_all() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # HybridDeviceOptimizer's pinned copies live in torch's host cache


def exactness(methods: list[str], threads: int) -> dict[str, bool]:
    """One step of each method on 64M parameters vs fused GPU AdamW on fp32 masters: the fp32 masters
    after the step, bitwise for peakflat-gpu, max relative error <= 1e-6 for the others."""
    n = 64_000_000
    ref_ps = make_params(n, seed=1)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref_ps]
    for m, p in zip(masters, ref_ps):
        m.grad = p.decoupled_grad
    torch.optim.AdamW(groups(masters), **HYPER, fused=True).step()
    out = {}
    for method in methods:
        ps = make_params(n, seed=1)
        opt = build(method, ps, bucket=20_000_000, threads=threads)
        opt.step()
        torch.cuda.synchronize()
        if method.startswith("peakflat"):
            got = [opt.state[p]["master_param"].cuda() for p in ps]
        elif method.startswith("megatron-hybrid"):
            got = [opt.param_to_fp32_param[p].cuda() for p in ps]
        else:
            got = [m.detach() for m in opt.masters]
        rel = max(((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(got, masters))
        out[method] = rel == 0.0 if method == "peakflat-gpu" else rel <= 1e-6
        print(f"exactness {method:36s} max rel err of fp32 masters vs fused GPU AdamW: {rel:.2e}", flush=True)
        del opt, ps, got
        free_all()
    del ref_ps, masters
    free_all()
    return out


def host_kernel_rate(threads: int, ext) -> float:
    """Parameters per second of the host AdamW kernel on a 50M bucket (pinned-free host memory)."""
    from megatron_peakflat.optimizer.host_adam import host_adamw_

    n = TENSOR
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g, out = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    times = []
    for step in range(1, 5):
        t0 = time.perf_counter()
        host_adamw_(p, g, m, v, out, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
                    threads=threads, ext=ext)
        times.append(time.perf_counter() - t0)
    return n / sorted(times)[len(times) // 2]


def roofline(n: int, rate: float, duplex: bool = False) -> tuple[float, float, float, float]:
    """(best time, GPU fraction, GPU-engine-only time, host-engine-only time).

    The GPU engine moves 12 B/param up and 12 B/param down, the host engine 4 B/param down (fp32 grad)
    and 2 B/param up (bf16 param) plus its kernel time. ``duplex=False``: all bytes / 55 GB/s (one
    direction at a time); ``duplex=True``: each direction on its own at 50.3 GB/s (both streams busy)."""
    def pcie(f: float) -> float:
        up, down = n * (12 * f + 2 * (1 - f)), n * (12 * f + 4 * (1 - f))
        return max(up, down) / DUPLEX if duplex else (up + down) / PCIE

    best = (float("inf"), 0.0)
    for i in range(101):
        f = i / 100
        best = min(best, (max(pcie(f), (1 - f) * n / rate), f))
    return best[0], best[1], pcie(1.0), n / rate + pcie(0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.6], help="billions of parameters")
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 16, 4])
    ap.add_argument("--bucket", type=int, nargs="+", default=[100_000_000],
                    help="parameters per bucket; peers without buckets run at the first one only")
    ap.add_argument("--methods", nargs="+", default=["peakflat", "peakflat-gpu", "peakflat-cpu",
                                                      "megatron-hybrid-optimizer",
                                                      "megatron-hybrid-optimizer-nooverlap", "gpu-fused-adamw"])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    how = ensure_extension()
    from megatron_peakflat import _ext

    ext = _ext.load()
    print(f"extension: {how}; loaded={ext is not None} ({_ext.reason()}); isa={ext.adamw_isa() if ext else '-'}",
          flush=True)
    t_start = time.time()
    exact = exactness(args.methods, args.threads[0])
    rows = []
    for size in args.sizes:
        n = int(size * 1e9)
        for threads in args.threads:
            torch.set_num_threads(threads)
            rate = host_kernel_rate(threads, ext)
            rl, rl_f, rl_gpu, rl_cpu = roofline(n, rate)
            dx, dx_f, _, _ = roofline(n, rate, duplex=True)
            case = f"params={size}B,threads={threads}"
            print(f"\n{case}: host kernel {rate / 1e9:.2f} Gparam/s ({n / rate * 1e3:.0f} ms for all params); "
                  f"roofline {rl * 1e3:.0f} ms at GPU share {rl_f:.2f} (PCIe bytes / 55 GB/s; GPU engine alone "
                  f"{rl_gpu * 1e3:.0f} ms = {24 * n / 1e9:.1f} GB, host engine alone {rl_cpu * 1e3:.0f} ms); "
                  f"full-duplex bound {dx * 1e3:.0f} ms at GPU share {dx_f:.2f}", flush=True)
            ps = make_params(n)
            for bucket in args.bucket:
                case = f"params={size}B,bucket={bucket // 1_000_000}M,threads={threads}"
                _run_case(args, case, ps, bucket, threads, exact, rows, rl, dx, rate,
                          peers=bucket == args.bucket[0])
            hdo = next((r.ms for r in rows if r.case.startswith(f"params={size}B,") and
                        r.case.endswith(f",threads={threads}") and r.method == "megatron-hybrid-optimizer"
                        and r.ms), None)
            for r in rows:
                if (r.case.startswith(f"params={size}B,") and r.case.endswith(f",threads={threads}") and hdo
                        and r.ms and r.method.startswith("peakflat")):
                    r.extra["x_hybrid"] = round(r.ms / hdo, 3)
                    print(f"  {r.case:36s} {r.method:14s} {r.ms:8.1f} ms = {r.ms / hdo:.2f}x "
                          f"HybridDeviceOptimizer, {r.ms / (rl * 1e3):.2f}x roofline", flush=True)
            del ps
            free_all()
    harness.write("optimizer", rows, merge=True)
    print(f"total {time.time() - t_start:.0f}s", flush=True)


def _run_case(args: argparse.Namespace, case: str, ps: list, bucket: int, threads: int,
              exact: dict, rows: list, rl: float, dx: float, rate: float, peers: bool) -> None:
    """Every method of one (size, bucket, threads) case; ``peers``: also the methods without buckets."""
    from megatron_peakflat import stats

    shared = None  # one OffloadStreamAdamW per case: the peakflat rows switch its engine
    for method in args.methods:
        if method == "gpu-fused-adamw" and threads != args.threads[0]:
            continue  # does not use the host
        if not peers and not method.startswith("peakflat"):
            continue
        t0 = time.time()
        try:
            if method.startswith("peakflat"):
                if shared is None:
                    shared = build("peakflat", ps, bucket=bucket, threads=threads)
                opt = shared
                opt.set_engine(ENGINE[method])
            else:
                if shared is not None:
                    shared = None
                    free_all()
                opt = build(method, ps, bucket=bucket, threads=threads)
        except (RuntimeError, MemoryError) as e:
            print(f"{method}: {type(e).__name__}: {e}", flush=True)
            rows.append(harness.Row(case, method, None, None, exact.get(method), {"error": str(e)[:200]}))
            continue
        warm = 4 if method == "peakflat" else 1  # 'auto' measures its split over 3 steps
        row = harness.run_row(case, method, opt.step, exact=exact.get(method), warmup=warm, reps=args.reps,
                              setup_s=round(time.time() - t0, 1), roofline_ms=round(rl * 1e3, 1),
                              duplex_bound_ms=round(dx * 1e3, 1), host_kernel_gparam_s=round(rate / 1e9, 3))
        if method.startswith("peakflat"):
            snap = stats.snapshot().get("optimizer", {})
            row.extra.update({k: snap.get(k) for k in ("host_bytes", "host_pinned", "gpu_buckets", "cpu_buckets",
                                                       "auto_gpu_fraction", "gpu_staging_bytes")})
            if row.ms:
                row.extra["x_roofline"] = round(row.ms / (rl * 1e3), 3)
        rows.append(row)
        del opt
        if shared is None:
            free_all()
    del shared
    free_all()


if __name__ == "__main__":
    main()
