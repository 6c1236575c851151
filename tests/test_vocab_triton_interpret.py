"""The Triton block kernels against their plain-PyTorch twins, on CPU through TRITON_INTERPRET=1.

Tiny shapes, several column chunks per row, labels inside, on the edge of and outside the block,
a prior state already holding a running max, fp32 and bf16; fold_grad's gradient pass walked back and
forward. Runs in a subprocess because the
interpreter must be switched on before triton is imported.
"""

from __future__ import annotations

SCRIPT = r"""
import torch
from megatron_peakflat.vocab.block_torch import fold_grad_logits_torch, fold_logits_torch, grad_logits_torch
from megatron_peakflat.vocab import block_triton as bt
for k in bt.SHAPES:
    bt.SHAPES[k] = bt.KernelShape(16, 4)  # several chunks per row, the last one partial
torch.manual_seed(0)
for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
    n, c = 6, 37
    z = (torch.randn(n, c) * 3).to(dt)
    lab = torch.tensor([0, 36, 37, -1, 12, -40])
    st1 = torch.zeros(4, n); st1[0] = float("-inf")
    st1[:, 1] = torch.tensor([2.0, 1.5, 0.3, -1.0])
    st2 = st1.clone()
    fold_logits_torch(z, lab, st1)
    bt.fold_logits_triton(z, lab, st2)
    err = ((st1 - st2).abs() / st1.abs().clamp_min(1.0)).max().item()
    assert err < tol, ("fold", dt, err)
    coef = torch.stack([st1[0] + st1[1].log(), torch.randn(n), torch.randn(n), torch.randn(n)]).contiguous()
    d1 = grad_logits_torch(z, lab, coef).float()
    d2 = bt.grad_logits_triton(z.clone(), lab, coef).float()
    ulp = 2.0 ** -7 if dt == torch.bfloat16 else 1e-6  # one bf16 rounding of an FMA-ordered expression
    err = ((d1 - d2).abs() / d1.abs().clamp_min(1.0)).max().item()
    assert err <= ulp, ("grad", dt, err)
    ws = torch.tensor([0.5, 1.0, 0.0, 2.0, 0.25, 1.0])
    for eps in (0.0, 0.1):
        st3, st4 = torch.empty(4, n), torch.full((4, n), 7.0)  # fold_grad overwrites any prior state
        d3 = fold_grad_logits_torch(z.clone(), lab, st3, ws, eps, 1000).float()
        d4 = bt.fold_grad_logits_triton(z.clone(), lab, st4, ws, eps, 1000).float()
        err = ((st3 - st4).abs() / st3.abs().clamp_min(1.0)).max().item()
        assert err < tol, ("fold_grad state", dt, eps, err)
        err = ((d3 - d4).abs() / d3.abs().clamp_min(1.0)).max().item()
        assert err <= ulp, ("fold_grad", dt, eps, err)
        st5 = torch.empty(4, n)
        d5 = bt.fold_grad_logits_triton(z.clone(), lab, st5, ws, eps, 1000, backward_walk=False).float()
        assert torch.equal(d4, d5) and torch.equal(st4, st5), "the gradient pass's walk changes no bit"
        fresh = torch.zeros(4, n); fresh[0] = float("-inf")
        fold_logits_torch(z, lab, fresh)
        assert torch.allclose(fresh, st3), "fold_grad's state is the fold's"
print("ok")
"""


def test_triton_kernels_match_torch_in_interpreter(triton_interpreter) -> None:
    res = triton_interpreter(SCRIPT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
