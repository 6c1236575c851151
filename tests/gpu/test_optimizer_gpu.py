"""OffloadStreamAdamW on one GPU: the stream engine equals torch's fused GPU AdamW, and the GPU holds
only the staging slots. Run: PEAKFLAT_JIT=1 python -m pytest -q tests/gpu/test_optimizer_gpu.py"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.optimizer import OffloadStreamAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(4096, 1024), (3_000_001,), (1024, 4097), (777,), (2048, 2048)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(dtype) * 0.02) for s in SHAPES]


def _groups(ps):
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "lr": 3e-4, "weight_decay": 0.0}]


def _grads(step, ps):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return [torch.randn(p.shape, device="cuda", generator=g) for p in ps]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("engine", ["gpu", "cpu", "auto"])
def test_engine_matches_fused_gpu_adamw(engine):
    ps, ref = _params(), _params()
    opt = OffloadStreamAdamW(_groups(ps), lr=1e-3, betas=(0.9, 0.95), bucket=2_000_000, engine=engine, slots=3)
    fused = torch.optim.AdamW(_groups(ref), lr=1e-3, betas=(0.9, 0.95), fused=True)
    for it in range(8):
        for p, r, g in zip(ps, ref, _grads(it, ps)):
            p.grad, r.grad = g.clone(), g.clone()
        if it == 4:
            for o in (opt, fused):
                o.param_groups[0]["lr"] = 5e-4
        opt.step()
        fused.step()
    torch.cuda.synchronize()
    assert opt._region.pinned
    for p, r in zip(ps, ref):
        if engine == "gpu":
            assert torch.equal(p, r)  # same CUDA kernel, same inputs, elementwise: bitwise
            assert torch.equal(opt.state[p]["exp_avg_sq"].cuda(), fused.state[r]["exp_avg_sq"])
        else:
            assert _rel(p, r) <= 1e-6, _rel(p, r)
        assert _rel(opt.state[p]["exp_avg"].cuda(), fused.state[r]["exp_avg"]) <= 1e-6


def test_bf16_params_decoupled_grads_match_fp32_master_reference():
    masters = _params()
    ps = [torch.nn.Parameter(m.detach().bfloat16()) for m in masters]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ps]
    opt = OffloadStreamAdamW(_groups(ps), lr=1e-3, bucket=3_000_000, engine="gpu")
    fused = torch.optim.AdamW(_groups(ref), lr=1e-3, fused=True)
    for it in range(4):
        for p, r, g in zip(ps, ref, _grads(it, ps)):
            p.decoupled_grad, r.grad = g.clone(), g.clone()
        opt.step()
        fused.step()
    for p, r in zip(ps, ref):
        assert torch.equal(opt.state[p]["master_param"].cuda(), r.detach())
        assert torch.equal(p.detach(), r.detach().bfloat16())


def test_gpu_memory_is_only_the_staging_slots():
    n_params, bucket, slots = 64_000_000, 4_000_000, 3
    ps = [torch.nn.Parameter(torch.randn(n_params // 8, device="cuda", dtype=torch.bfloat16)) for _ in range(8)]
    for p in ps:
        p.decoupled_grad = torch.randn(p.shape, device="cuda")
    opt = OffloadStreamAdamW(ps, lr=1e-3, bucket=bucket, engine="gpu", slots=slots)
    opt.step()  # allocates the slots
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    staging = slots * bucket * 16
    assert torch.cuda.memory_allocated() == base  # nothing accumulates on the GPU
    assert peak <= 1 << 20, peak  # the step allocates nothing beyond the slots that already exist
    slots_bytes = sum(s.state.numel() * 4 + s.grad.numel() * 4 for s in opt._gpu_slots)
    assert slots_bytes == staging
    assert staging <= 12 * n_params / 4  # the GPU holds a quarter of the fp32 state (768 MB here) or less
