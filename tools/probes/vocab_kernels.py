"""The vocabulary projection's row kernels on one GPU, each launch shape side by side with the kernels
they replace: fold (log-sum-exp pass), grad (in-place softmax gradient) and fold_grad (both in one
kernel, for a single rank's whole vocabulary), on one in-forward chunk of bf16 logits.

    python tools/probes/vocab_kernels.py                          # 4096 x 201088 (N=32768's chunk at TP=1)
    python tools/probes/vocab_kernels.py --rows 2048 --cols 128256

Rows (docs/evidence/probes/vocab_kernels.json): ``ms`` per call (CUDA events, median of ``--reps``), ``extra``
the GB/s over the bytes the pass must move and the largest difference from the previous kernels'
results (log-sum-exp relative, gradient in bf16 ulps of the largest value). ``fold+grad`` rows are the two-kernel sums.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import Row, measure, write  # noqa: E402
from megatron_peakflat.vocab import block_triton as bt  # noqa: E402
from megatron_peakflat.vocab.ring import new_state  # noqa: E402


@triton.jit
def _fold_before(z_ptr, stride_z, lab_ptr, state_ptr, n, ncols, COLS: tl.constexpr):
    """The fold as it was before this benchmark: a per-element running max (two exps per logit)."""
    row = tl.program_id(0)
    zrow = z_ptr + row.to(tl.int64) * stride_z
    lab = tl.load(lab_ptr + row)
    m_vec = tl.full([COLS], float("-inf"), tl.float32)
    s_vec = tl.zeros([COLS], tl.float32)
    zs_vec = tl.zeros([COLS], tl.float32)
    for c0 in range(0, ncols, COLS):
        cols = c0 + tl.arange(0, COLS)
        msk = cols < ncols
        z = tl.load(zrow + cols, mask=msk, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, z)
        scale = tl.where(m_vec == m_new, 1.0, tl.exp(m_vec - m_new))
        s_vec = s_vec * scale + tl.where(msk, tl.exp(z - m_new), 0.0)
        m_vec = m_new
        zs_vec += tl.where(msk, z, 0.0)
    bm = tl.max(m_vec, axis=0)
    bs = tl.sum(tl.where(m_vec == float("-inf"), 0.0, s_vec * tl.exp(m_vec - bm)), axis=0)
    tl.store(state_ptr + row, bm)
    tl.store(state_ptr + n + row, bs)
    inb = (lab >= 0) & (lab < ncols)
    tl.store(state_ptr + 2 * n + row, tl.where(inb, tl.load(zrow + tl.where(inb, lab, 0)).to(tl.float32), 0.0))
    tl.store(state_ptr + 3 * n + row, tl.sum(zs_vec, axis=0))


def _lse_err(st: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative difference of the log-sum-exp (what the loss and the gradient use)."""
    lse, ref_lse = st[0] + st[1].log(), ref[0] + ref[1].log()
    return float(((lse - ref_lse).abs() / ref_lse.abs()).max())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=201088)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools/probes/vocab_kernels.py needs a CUDA device")
    n, V = args.rows, args.cols
    case = f"rows={n},V={V},bf16"
    g = torch.Generator(device="cuda").manual_seed(0)
    z0 = (torch.randn(n, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    lab = torch.randint(0, V, (n,), device="cuda", generator=g)
    ws = torch.full((n,), 1.0 / 32768, device="cuda")
    zbytes = n * V * 2
    rows: list[Row] = []

    def emit(method: str, ms: float, moved: int, **extra: float) -> None:
        rows.append(Row(case, method, None, round(ms, 4), None, {"gb_s": round(moved / ms / 1e6, 1), **extra}))
        print(f"{case} {method:34s} {ms:8.4f} ms  {moved / ms / 1e6:7.1f} GB/s  {extra}", flush=True)

    ref_state = new_state(n, z0.device)
    _fold_before[(n,)](z0, z0.stride(0), lab, ref_state, n, V, COLS=1024, num_warps=4)
    lse = ref_state[0] + ref_state[1].log()
    coef = torch.stack([lse, ws, ws, torch.zeros_like(ws)]).contiguous()
    ref_grad = z0.clone()
    bt.SHAPES["grad"] = bt.KernelShape(1024, 4)
    bt.grad_logits_triton(ref_grad, lab, coef)
    ulp = 2.0 ** -7 / 32768  # bf16 spacing at the largest gradient, ws = 1/32768

    st = new_state(n, z0.device)
    fold_before_ms = measure(lambda: _fold_before[(n,)](z0, z0.stride(0), lab, st, n, V, COLS=1024, num_warps=4),
                             warmup=2, reps=args.reps)[1]
    emit("fold before (1024 cols, 4 warps)", fold_before_ms, zbytes)
    z = z0.clone()
    grad_before_ms = measure(lambda: bt.grad_logits_triton(z, lab, coef), warmup=2, reps=args.reps)[1]
    emit("grad before (1024 cols, 4 warps)", grad_before_ms, 2 * zbytes)
    emit("fold+grad before", fold_before_ms + grad_before_ms, 3 * zbytes)

    best: dict[str, tuple[float, bt.KernelShape]] = {}
    for cols, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
        shape = bt.KernelShape(cols, warps)
        bt.SHAPES["fold"] = bt.SHAPES["grad"] = bt.SHAPES["fold_grad"] = shape
        st = new_state(n, z0.device)
        bt.fold_logits_triton(z0, lab, st)
        err = _lse_err(st, ref_state)
        st = new_state(n, z0.device)
        ms = measure(lambda: bt.fold_logits_triton(z0, lab, st), warmup=2, reps=args.reps)[1]
        emit(f"fold {cols} cols, {warps} warps", ms, zbytes, lse_err=err)
        f_ms = ms
        z = z0.clone()
        bt.grad_logits_triton(z, lab, coef)
        gerr = float((z.float() - ref_grad.float()).abs().max()) / ulp
        ms = measure(lambda: bt.grad_logits_triton(z, lab, coef), warmup=2, reps=args.reps)[1]
        emit(f"grad {cols} cols, {warps} warps", ms, 2 * zbytes, grad_err_ulps=gerr)
        emit(f"fold+grad {cols} cols, {warps} warps", f_ms + ms, 3 * zbytes)
        z = z0.clone()
        st = torch.empty(4, n, device="cuda")
        bt.fold_grad_logits_triton(z, lab, st, ws, 0.0, V)
        serr = _lse_err(st, ref_state)
        gerr = float((z.float() - ref_grad.float()).abs().max()) / ulp
        z.copy_(z0)
        ms = measure(lambda: bt.fold_grad_logits_triton(z, lab, st, ws, 0.0, V), warmup=2, reps=args.reps)[1]
        emit(f"fold_grad {cols} cols, {warps} warps", ms, 3 * zbytes, lse_err=serr, grad_err_ulps=gerr)
        if ms < best.get("fold_grad", (1e9,))[0]:
            best["fold_grad"] = (ms, shape)
    print("fastest fold_grad:", best["fold_grad"])
    evidence = Path(__file__).resolve().parents[2] / "docs" / "evidence" / "probes"
    write("vocab_kernels", rows, merge=False, out=evidence / "vocab_kernels.json")


if __name__ == "__main__":
    main()
