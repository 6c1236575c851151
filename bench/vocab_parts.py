"""Where one in-forward Ring-DTP chunk spends its time on one GPU: each step of ``in_forward.py``'s loop
timed alone (CUDA events, median of ``--reps``), against the whole call.

    python bench/vocab_parts.py                       # N=32768, H=7168, V=201088, chunk 4096 (bf16)
    python bench/vocab_parts.py --case 16384x4096x201088 --chunk 2048

Rows (bench/results/vocab_parts.json): per chunk ``logits`` (x @ W.T), ``fold`` (Triton log-sum-exp
pass), ``grad`` (Triton in-place softmax gradient), ``dx`` (G @ W), ``dw`` (G.T @ x added into an fp32
main_grad); ``chunks x sum`` and the measured ``whole call`` (forward + backward of the mean loss).
``extra`` has each step's TFLOP/s or GB/s. ``--profile`` also prints the whole call's kernels under
``torch.profiler`` (GPU busy time against the call's time, top kernels), and Liger's for comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, cuda_kernels, gap_summary, measure, write  # noqa: E402
from megatron_peakflat.matmul import accumulate_mm  # noqa: E402
from megatron_peakflat.vocab import ring_linear_cross_entropy  # noqa: E402
from megatron_peakflat.vocab.block_triton import fold_logits_triton, grad_logits_triton  # noqa: E402


def _time(fn: Callable[[], object], reps: int) -> float:
    return measure(fn, warmup=1, reps=reps)[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="32768x7168x201088", help="NxHxV (default: %(default)s)")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print the whole call's kernels (and Liger's)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/vocab_parts.py needs a CUDA device")
    N, H, V = (int(t) for t in args.case.lower().split("x"))
    c = args.chunk
    case = f"N={N},H={H},V={V},tp=1,chunk={c}"
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    main_grad = torch.zeros(V, H, device="cuda")
    xc, yc = x[:c], y[:c]
    z = xc @ w.t()
    st = torch.zeros(4, c, device="cuda")
    coef = torch.stack([torch.full((c,), 12.0, device="cuda"), *(torch.full((c,), 1.0 / N, device="cuda"),) * 3])
    dx = torch.empty(c, H, device="cuda", dtype=torch.bfloat16)

    def fold() -> None:
        st.zero_()
        st[0].fill_(float("-inf"))
        fold_logits_triton(z, yc, st)

    flops = 2.0 * c * H * V
    zbytes = c * V * 2
    parts = {
        "logits": (lambda: torch.mm(xc, w.t(), out=z), flops),
        "fold": (fold, -zbytes),
        "grad": (lambda: grad_logits_triton(z, yc, coef), -2 * zbytes),
        "dx": (lambda: torch.mm(z, w, out=dx), flops),
        "dw": (lambda: accumulate_mm(main_grad, z.t(), xc), flops),
    }
    rows: list[Row] = []
    total = 0.0
    n_chunks = -(-N // c)
    for name, (fn, work) in parts.items():
        ms = _time(fn, args.reps)
        total += ms
        rate = {"tflops": work / ms / 1e9} if work > 0 else {"gb_s": -work / ms / 1e6}
        rows.append(Row(case, name, None, round(ms, 3), None, rate))
        print(f"{case} {name:8s} {ms:8.3f} ms/chunk  {rate}", flush=True)
    rows.append(Row(case, "chunks x sum", None, round(total * n_chunks, 2), None, {"chunks": n_chunks}))
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    wr.main_grad, wr.grad_added_to_main_grad = main_grad, False

    def whole() -> None:
        loss = ring_linear_cross_entropy(xr, wr, y, reduction="mean", grad="in-forward", chunk_tokens=c,
                                         dw_into_main_grad=True)
        torch.autograd.grad(loss, (xr, wr))

    ms = _time(whole, args.reps)
    rows.append(Row(case, "whole call", None, round(ms, 2), None, {"ideal_6nhv_at_dx_rate_ms":
                                                                     round(3 * n_chunks * rows[3].ms, 2)}))
    print(f"{case} chunks x sum {total * n_chunks:8.2f} ms; whole call {ms:8.2f} ms", flush=True)
    write("vocab_parts", rows, merge=True)
    if args.profile:
        _profile("peakflat in-forward", whole, ms)
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            print("liger-kernel not installed: no Liger profile")
            return
        liger = LigerFusedLinearCrossEntropyLoss()

        def liger_call() -> None:
            torch.autograd.grad(liger(wr, xr, y), (xr, wr))

        _profile("liger", liger_call, _time(liger_call, args.reps))


def _profile(name: str, fn: Callable[[], object], call_ms: float, top: int = 12) -> None:
    """Kernels of one ``fn()`` call: GPU busy time (sum of kernel times) against the call's time, by kernel."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function("bench_call"):
            fn()
            torch.cuda.synchronize()
    kern, spans = cuda_kernels(prof)
    call = [ev.time_range for ev in prof.events() if ev.name == "bench_call" and ev.device_type != torch.autograd.DeviceType.CUDA]
    busy = sum(v[0] for v in kern.values())
    first_to_last = (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0
    print(f"\n=== {name}: call {call_ms:.1f} ms, GPU busy {busy:.1f} ms, first kernel start to last kernel end "
          f"{first_to_last:.1f} ms, {len(spans)} kernels")
    if call and spans:
        print(f"    host: first kernel {(spans[0][0] - call[0].start) / 1e3:.2f} ms after the call began, "
              f"call returned {(call[0].end - spans[-1][1]) / 1e3:.2f} ms after the last kernel")
    for kname, (kms, calls) in sorted(kern.items(), key=lambda t: -t[1][0])[:top]:
        print(f"    {kms:8.2f} ms {calls:5.0f}x  {kname[:140]}")
    print("    " + gap_summary(spans))


if __name__ == "__main__":
    main()
