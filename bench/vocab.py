"""Ring-DTP (single GPU, tp=1) against Megatron's CE (native and fused), Liger FLCE and CCE.

Same process, same bf16 inputs; each method runs forward + backward of the mean token loss and returns
dX and dW (``torch.autograd.grad``), so the gradients count in the peak as they do in training. Peak is
the allocation above the inputs (bench/harness.py). ``exact`` says whether loss, dX and dW are within
``--tol`` (relative Frobenius norm) of an fp32 reference computed token-chunk by token-chunk; the errors
themselves are in each row's extras (``err_loss``, ``err_dx``, ``err_dw``).

    python bench/vocab.py                      # default cases (about 2-3 minutes on an H200)
    python bench/vocab.py --cases 16384x4096x201088 --methods peakflat,peakflat-b4096,liger-flce
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, run_row, write  # noqa: E402
from megatron_peakflat.vocab import ring_linear_cross_entropy  # noqa: E402

DEFAULT_CASES = "32768x7168x201088,16384x4096x201088,32768x7168x128256,16384x4096x128256"
ALL_METHODS = "peakflat,peakflat-input,peakflat-b4096,megatron-native-ce,megatron-fused-ce,liger-flce,cce"

Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _init_megatron() -> bool:
    """A 1-rank NCCL group and Megatron's parallel_state with tp=1 (its CE functions need a TP group)."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            from megatron_peakflat.testing.distributed import free_port

            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("nccl", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1)
        return True
    except Exception as e:  # noqa: BLE001
        print(f"megatron peers skipped: {type(e).__name__}: {e}")
        return False


def _peakflat_variant(name: str) -> Method:
    """'peakflat' (the flags' defaults), 'peakflat-input' (accumulate='input'), '-b<rows>' (block size),
    '-torch' (plain-PyTorch block kernel); suffixes combine, e.g. 'peakflat-input-b4096'."""
    kw: dict[str, Any] = {}
    for part in name.split("-")[1:]:
        if part == "input":
            kw["accumulate"] = "input"
        elif part == "torch":
            kw["kernel"] = "torch"
        elif part.startswith("b") and part[1:].isdigit():
            kw["block_size"] = int(part[1:])
        else:
            raise SystemExit(f"unknown peakflat variant {name!r} (suffixes: input, torch, b<rows>)")
    return lambda x, w, y: ring_linear_cross_entropy(x, w, y, reduction="mean", **kw)


def methods(wanted: set[str]) -> dict[str, Method]:
    out: dict[str, Method] = {}
    for name in sorted(m for m in wanted if m == "peakflat" or m.startswith("peakflat-")):
        out[name] = _peakflat_variant(name)
    if wanted & {"megatron-native-ce", "megatron-fused-ce"} and _init_megatron():
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        tp = parallel_state.get_tensor_model_parallel_group()
        if "megatron-native-ce" in wanted:
            out["megatron-native-ce"] = lambda x, w, y: vocab_parallel_cross_entropy(
                (x @ w.t()).unsqueeze(1), y.unsqueeze(1), tp_group=tp).mean()
        if "megatron-fused-ce" in wanted:
            try:
                from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

                out["megatron-fused-ce"] = lambda x, w, y: fused_vocab_parallel_cross_entropy(
                    (x @ w.t()).unsqueeze(1), y.unsqueeze(1), tp).mean()
            except ImportError as e:
                print(f"megatron-fused-ce skipped: {e}")
    if "liger-flce" in wanted:
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            liger = LigerFusedLinearCrossEntropyLoss()
            out["liger-flce"] = lambda x, w, y: liger(w, x, y)
        except ImportError as e:
            print(f"liger-flce skipped: {e}")
    if "cce" in wanted:
        try:
            from cut_cross_entropy import linear_cross_entropy

            out["cce"] = lambda x, w, y: linear_cross_entropy(x, w, y)
        except ImportError as e:
            print(f"cce skipped: {e}")
    return out


@torch.no_grad()
def fp32_reference(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int = 2048):
    """Mean loss, dX and dW in fp32 (no TF32), a chunk of tokens at a time."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        wf = w.float()
        n = x.shape[0]
        dw = torch.zeros_like(wf)
        dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for s in range(0, n, chunk):
            xc = x[s:s + chunk].float()
            z = xc @ wf.t()
            lse = torch.logsumexp(z, dim=1)
            rows = torch.arange(z.shape[0], device=z.device)
            total += (lse - z[rows, y[s:s + chunk]]).double().sum()
            z.sub_(lse[:, None]).exp_()
            z[rows, y[s:s + chunk]] -= 1.0
            z.div_(n)
            dx[s:s + chunk] = z @ wf
            dw.addmm_(z.t(), xc)
            del z
        return (total / n).float(), dx, dw
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of NxHxV (default: %(default)s)")
    ap.add_argument("--methods", default=ALL_METHODS, help="comma list (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tol", type=float, default=2e-2, help="relative error for exact=True (bf16 level)")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 reference (exact=None)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/vocab.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    meths = methods(set(args.methods.split(",")))
    rows: list[Row] = []
    for spec in args.cases.split(","):
        N, H, V = (int(t) for t in spec.lower().split("x"))
        case = f"N={N},H={H},V={V},tp=1"
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
        w = (torch.randn(V, H, device="cuda", generator=g) * (H ** -0.5)).to(torch.bfloat16).requires_grad_(True)
        y = torch.randint(0, V, (N,), device="cuda", generator=g)
        ref = None if args.no_check else fp32_reference(x.detach(), w.detach(), y)
        torch.cuda.empty_cache()
        for name, fn in meths.items():
            def step(fn=fn):
                return torch.autograd.grad(fn(x, w, y), (x, w))

            extra: dict[str, Any] = {}
            exact = None
            if ref is not None:
                try:
                    x.grad = w.grad = None
                    loss = fn(x, w, y)
                    dx, dw = torch.autograd.grad(loss, (x, w))
                    errs = (_rel(loss.detach(), ref[0]), _rel(dx, ref[1]), _rel(dw, ref[2]))
                    extra = {"err_loss": errs[0], "err_dx": errs[1], "err_dw": errs[2]}
                    exact = all(e <= args.tol for e in errs)
                    del loss, dx, dw
                except torch.OutOfMemoryError:
                    extra = {"error": "OOM"}
                torch.cuda.empty_cache()
            rows.append(run_row(case, name, step, exact=exact, warmup=args.warmup, reps=args.reps, **extra))
        del x, w, y, ref
        torch.cuda.empty_cache()
    write("vocab", rows)


if __name__ == "__main__":
    main()
