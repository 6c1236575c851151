"""Diagnostic: ways to add one chunk's expert weight gradients into fp32 main_grad on the GPU.

    python3 bench/probes/wgrad_micro.py        # 64 experts, H=4096, F=1536 (SwiGLU), 1024 and 4096 rows per expert

Ways: ``grouped+add`` (what grouped.py does: a grouped GEMM to bf16 in 256 MiB blocks, then one add
into main_grad), ``grouped-only`` (the GEMMs without the add), ``addmm-fp32`` (one cuBLAS GEMM per expert
accumulating into fp32 main_grad, beta=1), ``mm+add`` (per expert, bf16 GEMM then add). Prints ms per chunk.
"""

from __future__ import annotations

import torch


def timeit(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main() -> None:
    E, H, F = 64, 4096, 1536
    dev = "cuda"
    mg1 = torch.zeros(E, 2 * F, H, device=dev)
    mg2 = torch.zeros(E, H, F, device=dev)
    for r in (1024, 4096):
        M = E * r
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        dh = torch.randn(M, 2 * F, device=dev, dtype=torch.bfloat16)
        z = torch.randn(M, F, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * r
        block = max(1, (256 << 20) // (2 * F * H * 2))

        def grouped(add: bool) -> None:
            for left, right, mg in ((dh, x, mg1), (dy, z, mg2)):
                for i in range(0, E, block):
                    j = min(E, i + block)
                    g = torch._grouped_mm(left[i * r:j * r].t(), right[i * r:j * r], offs=offs[:j - i])
                    if add:
                        mg[i:j].add_(g)

        def addmm() -> None:
            for left, right, mg in ((dh, x, mg1), (dy, z, mg2)):
                for e in range(E):
                    torch.addmm(mg[e], left[e * r:(e + 1) * r].t(), right[e * r:(e + 1) * r], out_dtype=torch.float32,
                                out=mg[e])

        def mm_add() -> None:
            for left, right, mg in ((dh, x, mg1), (dy, z, mg2)):
                for e in range(E):
                    mg[e].add_(left[e * r:(e + 1) * r].t() @ right[e * r:(e + 1) * r])

        flops = 2 * M * H * 3 * F
        res = {"grouped+add": timeit(lambda: grouped(True)), "grouped-only": timeit(lambda: grouped(False))}
        try:
            res["addmm-fp32"] = timeit(addmm)
        except (RuntimeError, TypeError) as exc:
            print(f"addmm-fp32 unavailable: {exc}")
        res["mm+add"] = timeit(mm_add)
        print(f"rows/expert {r} ({M} rows, {flops / 1e12:.1f} TFLOP): " +
              ", ".join(f"{k} {v:.2f} ms ({flops / v / 1e9:.0f} TF/s)" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
