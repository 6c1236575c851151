"""Probe: can the fold_grad kernel's second read of each logits row come from L2 instead of HBM?

``fold_grad`` reads a row of logits twice (fold, then gradient) and writes it once: 3 x 1.65 GB per
[4096, 201088] bf16 block. A row is 402 KB and about a thousand rows are in flight at once, so the row has
left the 50 MB L2 before its second pass. Variants, each timed against the forward walk (``--rounds``: all
of them once per round, in turn):

- ``reverse``: the gradient pass walks the row from its end, where the fold pass left off (the most recently
  read columns are the likeliest to still be in L2);
- ``persistent xK``: K programs per SM, each taking rows in turn, with the reversed second pass: at most
  SMs x K rows in flight, 132 x 402 KB = 53 MB at K=1.

Every variant's gradient and state must equal the forward walk's bit for bit (same arithmetic, same
order). Prints a line per variant; nothing is merged into bench/results/. Run at 2ab9fef
(``vocab_fold_l2_probe.txt``), whose baseline was the committed forward walk; block_triton then took the
reversed pass, and both walks are now its ``_fold_grad_kernel`` (``BACKWARD`` False or True).
    python3 tools/probes/vocab_fold_l2_probe.py [--rows 4096 --cols 201088 --reps 10 --rounds 1 --walks-only]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
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
    ap.add_argument("--rounds", type=int, default=1, help="times every variant is timed, in turn (median kept)")
    ap.add_argument("--walks-only", action="store_true", help="only the forward and the reversed walk")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/probes/vocab_fold_l2_probe.py needs a CUDA device")
    n, V = args.rows, args.cols
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    z0 = (torch.randn(n, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    lab = torch.randint(0, V, (n,), device="cuda", generator=g)
    ws = torch.full((n,), 1.0 / 32768, device="cuda")
    moved = 3 * n * V * 2

    z = z0.clone()
    st = torch.empty(4, n, device="cuda")
    shape = bt.SHAPES["fold_grad"]
    print(f"rows={n} V={V} sms={sms}; fold_grad's launch shape {shape.cols} cols, {shape.warps} warps", flush=True)

    variants = [("forward walk", _fold_grad_kernel, n, shape.cols, shape.warps, {"BACKWARD": False}),
                ("reverse (committed)", _fold_grad_kernel, n, shape.cols, shape.warps, {"BACKWARD": True})]
    if not args.walks_only:
        for per_sm in (1, 2, 4):
            for cols, warps in ((2048, 4), (4096, 8), (8192, 16)):
                variants.append((f"persistent x{per_sm} {cols} cols {warps} warps", _persistent_kernel,
                                 sms * per_sm, cols, warps, {}))
    calls, same = {}, {}
    z_ref = st_ref = None  # the forward walk's output, the first variant's
    for name, kernel, grid, cols, warps, const in variants:
        def call(kernel=kernel, grid=grid, cols=cols, warps=warps, const=const) -> None:
            kernel[(grid,)](z, z.stride(0), lab, ws, st, n, V, 1.0, 0.0, COLS=cols, num_warps=warps, **const)

        z.copy_(z0)
        call()
        if z_ref is None:
            z_ref, st_ref, same[name] = z.clone(), st.clone(), "(reference)"
        else:
            same[name] = bool(torch.equal(z, z_ref)) and bool(torch.equal(st, st_ref)) if cols == shape.cols else None
        calls[name] = call
    ms: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds):  # every variant once per round, in turn, so drift touches all alike
        for name, call in calls.items():
            ms[name].append(measure(call, warmup=2, reps=args.reps)[1])
        print(f"round {r + 1}: " + "  ".join(f"{k} {ms[k][-1]:.4f} ms" for k in ("forward walk", "reverse (committed)")),
              flush=True)
    base = statistics.median(ms["forward walk"])
    for name in calls:
        m = statistics.median(ms[name])
        print(f"  {name:36s} {m:8.4f} ms  {moved / m / 1e6:7.1f} GB/s (3 passes)  {base / m:5.3f}x the forward walk  "
              f"bitwise same as it: {same[name]}", flush=True)


if __name__ == "__main__":
    main()
