"""Does the layout of a chunk's logits or the chunk size change the GEMMs of Ring-DTP's in-forward call?

The three GEMMs of every chunk (logits, dX, dW added into an fp32 main_grad) run back to back over all
N=32768 tokens, as in ``vocab/in_forward.py`` but without the fold and gradient passes (the logits are
scaled down in place instead, so that dX and dW read gradient-sized values): logits laid out [chunk, V]
(what the code does) or [V, chunk], chunks of 4096 or 8192 tokens, the row-major layout timed before and
after the transposed one. Then the logits GEMM alone in both layouts. One GPU; medians of 3 (loops) and
5 (single GEMMs) timed runs after one warm-up. A diagnostic: it prints, it writes no results file.

    python3 tools/probes/vocab_gemm_layout.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import measure  # noqa: E402
from megatron_peakflat.matmul import accumulate_mm  # noqa: E402

N, H, V = 32768, 7168, 201088


def _loop(x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor, chunk: int, transposed: bool
          ) -> Callable[[], None]:
    dx = torch.empty(N, H, device="cuda", dtype=torch.bfloat16)

    def run() -> None:
        for lo in range(0, N, chunk):
            xc = x[lo:lo + chunk]
            if transposed:
                z = w @ xc.t()  # [V, chunk]
                z.mul_(1e-9)
                torch.mm(z.t(), w, out=dx[lo:lo + chunk])
                accumulate_mm(main_grad, z, xc)
            else:
                z = xc @ w.t()  # [chunk, V]
                z.mul_(1e-9)
                torch.mm(z, w, out=dx[lo:lo + chunk])
                accumulate_mm(main_grad, z.t(), xc)
            del z

    return run


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("tools/probes/vocab_gemm_layout.py needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    main_grad = torch.zeros(V, H, device="cuda")
    for chunk in (4096, 8192):
        for transposed in (False, True, False):
            ms = measure(_loop(x, w, main_grad, chunk, transposed), warmup=1, reps=3)[1]
            print(f"chunk={chunk} transposed={transposed}: {ms:.1f} ms", flush=True)
    xc = x[:4096]
    for name, fn in (("logits row", lambda: xc @ w.t()), ("logits T", lambda: w @ xc.t())):
        ms = measure(fn, warmup=1, reps=5)[1]
        print(f"{name}: {ms:.2f} ms {2 * 4096 * H * V / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
