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
(bitwise for peakflat-gpu, max relative error <= 1e-6 for the others).

Everything the roofline rests on is measured in the same run: pinned host-to-device, device-to-host and
duplex (both at once on two streams) copy bandwidth (``copy_bandwidth``), and the host Adam kernel's rate
per thread count (``host_kernel_rate``). Two figures per case come from them (``roofline``): the roofline
with one copy direction at a time (H2D and D2H bandwidths), and the duplex bound with both directions at
once (the duplex bandwidth of each), each at its best GPU/host split, each the larger of the copies and the
host kernel's share. Every time is the median of at least 5 repetitions with its min and max in ``extra``;
the methods of a case are timed in ``--repeats`` rounds (default 3) taken in turn, and a row's ``ms`` is the median of its
rounds' medians (each in ``extra.runs_ms``; ``extra.spread`` is (max - min) / median).

    python -m bench.optimizer                       # tens of minutes on one GPU (3 rounds; builds csrc/ if needed)
    PEAKFLAT_JIT=1 python -m bench.optimizer        # same, JIT-building csrc/ instead of setup.py
    python -m bench.optimizer --sizes 1.0 --threads 16
    python -m bench.optimizer --dry-run             # CPU: tiny shapes, every step but the CUDA-only ones
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench import harness

ROOT = Path(__file__).resolve().parent.parent
TENSOR = 50_000_000
MIN_REPS = 5
"""Every timed figure is the median of at least this many repetitions."""
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


CUDA_ONLY = {"megatron-hybrid-optimizer": "Megatron's HybridDeviceOptimizer moves its state with CUDA streams",
             "megatron-hybrid-optimizer-nooverlap": "Megatron's HybridDeviceOptimizer moves its state with CUDA streams"}
"""Methods that need a GPU, with the reason a CPU dry run skips them."""


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def make_params(n: int, seed: int = 0, tensor: int = TENSOR) -> list[torch.nn.Parameter]:
    dev = device()
    g = torch.Generator(device=dev).manual_seed(seed)
    sizes = [tensor] * (n // tensor) + ([n % tensor] if n % tensor else [])
    ps = []
    for s in sizes:
        p = torch.nn.Parameter(torch.randn(s, device=dev, generator=g, dtype=torch.float32).mul_(0.02).bfloat16())
        p.decoupled_grad = torch.randn(s, device=dev, generator=g).mul_(1e-3)
        ps.append(p)
    return ps


def spread(values: list[float], prefix: str, digits: int = 3) -> dict[str, Any]:
    """{prefix: median, prefix_min, prefix_max, reps} of a list of measurements."""
    return {prefix: round(statistics.median(values), digits), f"{prefix}_min": round(min(values), digits),
            f"{prefix}_max": round(max(values), digits), f"{prefix}_reps": len(values)}


def timings(fn: Callable[[], Any], *, warmup: int, reps: int) -> tuple[list[float], float | None]:
    """(ms of each of ``reps`` calls of ``fn`` after ``warmup`` calls, peak GiB above the memory allocated before,
    or None on CPU): CUDA events on the GPU, the host clock on CPU."""
    cuda = device().type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        if cuda:
            times.append(harness.timed_call(fn))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return times, peak


def copy_bandwidth(nbytes: int, reps: int) -> dict[str, list[float]]:
    """Pinned copy bandwidth in bytes/s, ``reps`` measurements each after one warm-up: 'h2d' and 'd2h' one
    direction at a time, and 'duplex', each direction's rate while both run at once on two streams (the
    slower of the two). CUDA only."""
    host_up = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_down = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_up = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_down = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s_up, s_down = torch.cuda.Stream(), torch.cuda.Stream()

    def one(up: bool, down: bool) -> float:
        start, end_up, end_down = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        start.record()
        for on, stream, ev, dst, src in ((up, s_up, end_up, dev_up, host_up), (down, s_down, end_down, host_down,
                                                                                 dev_down)):
            if on:
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    ev.record(stream)
        torch.cuda.synchronize()
        ms = max(start.elapsed_time(ev) for on, ev in ((up, end_up), (down, end_down)) if on)
        return nbytes / (ms / 1e3)

    out = {}
    for name, up, down in (("h2d", True, False), ("d2h", False, True), ("duplex", True, True)):
        one(up, down)
        out[name] = [one(up, down) for _ in range(reps)]
    del host_up, host_down, dev_up, dev_down
    return out


def host_kernel_rate(threads: int, ext: Any, n: int, reps: int) -> list[float]:
    """Parameters per second of the host AdamW kernel on one ``n``-element bucket, ``reps`` measurements
    after one warm-up step."""
    from megatron_peakflat.optimizer.host_adam import host_adamw_

    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g, out = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    rates = []
    for step in range(1, reps + 2):
        t0 = time.perf_counter()
        host_adamw_(p, g, m, v, out, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
                    threads=threads, ext=ext)
        if step > 1:
            rates.append(n / (time.perf_counter() - t0))
    return rates


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
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # HybridDeviceOptimizer's pinned copies live in torch's host cache


def exactness(methods: list[str], threads: int, n: int = 64_000_000, tensor: int = TENSOR) -> dict[str, bool]:
    """One step of each method on ``n`` parameters vs fused AdamW on fp32 masters on the same device: the fp32
    masters after the step, bitwise for peakflat-gpu, max relative error <= 1e-6 for the others."""
    ref_ps = make_params(n, seed=1, tensor=tensor)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref_ps]
    for m, p in zip(masters, ref_ps):
        m.grad = p.decoupled_grad
    torch.optim.AdamW(groups(masters), **HYPER, fused=True).step()
    out = {}
    for method in methods:
        ps = make_params(n, seed=1, tensor=tensor)
        opt = build(method, ps, bucket=max(1, min(20_000_000, n // 3)), threads=threads)
        opt.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dev = masters[0].device
        if method.startswith("peakflat"):
            got = [opt.state[p]["master_param"].to(dev) for p in ps]
        elif method.startswith("megatron-hybrid"):
            got = [opt.param_to_fp32_param[p].to(dev) for p in ps]
        else:
            got = [m.detach() for m in opt.masters]
        rel = max(((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(got, masters))
        out[method] = rel == 0.0 if method == "peakflat-gpu" else rel <= 1e-6
        print(f"exactness {method:36s} max rel err of fp32 masters vs fused AdamW: {rel:.2e}", flush=True)
        del opt, ps, got
        free_all()
    del ref_ps, masters
    free_all()
    return out


def roofline(n: int, rate: float, bw: dict[str, float], duplex: bool = False) -> tuple[float, float, float, float]:
    """(best time, GPU fraction, GPU-engine-only time, host-engine-only time) in seconds, from the measured
    pinned copy bandwidths ``bw`` (bytes/s: 'h2d', 'd2h', 'duplex') and host kernel ``rate`` (params/s).

    The GPU engine moves 12 B/param up and 12 B/param down, the host engine 4 B/param down (fp32 grad) and
    2 B/param up (bf16 param) plus its kernel time. ``duplex=False`` (the roofline): one direction at a time,
    up bytes at the H2D rate then down bytes at the D2H rate; ``duplex=True`` (the bound): both directions at
    once, each at the duplex rate. At each GPU share the time is the larger of the copies and the host
    kernel's share; the best share is searched in steps of 1%."""
    def pcie(f: float) -> float:
        up, down = n * (12 * f + 2 * (1 - f)), n * (12 * f + 4 * (1 - f))
        return max(up, down) / bw["duplex"] if duplex else up / bw["h2d"] + down / bw["d2h"]

    best = (float("inf"), 0.0)
    for i in range(101):
        f = i / 100
        best = min(best, (max(pcie(f), (1 - f) * n / rate), f))
    return best[0], best[1], pcie(1.0), n / rate + pcie(0.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0, 2.6], help="billions of parameters")
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 16, 4])
    ap.add_argument("--bucket", type=int, nargs="+", default=[100_000_000],
                    help="parameters per bucket; peers without buckets run at the first one only")
    ap.add_argument("--methods", nargs="+", default=["peakflat", "peakflat-gpu", "peakflat-cpu",
                                                      "megatron-hybrid-optimizer",
                                                      "megatron-hybrid-optimizer-nooverlap", "gpu-fused-adamw"])
    ap.add_argument("--reps", type=int, default=MIN_REPS, help=f"timed repetitions per round (at least {MIN_REPS})")
    harness.repeats_arg(ap)
    ap.add_argument("--copy-mib", type=int, default=1024, help="bytes per copy of the bandwidth measurement")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: tiny shapes (200K parameters, 50K-element tensors), 1 thread, the rows written to "
                         "--out (default: a temporary file); CUDA-only steps are skipped with their reason")
    ap.add_argument("--out", type=Path, default=None, help="results file (default: bench/results/optimizer.json)")
    args = ap.parse_args(argv)
    if args.reps < MIN_REPS:
        ap.error(f"--reps {args.reps}: every timed figure is the median of at least {MIN_REPS} repetitions; "
                 f"pass --reps {MIN_REPS} or more")
    if args.rounds < 1:
        ap.error(f"--repeats {args.rounds}: pass 1 or more")
    tensor = TENSOR
    if args.dry_run:
        import tempfile

        args.sizes, args.threads, args.bucket, tensor = [0.0002], [1], [100_000], 50_000
        args.out = args.out or Path(tempfile.mkdtemp()) / "optimizer.json"
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise SystemExit("bench/optimizer.py measures on a GPU; on CPU pass --dry-run")
    how = ensure_extension() if cuda else "not built (CPU dry run)"
    from megatron_peakflat import _ext

    ext = _ext.load()
    print(f"extension: {how}; loaded={ext is not None} ({_ext.reason()}); isa={ext.adamw_isa() if ext else '-'}",
          flush=True)
    skipped = {} if cuda else {m: CUDA_ONLY[m] for m in args.methods if m in CUDA_ONLY}
    runnable = [m for m in args.methods if m not in skipped]
    t_start = time.time()
    exact = exactness(runnable, args.threads[0], *((200_000, tensor) if args.dry_run else ()))
    if cuda:
        bw_runs = copy_bandwidth(args.copy_mib * 2**20, args.reps)
        bw = {k: statistics.median(v) for k, v in bw_runs.items()}
        bw_extra = {k2: v2 for k, v in bw_runs.items() for k2, v2 in spread([x / 1e9 for x in v], f"{k}_gb_s").items()}
        print("pinned copies (GB/s, median [min, max] of %d): " % args.reps + ", ".join(
            f"{k} {bw_extra[k + '_gb_s']} [{bw_extra[k + '_gb_s_min']}, {bw_extra[k + '_gb_s_max']}]"
            for k in ("h2d", "d2h", "duplex")) + " (duplex: each direction, both at once)", flush=True)
    else:
        bw, bw_extra = None, {"bandwidth_skipped": "pinned copies need CUDA"}
        print("pinned copy bandwidth: skipped (needs CUDA); no roofline on CPU", flush=True)
    rows: list[harness.Row] = []
    for size in args.sizes:
        n = int(size * 1e9)
        for threads in args.threads:
            torch.set_num_threads(threads)
            rates = host_kernel_rate(threads, ext, min(n, tensor), args.reps)
            rate = statistics.median(rates)
            base_extra = dict(bw_extra, **spread([r / 1e9 for r in rates], "host_kernel_gparam_s"))
            if bw is not None:
                rl, rl_f, rl_gpu, rl_cpu = roofline(n, rate, bw)
                dx, dx_f, _, _ = roofline(n, rate, bw, duplex=True)
                base_extra.update(roofline_ms=round(rl * 1e3, 1), roofline_gpu_share=rl_f,
                                  duplex_bound_ms=round(dx * 1e3, 1), duplex_gpu_share=dx_f)
                print(f"\nparams={size}B,threads={threads}: host kernel {rate / 1e9:.2f} Gparam/s ({n / rate * 1e3:.0f} ms "
                      f"for all params); roofline {rl * 1e3:.0f} ms at GPU share {rl_f:.2f} (one copy direction at a "
                      f"time; GPU engine alone {rl_gpu * 1e3:.0f} ms = {24 * n / 1e9:.1f} GB, host engine alone "
                      f"{rl_cpu * 1e3:.0f} ms); duplex bound {dx * 1e3:.0f} ms at GPU share {dx_f:.2f}", flush=True)
            else:
                print(f"\nparams={size}B,threads={threads}: host kernel {rate / 1e9:.3f} Gparam/s", flush=True)
            ps = make_params(n, tensor=tensor)
            for bucket in args.bucket:
                case = f"params={size}B,bucket={bucket // 1_000_000 or bucket}{'M' if bucket >= 1_000_000 else ''}," \
                       f"threads={threads}"
                _run_case(args, case, ps, bucket, threads, exact, skipped, rows, base_extra,
                          peers=bucket == args.bucket[0])
            _compare(rows, size, threads)
            del ps
            free_all()
    harness.print_ratio_summary(rows)
    harness.write("optimizer", rows, merge=True, out=args.out)
    print(f"total {time.time() - t_start:.0f}s", flush=True)


def _compare(rows: list[harness.Row], size: float, threads: int) -> None:
    """Each peakflat row of (size, threads) against HybridDeviceOptimizer's row of the same case (same card:
    ``harness.ratio``) and against the roofline and duplex bound measured in this run."""
    mine = [r for r in rows if r.case.startswith(f"params={size}B,") and r.case.endswith(f",threads={threads}")]
    hdo = next((r for r in mine if r.method == "megatron-hybrid-optimizer" and r.ms), None)
    for r in mine:
        if not (r.ms and r.method.startswith("peakflat")):
            continue
        parts = []
        if hdo is not None:
            r.extra["x_hybrid"] = round(harness.ratio(r, hdo), 3)
            parts.append(f"{r.extra['x_hybrid']:.2f}x HybridDeviceOptimizer")
        for key, name in (("roofline_ms", "roofline"), ("duplex_bound_ms", "duplex bound")):
            if r.extra.get(key):
                r.extra["x_" + key[:-3]] = round(r.ms / r.extra[key], 3)
                parts.append(f"{r.extra['x_' + key[:-3]]:.2f}x the {name} ({r.extra[key]:.0f} ms)")
        print(f"  {r.case:36s} {r.method:14s} {r.ms:8.1f} ms" + (" = " + ", ".join(parts) if parts else ""), flush=True)


def _run_case(args: argparse.Namespace, case: str, ps: list, bucket: int, threads: int, exact: dict,
              skipped: dict[str, str], rows: list, base_extra: dict, peers: bool) -> None:
    """Every method of one (size, bucket, threads) case, timed in ``args.rounds`` rounds taken in turn (each
    method built afresh in each round, outside the timing); ``peers``: also the methods without buckets."""
    from megatron_peakflat import stats

    methods = []
    for method in args.methods:
        if method == "gpu-fused-adamw" and threads != args.threads[0]:
            continue  # does not use the host
        if not peers and not method.startswith("peakflat"):
            continue
        if method in skipped:
            rows.append(harness.stamp([harness.Row(case, method, None, None, None, {"skipped": skipped[method]})])[0])
            print(f"{case:48s} {method:28s} skipped: {skipped[method]}", flush=True)
            continue
        methods.append(method)
    runs: dict[str, list[tuple[list[float], float | None]]] = {m: [] for m in methods}
    setup: dict[str, float] = {}
    errors: dict[str, str] = {}
    snaps: dict[str, dict] = {}
    for r in range(args.rounds):
        shared = None  # one OffloadStreamAdamW per round: the peakflat rows switch its engine
        for method in methods:
            if method in errors:
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
                setup[method] = round(time.time() - t0, 1)
                warm = 4 if method == "peakflat" else 1  # 'auto' measures its split over 3 steps
                runs[method].append(timings(opt.step, warmup=warm, reps=args.reps))
            except (RuntimeError, MemoryError) as e:
                print(f"{method}: {type(e).__name__}: {e}", flush=True)
                errors[method] = "OOM" if isinstance(e, torch.OutOfMemoryError) else str(e)[:200]
                continue
            times = runs[method][-1][0]
            print(f"{case:48s} {method:28s} round {r + 1}: median {statistics.median(times):.3f} ms "
                  f"[{min(times):.3f}, {max(times):.3f}]", flush=True)
            if method.startswith("peakflat"):
                snap = stats.snapshot().get("optimizer", {})
                snaps[method] = {k: snap.get(k) for k in ("host_bytes", "host_pinned", "gpu_buckets", "cpu_buckets",
                                                          "auto_gpu_fraction", "gpu_staging_bytes")}
            del opt
            if shared is None:
                free_all()
        del shared
        free_all()
    for method in methods:
        if method in errors and not runs[method]:
            rows.append(harness.stamp([harness.Row(case, method, None, None, exact.get(method),
                                                   {"error": errors[method], **base_extra})])[0])
            continue
        medians = [statistics.median(t) for t, _ in runs[method]]
        every = [x for t, _ in runs[method] for x in t]
        peaks = [p for _, p in runs[method] if p is not None]
        extra = dict(base_extra, ms_min=round(min(every), 3), ms_max=round(max(every), 3), reps=args.reps,
                     rounds=len(medians), ms_rounds=[round(m, 3) for m in medians], setup_s=setup.get(method),
                     **snaps.get(method, {}))
        row = harness.Row(case, method, round(max(peaks), 4) if peaks else None, round(statistics.median(medians), 3),
                          exact.get(method), extra)
        harness.repeated(row, medians)  # ms: the median of the rounds' medians, each in extra.runs_ms
        rows.append(harness.stamp([row])[0])  # now, while torch runs this case's host threads
        print(f"{case:48s} {method:28s} peak={row.peak_gib!s:>10} GiB  ms={row.ms} (median of {len(medians)} "
              f"rounds' medians, {args.reps} reps each)  exact={row.exact}", flush=True)


if __name__ == "__main__":
    main()
