"""A/B in one process: Ring-DTP's in-forward call with fold_grad's gradient pass walking each row back (as
committed since 91b1dce) or forward (before), beside Liger's fused linear cross-entropy.

``vocab_fold_l2_probe.py`` timed the kernel alone (1.046x, then 1.004x, then 0.997x over 7 rounds in turn); this times the whole call, forward
and backward, at one shape, the variants in turn within each round so that clock and power drift touch both
alike. The forward walk (``fold_grad_logits_triton(..., backward_walk=False)``, the kernel before 91b1dce) is
swapped in for ``block_triton.fold_grad_logits_triton`` (``vocab.blocks.block_ops`` looks it up at every
call). Both variants give the same bits; the script checks dX and dW of one call of each. Prints a line per round and the medians; nothing is merged into bench/results.
    python3 bench/probes/vocab_fold_ab.py [--case 32768x7168x201088 --reps 5 --rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import measure  # noqa: E402
from bench.vocab import _grad_step, methods  # noqa: E402
from megatron_peakflat.vocab import block_triton as bt  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="32768x7168x201088")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/probes/vocab_fold_ab.py needs a CUDA device")
    N, H, V = (int(t) for t in args.case.lower().split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=g) * (H ** -0.5)).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda"), False
    fns = methods({"peakflat-fwd-main-grad", "liger-flce"})
    reverse_kernel = bt.fold_grad_logits_triton

    def ours(kernel):
        def step():
            bt.fold_grad_logits_triton = kernel
            try:
                return _grad_step(fns["peakflat-fwd-main-grad"], x, w, y)()
            finally:
                bt.fold_grad_logits_triton = reverse_kernel
        return step

    variants = {"reverse (committed)": ours(reverse_kernel),
                "forward (before 91b1dce)": ours(functools.partial(reverse_kernel, backward_walk=False)),
                "liger-flce": _grad_step(fns["liger-flce"], x, w, y)}
    grads = {}
    for name in ("reverse (committed)", "forward (before 91b1dce)"):
        w.main_grad.zero_()
        dx, _ = variants[name]()
        grads[name] = (dx.clone(), w.main_grad.clone())
    same = all(torch.equal(a, b) for a, b in zip(*grads.values()))
    print(f"case N={N},H={H},V={V}; dX and dW (main_grad) of the two walks bitwise equal: {same}", flush=True)
    ms: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, step in variants.items():
            ms[name].append(measure(step, warmup=1, reps=args.reps)[1])
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.2f} ms" for k, v in ms.items()), flush=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print("median of rounds: " + "  ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
    rev, fwd, lig = med["reverse (committed)"], med["forward (before 91b1dce)"], med["liger-flce"]
    print(f"reverse / forward {rev / fwd:.4f}x; against liger-flce: reverse {rev / lig:.4f}x, forward {fwd / lig:.4f}x")


if __name__ == "__main__":
    main()
