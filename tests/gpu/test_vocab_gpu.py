"""Ring-DTP on CUDA: the Triton block kernels against the plain-PyTorch fallback, both against an
fp64 reference, in bf16 and fp32; plus the single-GPU working set.

bf16 rule: the error (relative Frobenius norm vs fp64) of ours is not worse than that of the naive
same-dtype reference (full bf16 logits + F.cross_entropy), plus a small tolerance.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat import stats
from megatron_peakflat.vocab import reference_linear_cross_entropy, ring_linear_cross_entropy
from tests._helpers import no_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N, H, V = 1999, 512, 20011  # odd everything; V not a multiple of any block size used


def _inputs(seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.05
    y = torch.randint(0, V, (N,), generator=g)
    y[:4] = torch.tensor([0, V - 1, 4096, 4095])
    y[::11] = -100
    gout = torch.rand(N, generator=g)
    return x.cuda(), w.cuda(), y.cuda(), gout.cuda()


def _run(fn, x, w, gout, dt):
    xx = x.detach().to(dt, copy=True).requires_grad_(True)  # a fresh leaf per run, whatever dt is
    ww = w.detach().to(dt, copy=True).requires_grad_(True)
    loss = fn(xx, ww)
    (loss.double() * gout.double()).sum().backward()
    return loss.detach().double(), xx.grad.double(), ww.grad.double()


def _err(out, ref):
    return [float((a - r).norm() / r.norm()) for a, r in zip(out, ref)]


@pytest.fixture(scope="module")
def case():
    x, w, y, gout = _inputs()
    ref = _run(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, gout, torch.float64)
    return x, w, y, gout, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["triton", "torch"])
@pytest.mark.parametrize("block", [4096, 0])
def test_kernel_vs_fp64_not_worse_than_naive(case, dtype, kernel, block) -> None:
    x, w, y, gout, ref = case
    naive = _err(_run(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, gout, dtype), ref)
    ours = _err(_run(lambda a, b: ring_linear_cross_entropy(a, b, y, kernel=kernel, block_size=block),
                     x, w, gout, dtype), ref)
    tol = 2e-4 if dtype == torch.bfloat16 else 2e-6
    for what, o, nv in zip(("loss", "dX", "dW"), ours, naive):
        assert o <= nv * 1.05 + tol, (what, dtype, kernel, o, nv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_equals_fallback(case, dtype) -> None:
    x, w, y, gout, _ = case
    tri = _run(lambda a, b: ring_linear_cross_entropy(a, b, y, kernel="triton", block_size=3000), x, w, gout, dtype)
    ref = _run(lambda a, b: ring_linear_cross_entropy(a, b, y, kernel="torch", block_size=3000), x, w, gout, dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for what, a, b in zip(("loss", "dX", "dW"), tri, ref):
        rel = float((a - b).norm() / b.norm())
        assert rel < tol, (what, dtype, rel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_in_forward_fused_kernel(case, dtype, eps) -> None:
    """The single-GPU in-forward schedule (one fold_grad kernel per chunk) against the plain-PyTorch
    fold_grad, and both against fp64 no worse than the naive same-dtype path; labels on block edges,
    ignored tokens, label smoothing, a per-token upstream gradient given as the hint."""
    x, w, y, gout, _ = case
    ref = _run(lambda a, b: reference_linear_cross_entropy(a, b, y, label_smoothing=eps), x, w, gout, torch.float64)
    naive = _err(_run(lambda a, b: reference_linear_cross_entropy(a, b, y, label_smoothing=eps), x, w, gout, dtype), ref)
    kw = dict(label_smoothing=eps, grad="in-forward", grad_hint=gout.float(), chunk_tokens=512)
    stats.reset()
    tri = _run(lambda a, b: ring_linear_cross_entropy(a, b, y, kernel="triton", **kw), x, w, gout, dtype)
    st = stats.snapshot()["vocab"]
    assert st["kernel"] == "triton" and st["in_forward_chunks"] == 4 and st.get("hint_corrections", 0) == 0, st
    fallback = _run(lambda a, b: ring_linear_cross_entropy(a, b, y, kernel="torch", **kw), x, w, gout, dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for what, a, b in zip(("loss", "dX", "dW"), tri, fallback):
        rel = float((a - b).norm() / b.norm())
        assert rel < tol, (what, dtype, rel)
    slack = 2e-4 if dtype == torch.bfloat16 else 2e-6
    for what, o, nv in zip(("loss", "dX", "dW"), _err(tri, ref), naive):
        assert o <= nv * 1.05 + slack, (what, dtype, o, nv)


def test_fp32_matches_cross_entropy_1e5(case) -> None:
    x, w, y, gout, _ = case
    ref = _run(lambda a, b: reference_linear_cross_entropy(a, b, y, label_smoothing=0.1), x, w, gout, torch.float32)
    ours = _run(lambda a, b: ring_linear_cross_entropy(a, b, y, label_smoothing=0.1), x, w, gout, torch.float32)
    for what, a, b in zip(("loss", "dX", "dW"), ours, ref):
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel < 1e-5, (what, rel)


def test_accumulate_input_is_bounded(case) -> None:
    """accumulate='input' (gradient-floor memory) keeps dX within 3x the naive bf16 error."""
    x, w, y, gout, ref = case
    naive = _err(_run(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, gout, torch.bfloat16), ref)
    ours = _err(_run(lambda a, b: ring_linear_cross_entropy(a, b, y, accumulate="input"), x, w, gout, torch.bfloat16), ref)
    assert ours[1] <= 3 * naive[1] + 2e-4 and ours[2] <= naive[2] * 1.05 + 2e-4, (ours, naive)


@pytest.mark.parametrize("accumulate", ["fp32", "input"])
def test_single_gpu_peak_is_gradients_plus_one_block(accumulate) -> None:
    n, h, v = 8192, 1024, 65536
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ring_linear_cross_entropy(x, w, y, block_size=4096, accumulate=accumulate).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = x.numel() * 2 + w.numel() * 2
    block = n * 4096 * 2
    dx_acc = n * h * 4 if accumulate == "fp32" else 0
    bound = grads + dx_acc + x.numel() * 2 + 2 * block + 64 * 2**20
    assert extra <= bound, (extra / 2**20, bound / 2**20)
    assert extra < grads + n * v * 2  # far below the logits of the naive path


def test_dw_into_main_grad_bf16(case) -> None:
    """bf16 weight with an fp32 main_grad (Megatron DDP): dW lands in main_grad (added to what it held), no
    less accurate than the returned bf16 dW; autograd gets main_grad's storage as placeholder; the peak is lower by dW."""
    x, w, y, gout, ref = case
    plain = _err(_run(lambda a, b: ring_linear_cross_entropy(a, b, y), x, w, gout, torch.bfloat16), ref)
    peaks, grads = [], None
    for into in (False, True):
        xx = x.detach().to(torch.bfloat16, copy=True).requires_grad_(True)
        ww = w.detach().to(torch.bfloat16, copy=True).requires_grad_(True)
        held = torch.randn(ww.shape, device="cuda")
        ww.main_grad, ww.grad_added_to_main_grad = held.clone(), False
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = ring_linear_cross_entropy(xx, ww, y, dw_into_main_grad=into)
        (loss.double() * gout.double()).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        if into:
            grads = xx.grad.double(), (ww.main_grad - held).double(), ww
    dx, dw, ww = grads
    assert ww.grad_added_to_main_grad
    assert ww.grad.untyped_storage().data_ptr() == ww.main_grad.untyped_storage().data_ptr()  # no allocation
    err_dw = float((dw - ref[2]).norm() / ref[2].norm())
    assert err_dw <= plain[2] * 1.05 + 2e-4, (err_dw, plain[2])
    assert _err([dx], [ref[1]])[0] <= plain[1] * 1.05 + 2e-4
    # no dW of its own, and the placeholder autograd gets is main_grad's storage: at least dW's bytes less
    assert peaks[1] <= peaks[0] - ww.numel() * ww.element_size(), [p / 2**20 for p in peaks]


def _nccl_ring(rank: int, world: int) -> list[float]:
    """Both recompute schedules and the in-forward one over an NCCL group (default group is gloo from
    run_distributed), fp32 exactness."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    group = dist.new_group(list(range(world)), backend="nccl")
    errs = []
    for schedule, grad in (("activations", "recompute"), ("weights", "recompute"), ("auto", "in-forward")):
        g = torch.Generator().manual_seed(7)
        Vt, h = 4099, 256
        tokens = [300 + 17 * r for r in range(world)]
        shards = [Vt // world + (1 if r < Vt % world else 0) for r in range(world)]
        w = torch.randn(Vt, h, generator=g) * 0.05
        xs = [torch.randn(n, h, generator=g) for n in tokens]
        ys = [torch.randint(0, Vt, (n,), generator=g) for n in tokens]
        gs = [torch.rand(n, generator=g) for n in tokens]
        lo = sum(shards[:rank])
        x = xs[rank].cuda().requires_grad_(True)
        wp = w[lo:lo + shards[rank]].cuda().requires_grad_(True)
        loss = ring_linear_cross_entropy(x, wp, ys[rank].cuda(), group, schedule=schedule, block_size=512, grad=grad,
                                         grad_hint=gs[rank].cuda(), chunk_tokens=256)
        (loss * gs[rank].cuda()).sum().backward()
        wr = w.cuda().requires_grad_(True)
        xr = [t.cuda().requires_grad_(True) for t in xs]
        tot = sum((reference_linear_cross_entropy(xr[r], wr, ys[r].cuda()) * gs[r].cuda()).sum() for r in range(world))
        tot.backward()
        ref_loss = reference_linear_cross_entropy(xr[rank], wr, ys[rank].cuda()).detach()
        for a, b in ((loss.detach(), ref_loss), (x.grad, xr[rank].grad), (wp.grad, wr.grad[lo:lo + shards[rank]])):
            errs.append(float((a - b).abs().max() / b.abs().max()))
    return errs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_ring_two_gpus() -> None:
    from megatron_peakflat.testing import run_distributed

    world = min(torch.cuda.device_count(), 4)
    for errs in run_distributed(_nccl_ring, world, timeout=240, cuda=True):
        assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("into", [False, True])
def test_in_forward_vs_fp64_not_worse_than_naive(case, dtype, into) -> None:
    """grad='in-forward' (Triton kernels, chunks smaller than N) with dW returned or added into an fp32
    main_grad: loss, dX and dW no less accurate than the naive same-dtype path; the hint is the real
    upstream gradient, so nothing is recomputed."""
    from megatron_peakflat import stats

    x, w, y, gout, ref = case
    naive = _err(_run(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, gout, dtype), ref)
    xx = x.detach().to(dtype, copy=True).requires_grad_(True)
    ww = w.detach().to(dtype, copy=True).requires_grad_(True)
    if into:
        ww.main_grad, ww.grad_added_to_main_grad = torch.zeros(ww.shape, device="cuda"), False
    stats.reset()
    loss = ring_linear_cross_entropy(xx, ww, y, grad="in-forward", grad_hint=gout.float(), chunk_tokens=700,
                                     dw_into_main_grad=into)
    (loss.double() * gout.double()).sum().backward()
    assert stats.snapshot()["vocab"].get("hint_corrections", 0) == 0
    assert stats.snapshot()["vocab"]["in_forward_chunks"] == 3
    dw = ww.main_grad if into else ww.grad
    ours = _err((loss.detach().double(), xx.grad.double(), dw.double()), ref)
    tol = 2e-4 if dtype == torch.bfloat16 else 2e-6
    for what, o, nv in zip(("loss", "dX", "dW"), ours, naive):
        assert o <= nv * 1.05 + tol, (what, dtype, into, o, nv)


def test_in_forward_peak_is_dx_plus_one_chunk() -> None:
    """dW into main_grad, bf16: the extra peak is dX and one [chunk, V] block of logits (plus cuBLAS
    workspace), whatever N: doubling N adds only dX."""
    h, v, chunk = 1024, 65536, 2048
    peaks = {}
    for n in (8192, 16384):
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(v, h, device="cuda"), False
        y = torch.randint(0, v, (n,), device="cuda")
        ring_linear_cross_entropy(x, w, y, grad="in-forward", chunk_tokens=chunk, dw_into_main_grad=True).sum().backward()
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ring_linear_cross_entropy(x, w, y, grad="in-forward", chunk_tokens=chunk, dw_into_main_grad=True).sum().backward()
        torch.cuda.synchronize()
        peaks[n] = torch.cuda.max_memory_allocated() - base
        bound = n * h * 2 + chunk * v * 2 + 64 * 2**20
        assert peaks[n] <= bound, (n, peaks[n] / 2**20, bound / 2**20)
        del x, w, y
    assert peaks[16384] - peaks[8192] <= 8192 * h * 2 + 8 * 2**20, {k: p / 2**20 for k, p in peaks.items()}


@pytest.mark.parametrize("grad", ["recompute", "in-forward"])
def test_tied_weight_main_grad_bf16(grad) -> None:
    """A bf16 output weight tied to an embedding lookup, with an fp32 main_grad and Megatron DDP's hook:
    main_grad ends up with the embedding's gradient plus dW, as accurate as the naive bf16 path's
    combined gradient against an fp64 reference."""
    g = torch.Generator(device="cpu").manual_seed(5)
    v, h, n = 4099, 256, 1500
    w0 = (torch.randn(v, h, generator=g) * 0.05).cuda()
    ids = torch.randint(0, v, (n,), generator=g).cuda()
    y = torch.randint(0, v, (n,), generator=g).cuda()
    proj = (torch.randn(h, h, generator=g) * h ** -0.5).cuda()

    def run(dt, ours: bool):
        w = torch.nn.Parameter(w0.to(dt))
        if ours:
            w.main_grad, w.grad_added_to_main_grad = torch.zeros(v, h, device="cuda"), False

            def hook(*_):
                if w.grad is not None and not w.grad_added_to_main_grad:
                    w.main_grad.add_(w.grad)
                w.grad = None

            acc = w.expand_as(w).grad_fn.next_functions[0][0]
            acc.register_hook(hook)
        x = torch.tanh(torch.nn.functional.embedding(ids, w) @ proj.to(dt))
        if ours:
            loss = ring_linear_cross_entropy(x, w, y, reduction="mean", dw_into_main_grad=True, weight_shared=True,
                                             grad=grad, chunk_tokens=512)
        else:
            loss = reference_linear_cross_entropy(x, w, y, reduction="mean")
        loss.backward()
        return (w.main_grad if ours else w.grad).double()

    ref = run(torch.float64, False)
    naive = float((run(torch.bfloat16, False) - ref).norm() / ref.norm())
    ours = float((run(torch.bfloat16, True) - ref).norm() / ref.norm())
    assert ours <= naive * 1.05 + 2e-4, (ours, naive)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_argmax_kept_while_folding_matches_the_logits(case, dtype, kernel) -> None:
    """The argmax the recompute schedule keeps (the MTP acceptance counts read it) is the argmax of the
    same-dtype logits wherever the top logit is unique by more than the block GEMM's rounding, and every
    other token's pick is within that rounding of the top logit; the loss is the same bits as without it."""
    x, w, y, _, _ = case
    xx, ww = x.to(dtype), w.to(dtype)
    plain = ring_linear_cross_entropy(xx, ww, y, kernel=kernel, block_size=4096)
    loss, pred = ring_linear_cross_entropy(xx, ww, y, kernel=kernel, block_size=4096, return_argmax=True)
    assert torch.equal(loss, plain)
    logits = (xx @ ww.t()).float()
    top = logits.max(dim=1).values
    picked = logits.gather(1, pred[:, None]).squeeze(1)
    ulp = 2.0 ** -6 if dtype == torch.bfloat16 else 2.0 ** -16  # two units in the last place, or fp32 noise
    assert torch.all(top - picked <= ulp * top.abs().clamp(min=1)), float((top - picked).max())
    agree = float((pred == logits.argmax(dim=1)).float().mean())
    assert agree >= 0.99, agree


def test_mtp_heads_in_a_bf16_gpt_not_worse_than_megatron() -> None:
    """A Megatron GPT with an MTP layer in bf16 on the GPU (Triton kernels): Ring-DTP's main loss, its MTP
    loss (Megatron's logged value) and every parameter's gradient are no further from the same model's fp32
    run than Megatron's own bf16 run is (x1.5 + 1e-3), its acceptance counts are Megatron's within 1% of the
    tokens, and the output layer builds no logits."""
    import torch.distributed as dist
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    import megatron_peakflat
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron_peakflat.vocab import VocabConfig

    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29547")
    mc.init_megatron_parallel(cpu=False, seed=11)
    destroy_moe_metrics_tracker()  # sized by an earlier test's model

    def build(bf16: bool):
        config = mc.tiny_transformer_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.3, hidden_size=256,
                                            num_moe_experts=4, bf16=bf16,
                                            params_dtype=torch.bfloat16 if bf16 else torch.float32)
        model = mc.build_tiny_gpt(config, vocab_size=4096, seq_len=128)
        return (Float16Module(config, model) if bf16 else model).cuda().train()

    def step(model) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        batch = {k: v.cuda() for k, v in mc.gpt_batch(128, 4, 4096, seed=3).items()}
        MTPLossLoggingHelper.tracker.clear()
        loss = mc.gpt_loss(model, batch)
        loss.backward()
        grads = [loss.detach().double()] + [p.grad.detach().double() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        metrics = {k: v.detach().double().clone() for k, v in MTPLossLoggingHelper.tracker.items()
                   if isinstance(v, torch.Tensor)}
        return grads, metrics

    fp32 = build(False)
    ref, ref_m = step(fp32)
    bf16 = build(True)
    bf16.module.load_state_dict(fp32.state_dict())
    meg, meg_m = step(bf16)
    megatron_peakflat.apply(PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"), general=GeneralConfig(attention="local")))
    try:
        bf16.module.output_layer.forward = no_logits
        ours, ours_m = step(bf16)
    finally:
        del bf16.module.output_layer.forward
        megatron_peakflat.remove()

    def err(a, b):
        return float((a - b).norm() / b.norm().clamp(min=1e-30))

    for i, (o, m, r) in enumerate(zip(ours, meg, ref)):
        assert err(o, r) <= 1.5 * err(m, r) + 1e-3, (i, err(o, r), err(m, r))
    assert err(ours_m["loss_values"], ref_m["loss_values"]) <= 1.5 * err(meg_m["loss_values"], ref_m["loss_values"]) + 1e-3
    total = float(meg_m["total_values"].sum())
    assert total > 0 and torch.equal(ours_m["total_values"], meg_m["total_values"])
    assert abs(float(ours_m["correct_values"].sum() - meg_m["correct_values"].sum())) <= 0.01 * total
