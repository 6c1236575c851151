"""Does the single-GPU Ring-DTP chunk loop gain from running each chunk's fold_grad on a second stream, beside
the GEMMs of its neighbours, with the GEMMs held off a few SMs (cuBLASLt's SM count target)?

The loop (``vocab/in_forward.py``, TP=1) runs per chunk: logits GEMM -> fold_grad (memory-bound Triton pass)
-> dX GEMM -> dW GEMM (beta=1 into an fp32 main_grad), one after another. At N=32768, H=7168, V=201088 the
GEMMs run at the H200's power limit with the SM clock throttled (``vocab_tp1_power.txt``), so fewer SMs may
lose little GEMM throughput, and the SMs set aside could fold the next chunk meanwhile. This times, in one
process on the same tensors:

- ``serial``: the loop as it is;
- ``overlap-s<N>``: chunk j's fold_grad on a side stream while the main stream runs chunk j-1's dX and dW
  (two logits buffers), the GEMMs with ``torch._C._set_sm_carveout_experimental(N)`` (N=0: no carveout).

    python tools/probes/vocab_overlap_probe.py --chunk 4096 --carveouts 0,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import timed_call  # noqa: E402
from megatron_peakflat.matmul import accumulate_mm  # noqa: E402
from megatron_peakflat.vocab.block_triton import fold_grad_logits_triton  # noqa: E402


def _timed(fn, reps: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    return [timed_call(fn) for _ in range(reps)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="32768x7168x201088")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--carveouts", default="0,8,16,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blas", default="cublas,cublaslt", help="torch.backends.cuda.preferred_blas_library values")
    args = ap.parse_args(argv)
    N, H, V = (int(t) for t in args.case.lower().split("x"))
    c = args.chunk
    K = N // c
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    ws = torch.full((N,), 1.0 / N, device="cuda")
    main_grad = torch.zeros(V, H, device="cuda")
    dx = torch.empty(N, H, device="cuda", dtype=torch.bfloat16)
    zbuf = [torch.empty(c, V, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    states = [torch.empty(4, c, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()

    def fold(j: int) -> torch.Tensor:
        sl = slice(j * c, (j + 1) * c)
        return fold_grad_logits_triton(zbuf[j % 2], y[sl], states[j % 2], ws[sl], 0.0, V)

    def back(j: int, d: torch.Tensor) -> None:
        sl = slice(j * c, (j + 1) * c)
        torch.mm(d, w, out=dx[sl])
        accumulate_mm(main_grad, d.t(), x[sl])

    def serial() -> None:
        for j in range(K):
            torch.mm(x[j * c:(j + 1) * c], w.t(), out=zbuf[j % 2])
            back(j, fold(j))

    def overlap() -> None:
        main = torch.cuda.current_stream()
        folded: list[torch.cuda.Event] = []
        for j in range(K + 1):
            if j < K:
                if j >= 2:
                    main.wait_event(folded[j - 2])  # buffer j % 2 was read by chunk j-2's dX/dW, queued before
                torch.mm(x[j * c:(j + 1) * c], w.t(), out=zbuf[j % 2])
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    fold(j)
                    done = torch.cuda.Event()
                    done.record(side)
                folded.append(done)
            if j >= 1:
                main.wait_event(folded[j - 1])
                back(j - 1, zbuf[(j - 1) % 2])
        torch.cuda.current_stream().wait_stream(side)

    carveouts = [int(s) for s in args.carveouts.split(",")]
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for blas in args.blas.split(","):
            torch.backends.cuda.preferred_blas_library(blas)
            torch._C._set_sm_carveout_experimental(None)
            results.setdefault(f"{blas}:serial", []).extend(_timed(serial, args.reps))
            for n in carveouts:
                torch._C._set_sm_carveout_experimental(n or None)
                results.setdefault(f"{blas}:overlap-s{n}", []).extend(_timed(overlap, args.reps))
            torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("cublas")
    # the overlapped loop's results against the serial loop's, bit for bit
    main_grad.zero_()
    serial()
    ref_dx, ref_dw = dx.clone(), main_grad.clone()
    main_grad.zero_()
    overlap()
    torch.cuda.synchronize()
    same = torch.equal(ref_dx, dx) and torch.equal(ref_dw, main_grad)
    base = statistics.median(results[next(iter(results))])
    print(f"# N={N} H={H} V={V} chunk={c} K={K}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"ms per forward+backward loop, median of {args.rounds} x {args.reps}; overlap bitwise equal: {same}")
    for name, ts in results.items():
        med = statistics.median(ts)
        print(f"{name:22s} {med:8.2f} ms  {med / base:.3f}x the first  [{', '.join(f'{t:.1f}' for t in ts)}]")


if __name__ == "__main__":
    main()
