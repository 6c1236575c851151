"""Probe: can the fold_grad kernel's second read of each logits row come from L2 instead of HBM?

``fold_grad`` reads a row of logits twice (fold, then gradient) and writes it once: 3 x 1.65 GB per
[4096, 201088] bf16 block. A row is 402 KB and about a thousand rows are in flight at once, so the row has
left the 50 MB L2 before its second pass. Variants, each timed against the kernel in ``block_triton``:

- ``reverse``: the gradient pass walks the row from its end, where the fold pass left off (the most recently
  read columns are the likeliest to still be in L2);
- ``persistent xK``: K programs per SM, each taking rows in turn, with the reversed second pass: at most
  SMs x K rows in flight, 132 x 402 KB = 53 MB at K=1.

Every variant's gradient and state must equal the forward walk's bit for bit (same arithmetic, same
order). Prints a line per variant; nothing is merged into bench/results. Run at 2ab9fef
(``vocab_fold_l2_probe.txt``), whose baseline was the committed forward walk; block_triton then took the
reversed pass, and both walks are now its ``_fold_grad_kernel`` (``BACKWARD`` False or True).
    python3 bench/vocab_fold_l2_probe.py [--rows 4096 --cols 201088 --reps 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.harness import measure  # noqa: E402
from megatron_peakflat.vocab import block_triton as bt  # noqa: E402
from megatron_peakflat.vocab.block_triton import _fold_grad_kernel, _fold_grad_row  # noqa: E402


@triton.jit
def _persistent_kernel(z_ptr, stride_z, lab_ptr, ws_ptr, state_ptr, n, ncols, keep, spread, COLS: tl.constexpr):
    for row in range(tl.program_id(0), n, tl.num_programs(0)):
        _fold_grad_row(z_ptr, stride_z, lab_ptr, ws_ptr, state_ptr, n, ncols, keep, spread, row, COLS, True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=201088)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/vocab_fold_l2_probe.py needs a CUDA device")
    n, V = args.rows, args.cols
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    z0 = (torch.randn(n, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    lab = torch.randint(0, V, (n,), device="cuda", generator=g)
    ws = torch.full((n,), 1.0 / 32768, device="cuda")
    moved = 3 * n * V * 2

    z_ref, st_ref = z0.clone(), torch.empty(4, n, device="cuda")
    bt.fold_grad_logits_triton(z_ref, lab, st_ref, ws, 0.0, V, backward_walk=False)
    z = z0.clone()
    st = torch.empty(4, n, device="cuda")
    base_ms = measure(lambda: bt.fold_grad_logits_triton(z, lab, st, ws, 0.0, V, backward_walk=False),
                      warmup=2, reps=args.reps)[1]
    shape = bt.SHAPES["fold_grad"]
    print(f"rows={n} V={V} sms={sms} fold_grad, forward walk ({shape.cols} cols, {shape.warps} warps): "
          f"{base_ms:.4f} ms, {moved / base_ms / 1e6:.1f} GB/s", flush=True)

    variants = [("reverse (committed)", _fold_grad_kernel, n, shape.cols, shape.warps, {"BACKWARD": True})]
    for per_sm in (1, 2, 4):
        for cols, warps in ((2048, 4), (4096, 8), (8192, 16)):
            variants.append((f"persistent x{per_sm} {cols} cols {warps} warps", _persistent_kernel,
                             sms * per_sm, cols, warps, {}))
    for name, kernel, grid, cols, warps, const in variants:
        def call() -> None:
            kernel[(grid,)](z, z.stride(0), lab, ws, st, n, V, 1.0, 0.0, COLS=cols, num_warps=warps, **const)

        z.copy_(z0)
        call()
        same = bool(torch.equal(z, z_ref)) and bool(torch.equal(st, st_ref)) if cols == shape.cols else None
        ms = measure(call, warmup=2, reps=args.reps)[1]
        print(f"  {name:36s} {ms:8.4f} ms  {moved / ms / 1e6:7.1f} GB/s (3 passes)  {base_ms / ms:5.3f}x  "
              f"bitwise same as the forward walk: {same}", flush=True)


if __name__ == "__main__":
    main()
