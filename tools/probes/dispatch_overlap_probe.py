"""Probe (EP=1): do a chunk's memory-bound kernels hide behind the next chunk's grouped GEMMs on a second stream?

At EP=1 nothing travels, so chunking's own costs (a row gather per chunk, the combine's per-chunk
gather-sum) are not hidden behind communication. This times one chunk's grouped GEMMs (with the SwiGLU
between them) and one such memory-bound kernel alone, one after the other, and on two streams (CUDA
events, median of 20). Results: ``docs/evidence/probes/dispatch_overlap_probe.txt``.

    python3 tools/probes/dispatch_overlap_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import measure  # noqa: E402
from megatron_peakflat.dispatch.combine import combine_map, gather_sum  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    """Median ms of 20 calls after 3 (``harness.measure``: CUDA events around each call)."""
    return measure(fn, warmup=3, reps=20)[1]


def main() -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    E, H, F, k, T = 16, 4096, 1536, 8, 32768  # one chunk of four: 64 experts top-8, 16 experts' rows
    n = T * k // 4
    x = torch.randn(n, H, device=dev, dtype=bf16)
    w1 = torch.randn(E, 2 * F, H, device=dev, dtype=bf16) * 0.02
    w2 = torch.randn(E, H, F, device=dev, dtype=bf16) * 0.02
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (n // E)
    src = torch.randn(T, H, device=dev, dtype=bf16)
    tok = torch.randint(0, T, (n,), device=dev)
    rows = torch.randn(n, H, device=dev, dtype=bf16)
    cmap = combine_map(tok.sort().values, [0, n], T)
    out = torch.zeros(T, H, device=dev, dtype=bf16)
    side = torch.cuda.Stream(priority=-1)

    def gemm() -> torch.Tensor:
        h = torch._grouped_mm(x, w1.transpose(-1, -2), offs=offs)
        z = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
        return torch._grouped_mm(z, w2.transpose(-1, -2), offs=offs)

    def gather() -> torch.Tensor:
        return src.index_select(0, tok)

    def gsum() -> None:
        gather_sum(rows, cmap.perm, cmap.token, cmap.count, out)

    def serial(mem: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            mem()
            gemm()
        return run

    def two_streams(mem: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                mem()
            gemm()
            torch.cuda.current_stream().wait_stream(side)
        return run

    g = timed(gemm)
    for name, mem in (("gather", gather), ("gather_sum", gsum)):
        print(f"{name}: gemm {g:.3f} ms, {name} {timed(mem):.3f} ms, serial {timed(serial(mem)):.3f} ms, "
              f"two streams {timed(two_streams(mem)):.3f} ms", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("tools/probes/dispatch_overlap_probe.py needs a CUDA device")
    main()
