"""Ring-DTP against F.cross_entropy on the full logits: loss, dX and dW, fp32, gloo world 1/2/4.

Covers both schedules, V not divisible by P with uneven shards, token counts that differ per rank,
ignore_index tokens, labels on shard boundaries, label smoothing, an all-ignored batch, an arbitrary
per-token grad_output, the bad-input errors, and the bounded working set (LiveBytesMeter).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from megatron_peakflat.testing import LiveBytesMeter, loss_and_grad_errors, max_rel_error, run_distributed
from megatron_peakflat.vocab import reference_linear_cross_entropy, resolve_schedule, ring_linear_cross_entropy
from megatron_peakflat.vocab.api import schedule_reason
from megatron_peakflat.vocab.api import auto_block_size

H = 24



def _shards(V: int, P: int, uneven: bool) -> list[int]:
    if not uneven:
        base = [V // P + (1 if r < V % P else 0) for r in range(P)]
    else:
        base = [V // P + (r % 3) - 1 for r in range(P)]
        base[-1] = V - sum(base[:-1])
    assert sum(base) == V and min(base) > 0
    return base


def _case(seed: int, shards: list[int], tokens: list[int], ignore_frac: float, all_ignored: bool):
    V = sum(shards)
    edge = shards[0] if len(shards) > 1 else V // 2  # first row of shard 1
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.5
    xs = [torch.randn(n, H, generator=g) for n in tokens]
    ys = []
    for n in tokens:
        y = torch.randint(0, V, (n,), generator=g)
        y[: min(n, 4)] = torch.tensor([0, V - 1, edge, edge - 1][: min(n, 4)])  # shard boundaries
        y[torch.rand(n, generator=g) < ignore_frac] = -100
        if all_ignored:
            y[:] = -100
        ys.append(y)
    gs = [torch.randn(n, generator=g) for n in tokens]
    return w, xs, ys, gs


CASES = [
    # (V, tokens per rank (cycled), schedule, label_smoothing, ignore fraction, all ignored, uneven shards)
    (103, [13, 7, 11, 5], "activations", 0.0, 0.2, False, False),
    (103, [13, 7, 11, 5], "weights", 0.0, 0.2, False, True),
    (97, [29, 31, 17, 23], "auto", 0.1, 0.1, False, True),
    (61, [9, 14, 3, 8], "weights", 0.05, 0.0, False, False),
    (61, [9, 14, 3, 8], "activations", 0.0, 0.0, True, False),
]


def _ring_checks(rank: int, world: int) -> list[str]:
    group = dist.new_group(list(range(world)))
    done = []
    for i, (V, toks, sched, eps, ign, all_ign, uneven) in enumerate(CASES):
        tokens = [toks[r % len(toks)] for r in range(world)]
        shards = _shards(V, world, uneven)
        start = sum(shards[:rank])
        w, xs, ys, gs = _case(100 + i, shards, tokens, ign, all_ign)
        x = xs[rank].clone().requires_grad_(True)
        wp = w[start:start + shards[rank]].clone().requires_grad_(True)
        loss = ring_linear_cross_entropy(x, wp, ys[rank], group, schedule=sched, label_smoothing=eps,
                                         block_size=8, kernel="torch", vocab_size=V, check_labels=True,
                                         accumulate="input" if i % 2 else "fp32")
        (loss * gs[rank]).sum().backward()

        wr = w.clone().requires_grad_(True)
        xr = [t.clone().requires_grad_(True) for t in xs]
        refs = [reference_linear_cross_entropy(xr[r], wr, ys[r], label_smoothing=eps) for r in range(world)]
        sum((l * gg).sum() for l, gg in zip(refs, gs)).backward()
        what = f"case {i} ({sched}, V={V}, P={world})"
        assert loss.shape == (tokens[rank],) and loss.dtype == torch.float32, what
        if all_ign:
            assert torch.all(loss == 0) and torch.all(x.grad == 0) and torch.all(wp.grad == 0), what
        else:
            assert max_rel_error(loss, refs[rank].detach()) < 1e-5, (what, "loss", max_rel_error(loss, refs[rank]))
            assert max_rel_error(x.grad, xr[rank].grad) < 1e-5, (what, "dX", max_rel_error(x.grad, xr[rank].grad))
            ref_dw = wr.grad[start:start + shards[rank]]
            assert max_rel_error(wp.grad, ref_dw) < 1e-5, (what, "dW", max_rel_error(wp.grad, ref_dw))
        assert torch.all(loss[ys[rank] == -100] == 0), what
        if not all_ign:  # dW into Megatron DDP's main_grad (added to what it holds); autograd gets a placeholder
            wm = w[start:start + shards[rank]].clone().requires_grad_(True)
            held = torch.randn(wm.shape, generator=torch.Generator().manual_seed(rank))
            wm.main_grad, wm.grad_added_to_main_grad = held.clone(), False
            xm = xs[rank].clone().requires_grad_(True)
            lm = ring_linear_cross_entropy(xm, wm, ys[rank], group, schedule=sched, label_smoothing=eps,
                                           block_size=8, kernel="torch", dw_into_main_grad=True,
                                           accumulate="input" if i % 2 else "fp32")
            (lm * gs[rank]).sum().backward()
            assert wm.grad_added_to_main_grad, what
            # the placeholder is main_grad's own storage (no allocation), for DDP's hook to drop unread
            assert wm.grad.untyped_storage().data_ptr() == wm.main_grad.untyped_storage().data_ptr(), what
            assert max_rel_error(wm.main_grad - held, ref_dw) < 1e-5, (what, "main_grad", max_rel_error(wm.main_grad - held, ref_dw))
            assert max_rel_error(xm.grad, xr[rank].grad) < 1e-5, (what, "dX with main_grad")
        # the argmax kept while folding: the full logits row's, ties to the lowest id; the loss unchanged
        xa = xs[rank].clone().requires_grad_(True)
        la, pred = ring_linear_cross_entropy(xa, w[start:start + shards[rank]].clone(), ys[rank], group,
                                             schedule=sched, label_smoothing=eps, block_size=8, kernel="torch",
                                             return_argmax=True)
        assert pred.dtype == torch.long and not pred.requires_grad, what
        assert torch.equal(pred, (xs[rank] @ w.t()).argmax(dim=1)), (what, "argmax")
        assert torch.equal(la.detach(), loss.detach()), (what, "loss with argmax")
        tied = torch.zeros(tokens[rank], H)  # every logit 0: the lowest id, 0, wins wherever shard 0 visits
        _, pred0 = ring_linear_cross_entropy(tied, w[start:start + shards[rank]].clone(), ys[rank], group,
                                             schedule=sched, block_size=8, kernel="torch", return_argmax=True)
        assert torch.all(pred0 == 0), (what, "ties")
        done.append(what)

    # bad input: a label out of range on one rank is reported on every rank (no hang)
    x = torch.randn(5, H)
    wp = torch.randn(7, H)
    y = torch.zeros(5, dtype=torch.long)
    if rank == world - 1:
        y[2] = 7 * world + 3
    with pytest.raises(ValueError, match="outside"):
        ring_linear_cross_entropy(x, wp, y, group, check_labels=True)
    # the group does not match the weight sharding
    with pytest.raises(ValueError, match="does not match the weight sharding"):
        ring_linear_cross_entropy(x, wp, y.clamp(max=6), group, vocab_size=7 * world + 1)
    if world > 1:
        # mismatched hidden sizes across ranks
        hh = H if rank == 0 else H + 1
        with pytest.raises(ValueError, match="disagree on the hidden size or dtype"):
            ring_linear_cross_entropy(torch.randn(5, hh), torch.randn(7, hh), y.clamp(max=6), group)
        dt = torch.float32 if rank == 0 else torch.float64
        with pytest.raises(ValueError, match="disagree on the hidden size or dtype"):
            ring_linear_cross_entropy(torch.randn(5, H, dtype=dt), torch.randn(7, H, dtype=dt), y.clamp(max=6), group)
    return done


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_matches_full_cross_entropy(world: int) -> None:
    out = run_distributed(_ring_checks, world, timeout=120)
    assert all(len(o) == len(CASES) for o in out)


@pytest.mark.parametrize("eps,reduction", [(0.0, "none"), (0.2, "mean"), (0.0, "sum")])
def test_single_rank_reductions_and_ignore_index(eps: float, reduction: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(41, H, requires_grad=True)
    w = torch.randn(77, H, requires_grad=True)
    y = torch.randint(0, 77, (41,))
    y[::5] = 3  # ignore_index inside the vocabulary
    out = ring_linear_cross_entropy(x, w, y, ignore_index=3, label_smoothing=eps, reduction=reduction, block_size=10)
    ref = reference_linear_cross_entropy(x, w, y, ignore_index=3, label_smoothing=eps, reduction=reduction)
    errs = loss_and_grad_errors(out, ref, (x, w))
    assert max(errs) < 1e-5, errs


def test_exact_when_every_logit_is_far_below_zero() -> None:
    """The online log-sum-exp starts from max = -inf, so it is shift-invariant: logits all below -110 (whose exp
    underflows fp32 unless shifted by their max) give the reference loss and gradients, not inf or nan."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, H, generator=g) * 0.1 + 1.0).requires_grad_(True)
    w = (torch.randn(50, H, generator=g) - 150.0 / H).requires_grad_(True)
    y = torch.randint(0, 50, (16,), generator=g)
    assert float((x @ w.t()).max()) < -110  # exp(-110) is 0 in fp32
    out = ring_linear_cross_entropy(x, w, y, block_size=16, kernel="torch")
    ref = reference_linear_cross_entropy(x, w, y)
    errs = loss_and_grad_errors(out, ref, (x, w))
    # dX sums weight rows sharing a large common component, which cancels: fp32 rounding shows at ~1e-5 in both
    assert errs[0] < 1e-5 and max(errs) < 1e-4, errs


def test_bad_arguments() -> None:
    x, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="weight_shard must be"):
        ring_linear_cross_entropy(x, torch.randn(10, 9), y)
    with pytest.raises(ValueError, match="labels must be"):
        ring_linear_cross_entropy(x, w, y[:3])
    with pytest.raises(ValueError, match="share one float dtype"):
        ring_linear_cross_entropy(x, w.double(), y)
    with pytest.raises(ValueError, match="schedule"):
        resolve_schedule("sideways", 1, 1, 2)
    y[1] = 10
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        ring_linear_cross_entropy(x, w, y, check_labels=True)
    y[1] = 0
    for kwargs, message in [
        (dict(label_smoothing=1.5), "label_smoothing=1.5"), (dict(label_smoothing=-0.1), "label_smoothing=-0.1"),
        (dict(reduction="avg"), "reduction='avg'"), (dict(block_size=-1), "block_size=-1"),
        (dict(accumulate="bf16"), "accumulate='bf16'"), (dict(grad="later"), "grad='later'"),
        (dict(chunk_tokens=-1), "chunk_tokens=-1"), (dict(grad_hint=torch.ones(3)), "grad_hint of shape"),
        (dict(vocab_size=11), "vocab_size=11"),
        (dict(return_argmax=True, grad="in-forward"), "return_argmax=True needs grad='recompute'"),
        (dict(schedule="sideways"), "schedule='sideways'"),
        (dict(schedule="activations", grad="in-forward"), "schedule='activations' with grad='in-forward'"),
        (dict(schedule="weights", grad="in-forward"), "pass schedule='gather' (or 'auto')"),
        (dict(schedule="gather"), "schedule='gather' with grad='recompute'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ring_linear_cross_entropy(x, w, y, **kwargs)
    with pytest.raises(ValueError, match="integer class ids"):
        ring_linear_cross_entropy(x, w, y.float())
    with pytest.raises(ValueError, match="hidden must be"):
        ring_linear_cross_entropy(x[None], w, y)


def test_auto_schedule_rule() -> None:
    assert resolve_schedule("auto", 100, 800, 8) == "activations"
    assert resolve_schedule("auto", 101, 800, 8) == "weights"
    assert resolve_schedule("weights", 1, 10**6, 8) == "weights"
    # the gradients computed with the loss run the collective 'gather' schedule, whatever the sizes
    assert resolve_schedule("auto", 100, 800, 8, in_forward=True) == "gather"
    assert resolve_schedule("gather", 101, 800, 8, in_forward=True) == "gather"
    assert resolve_schedule("gather", 101, 800, 8) == "weights"  # loss only (no autograd): the ring auto picks
    with pytest.raises(ValueError, match="pass schedule='gather'"):
        resolve_schedule("activations", 100, 800, 8, in_forward=True)


def test_schedule_reason_says_which_and_why() -> None:
    assert schedule_reason("auto", "activations", 100, 800, 8).startswith("auto: 100 tokens per rank x 8 <= V=800")
    assert schedule_reason("auto", "weights", 101, 800, 8).startswith("auto: 101 tokens per rank x 8 > V=800")
    assert "all-gathered" in schedule_reason("auto", "gather", 101, 800, 8)
    assert schedule_reason("weights", "weights", 1, 800, 8).startswith("as asked (weight shards travel")
    assert schedule_reason("gather", "weights", 101, 800, 8).startswith("gather asked, but")
    assert schedule_reason("auto", "single", 5, 800, 1).startswith("one rank")


def test_auto_block_size_is_a_multiple_of_256_rows() -> None:
    """The automatic block is 128 MiB of [tokens, rows] logits rounded down to a multiple of 256 rows:
    2**27 // (10000 x 4) = 3355 rows -> 13 x 256 = 3328."""
    assert auto_block_size(10000, 4) == 3328


def _peak_fwd_bwd(n: int, V: int, block: int) -> tuple[int, int]:
    torch.manual_seed(0)
    x = torch.randn(n, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (n,))
    with LiveBytesMeter() as meter:
        loss = ring_linear_cross_entropy(x, w, y, block_size=block, kernel="torch")
        loss.sum().backward()
        outputs = x.grad.nbytes + w.grad.nbytes  # the gradients themselves are the floor
        peak = meter.peak
    return peak - outputs, n * V * 4


def test_working_set_is_bounded_and_independent_of_vocab() -> None:
    block = 64
    peaks = {}
    for n, V in [(256, 1024), (256, 4096), (512, 4096)]:
        extra, full_logits = _peak_fwd_bwd(n, V, block)
        # bound: a block of logits in fp32 three times over (z, exp temp, grad) plus O(n * h) fp32 for dX
        bound = 3 * n * block * 4 + 2 * n * H * 4 + 64 * n
        assert extra <= bound, (n, V, extra, bound)
        assert extra < full_logits // 4, (n, V, extra, full_logits)
        peaks[(n, V)] = extra
    assert peaks[(256, 4096)] <= peaks[(256, 1024)] * 1.05  # no growth with V


def _errs(fn, x, w, y, g, dt, ref=None):
    xx, ww = x.to(dt).requires_grad_(True), w.to(dt).requires_grad_(True)
    loss = fn(xx, ww)
    (loss.double() * g.double()).sum().backward()
    out = (loss.detach().double(), xx.grad.double(), ww.grad.double())
    if ref is None:
        return out
    return [float((a - r).norm() / r.norm()) for a, r in zip(out, ref)]


def test_bf16_not_worse_than_naive_same_dtype_reference() -> None:
    """bf16 rule on CPU (torch block kernel): error vs an fp64 reference <= the naive bf16 reference's."""
    torch.manual_seed(0)
    n, V = 300, 1999
    x, w = torch.randn(n, H), torch.randn(V, H) * 0.3
    y, g = torch.randint(0, V, (n,)), torch.rand(n)
    y[::7] = -100
    ref = _errs(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, y, g, torch.float64)
    naive = _errs(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, y, g, torch.bfloat16, ref)
    ours = _errs(lambda a, b: ring_linear_cross_entropy(a, b, y, block_size=256), x, w, y, g, torch.bfloat16, ref)
    for what, o, nv in zip(("loss", "dX", "dW"), ours, naive):
        assert o <= nv * 1.02 + 1e-4, (what, o, nv)
    # accumulate='input' trades a few bf16 roundings of dX for the gradient floor: bounded, not free
    inp = _errs(lambda a, b: ring_linear_cross_entropy(a, b, y, block_size=256, accumulate="input"),
                x, w, y, g, torch.bfloat16, ref)
    assert inp[0] == ours[0] and inp[2] == ours[2]
    assert inp[1] <= 3 * naive[1], (inp[1], naive[1])


def _bf16_ring_checks(rank: int, world: int) -> list[str]:
    """Each rank's loss, dX and dW shard in bf16 against an fp64 reference on the same bf16 inputs, no worse
    than the naive bf16 computation's (1.02x + 1e-4), for both ring schedules: the sums that travel the
    ring (dX with visiting activations, dW with visiting weights) must stay in fp32 between ranks."""
    group = dist.new_group(list(range(world)))
    n, V = 150, 1999
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(n * world, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    y, gw = torch.randint(0, V, (n * world,), generator=g), torch.rand(n * world, generator=g)
    y[::7] = -100
    x, w = x.bfloat16(), w.bfloat16()
    ref = _errs(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, y, gw, torch.float64)
    naive = _errs(lambda a, b: reference_linear_cross_entropy(a, b, y), x, w, y, gw, torch.bfloat16)
    shards = _shards(V, world, False)
    lo, hi = sum(shards[:rank]), sum(shards[:rank + 1])
    rows = slice(rank * n, (rank + 1) * n)

    def rel(a: torch.Tensor, r: torch.Tensor) -> float:
        return float((a.double() - r).norm() / r.norm())

    done = []
    for schedule in ("activations", "weights"):
        xx, ww = x[rows].detach().clone().requires_grad_(True), w[lo:hi].detach().clone().requires_grad_(True)
        loss = ring_linear_cross_entropy(xx, ww, y[rows], group, schedule=schedule, block_size=64, kernel="torch")
        (loss.double() * gw[rows].double()).sum().backward()
        for what, o, nv, r in (("loss", loss.detach(), naive[0][rows], ref[0][rows]),
                               ("dX", xx.grad, naive[1][rows], ref[1][rows]),
                               ("dW", ww.grad, naive[2][lo:hi], ref[2][lo:hi])):
            assert rel(o, r) <= rel(nv, r) * 1.02 + 1e-4, (schedule, what, rel(o, r), rel(nv, r))
        done.append(schedule)
    return done


@pytest.mark.parametrize("world", [2])
def test_bf16_ring_not_worse_than_naive(world: int) -> None:
    assert run_distributed(_bf16_ring_checks, world, timeout=120) == [["activations", "weights"]] * world


def test_fp32_accumulation_never_swallows_errors(monkeypatch) -> None:
    """Once the CUDA way of adding a low-precision GEMM into an fp32 accumulator is known, an error in it
    (out of memory above all) must propagate: skipping the addition would silently drop a gradient block."""
    from megatron_peakflat import matmul

    class FakeCuda(torch.Tensor):  # reaches the CUDA branch on CPU
        @property
        def is_cuda(self) -> bool:
            return True

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    acc = torch.zeros(3, 5)
    a, b = torch.randn(3, 4, dtype=torch.bfloat16).as_subclass(FakeCuda), torch.randn(4, 5, dtype=torch.bfloat16)
    monkeypatch.setattr(torch, "addmm", oom)
    monkeypatch.setattr(matmul, "_CUDA_ACC_WAY", "addmm")
    with pytest.raises(torch.OutOfMemoryError):
        matmul.accumulate_mm(acc, a, b)
    monkeypatch.setattr(matmul, "_CUDA_ACC_WAY", None)  # while probing, an out-of-memory is not "unsupported"
    with pytest.raises(torch.OutOfMemoryError):
        matmul.accumulate_mm(acc, a, b)
