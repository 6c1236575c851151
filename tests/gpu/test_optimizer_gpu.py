"""OffloadStreamAdamW on one GPU: the stream engine equals torch's fused GPU AdamW, and the GPU holds
only the staging slots; the native bucket stream engine (csrc/stream_engine.cpp) orders its copies as
documented and equals the Python streams bit for bit. Run: python setup.py build_ext --inplace, then
python -m pytest -q tests/gpu/test_optimizer_gpu.py (or PEAKFLAT_JIT=1 instead of the build)."""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat import _ext, stats
from megatron_peakflat.optimizer import OffloadStreamAdamW
from megatron_peakflat.optimizer.streamer import NativeStreamer
from tests.test_optimizer import assert_same_params_and_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EXT = _ext.load() if torch.cuda.is_available() else None
needs_streamer = pytest.mark.skipif(EXT is None or not getattr(EXT, "with_cuda", False),
                                    reason="megatron_peakflat._C is missing or built without CUDA (no BucketStreamer): "
                                           f"{_ext.reason() or 'not loaded'}")

SHAPES = [(4096, 1024), (3_000_001,), (1024, 4097), (777,), (2048, 2048)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(dtype) * 0.02) for s in SHAPES]


def _bf16_params_with_grads(n_params: int) -> list[torch.nn.Parameter]:
    """Eight bf16 parameters of ``n_params`` in all, each with an fp32 ``decoupled_grad`` (Megatron's layout)."""
    ps = [torch.nn.Parameter(torch.randn(n_params // 8, device="cuda", dtype=torch.bfloat16)) for _ in range(8)]
    for p in ps:
        p.decoupled_grad = torch.randn(p.shape, device="cuda")
    return ps


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
    ps = _bf16_params_with_grads(n_params)
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


def _pinned(*shape, fill=None):
    t = torch.empty(*shape, dtype=torch.float32, pin_memory=True)
    return t.copy_(torch.randn(*shape)) if fill is None else t.fill_(fill)


@needs_streamer
def test_bucket_streamer_orders_uploads_updates_and_write_backs():
    """upload -> work on the current stream -> write_back -> upload into the same slot: each waits for the
    one before it. 64M floats per row make each copy take milliseconds, so a missing wait shows."""
    n = 64 << 20
    streamer = NativeStreamer(EXT, 2, torch.cuda.current_device())
    state = torch.empty(3, n, device="cuda")
    host = [_pinned(n) for _ in range(3)]
    expect = [h.clone() for h in host]
    torch.cuda.synchronize()
    streamer.upload(0, state, host, 0, n)
    state.mul_(2.0)  # current stream: must see the uploaded rows
    streamer.write_back(0, state, host, 0, n)  # download stream: must see the doubled rows
    other = [_pinned(n, fill=7.0) for _ in range(3)]
    streamer.upload(0, state, other, 0, n)  # must not overwrite the slot before the write-back has read it
    streamer.synchronize()
    for h, e in zip(host, expect):
        assert torch.equal(h, e * 2.0)
    torch.cuda.synchronize()
    assert bool((state == 7.0).all())
    # a bucket in the middle of the host buffers, in slot 1
    part = [_pinned(1000) for _ in range(3)]
    streamer.upload(1, state, part, 100, 500)
    streamer.write_back(1, state, host, 4096, 500)
    streamer.synchronize(1)
    for h, pt in zip(host, part):
        assert torch.equal(h[4096:4596], pt[100:600])
    assert streamer.slots == 2 and streamer.upload_stream != streamer.download_stream


@needs_streamer
def test_bucket_streamer_rejects_bad_arguments_with_what_is_wrong():
    streamer = NativeStreamer(EXT, 2, torch.cuda.current_device())
    state = torch.empty(3, 100, device="cuda")
    host = [_pinned(100) for _ in range(3)]
    bad = {
        "pinned": (0, state, [torch.zeros(100)] * 3, 0, 10),
        "slot must be in": (2, state, host, 0, 10),
        "CUDA tensor": (0, state.cpu(), host, 0, 10),
        r"\[3, bucket\]": (0, state[:2], host, 0, 10),
        "numel must be in": (0, state, host, 0, 101),
        "the bucket needs": (0, state, host, 50, 60),
        "3 tensors": (0, state, host[:2], 0, 10),
        "float32": (0, state, [h.double() for h in host], 0, 10),
    }
    for what, args in bad.items():
        for call in (streamer.upload, streamer.write_back):
            with pytest.raises(RuntimeError, match=what):
                call(*args)
    with pytest.raises(RuntimeError, match="slots must be >= 1"):
        NativeStreamer(EXT, 0, 0)
    with pytest.raises(RuntimeError, match="device must be"):
        NativeStreamer(EXT, 2, torch.cuda.device_count())


@needs_streamer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [2, 3])
def test_native_stream_engine_is_bitwise_the_torch_streams(slots, dtype):
    """Same copies, same fused AdamW calls, same order: params and every state tensor equal bit for bit."""
    runs = {}
    for impl in ("native", "torch"):
        ps = _params(dtype)
        opt = OffloadStreamAdamW(_groups(ps), lr=1e-3, betas=(0.9, 0.95), bucket=1_500_000, engine="gpu",
                                 slots=slots, stream_engine=impl)
        for it in range(6):
            for p, g in zip(ps, _grads(it, ps)):
                p.decoupled_grad = g
            if it == 3:
                opt.param_groups[1]["lr"] = 1e-4
            opt.step()
        torch.cuda.synchronize()
        assert opt.stream_impl == impl and stats.snapshot()["optimizer"]["stream_engine"] == impl
        assert len(opt._layout.buckets) > slots  # every slot is reused
        runs[impl] = (ps, opt)
    (pn, on), (pt, ot) = runs["native"], runs["torch"]
    assert_same_params_and_state(on, pn, ot, pt)
    assert not torch.equal(pn[0], _params(dtype)[0])  # it did move


@needs_streamer
def test_native_stream_engine_step_allocates_only_the_staging_slots():
    """From before the first step: the GPU gains the staging slots (and step scalars), nothing more,
    and no more than the Python streams' run does."""
    n_params, bucket, slots = 48_000_000, 4_000_000, 3
    peaks = {}
    for impl in ("native", "torch"):
        ps = _bf16_params_with_grads(n_params)
        opt = OffloadStreamAdamW(ps, lr=1e-3, bucket=bucket, engine="gpu", slots=slots, stream_engine=impl)
        opt.dummy_step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated()
        for _ in range(2):
            opt.step()
        torch.cuda.synchronize()
        staging = slots * bucket * 16
        peaks[impl] = torch.cuda.max_memory_allocated() - base
        assert opt.stream_impl == impl
        # beyond the slots: step scalars and the caching allocator's per-stream small blocks (a few MiB)
        assert staging <= peaks[impl] <= staging + (4 << 20), (impl, peaks[impl], staging)
        assert staging <= kept - base <= staging + (4 << 20), (impl, kept - base, staging)  # the slots stay
        assert torch.cuda.memory_allocated() == kept  # and nothing accumulates over steps
        del opt, ps
        torch.cuda.empty_cache()
    assert peaks["native"] <= peaks["torch"]
