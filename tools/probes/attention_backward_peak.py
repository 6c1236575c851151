"""What torch SDPA's causal backward allocates at long context, as ``integration/attention.py`` calls it:
q, k, v handed over as permuted views of Megatron's [s, b, heads, head_dim] tensors, the output permuted
back and reshaped to [s, b, hidden]. The planner's ``attention_backward_transient`` counts this; the 128K
run on one H200 peaked inside it (docs/evidence/memory_peak_128k.txt) under ``--deterministic-mode``, which
calls ``torch.use_deterministic_algorithms(True)``.

Per case: the peak allocated above what is alive before ``backward`` (q, k, v, the output, dO), in GiB and
in units of one [s, b, hidden] bf16 tensor, with deterministic algorithms off and on, for torch's default
backend choice and each backend forced.

    python tools/probes/attention_backward_peak.py --seqs 32768,131072
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def one(s: int, heads: int, dim: int, backend: str, deterministic: bool) -> str:
    torch.use_deterministic_algorithms(deterministic, warn_only=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, 1, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    unit = s * heads * dim * 2 / 2**30
    try:
        with sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                                 is_causal=True, scale=dim ** -0.5)
            out = out.permute(2, 0, 1, 3).reshape(s, 1, heads * dim)
            d_out = torch.randn_like(out)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out.backward(d_out)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        held = (torch.cuda.memory_allocated() - base) / 2**30
        return (f"s={s:7d} {backend:9s} deterministic={deterministic!s:5s} backward peak +{peak:6.2f} GiB "
                f"({peak / unit:5.2f} x [s,hidden] bf16), after +{held:5.2f} GiB (dq, dk, dv), {ms:7.1f} ms")
    except Exception as e:  # noqa: BLE001
        return f"s={s:7d} {backend:9s} deterministic={deterministic!s:5s} failed: {type(e).__name__}: {str(e)[:120]}"
    finally:
        torch.use_deterministic_algorithms(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--backends", default="default,flash,cudnn,efficient")
    a = ap.parse_args()
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, b=1, heads={a.heads}, head_dim={a.dim}, "
          "bf16, causal")
    for s in (int(x) for x in a.seqs.split(",")):
        for backend in a.backends.split(","):
            for det in (False, True):
                one(s, a.heads, a.dim, backend, det)  # warm-up (kernels, workspaces)
                print(one(s, a.heads, a.dim, backend, det), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
