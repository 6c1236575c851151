"""Ring-DTP with the gradients computed in the forward pass (``grad='in-forward'``) against
F.cross_entropy on the full logits: loss, dX and dW, fp32, gloo world 1/2/4.

Covers chunks smaller than a rank's tokens and token counts that differ per rank (ranks run out of
tokens at different chunks), uneven shards, ignore_index, label smoothing, an all-ignored batch, dW
into main_grad or returned, a correct hint (no recompute) and a wrong one (the difference recomputed:
still exact), reduction mean/sum, no-grad (loss only), and the bounded working set (one rank and a ring of two).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_peakflat import stats
from megatron_peakflat.testing import LiveBytesMeter, loss_and_grad_errors, max_rel_error, run_distributed
from megatron_peakflat.vocab import reference_linear_cross_entropy, ring_linear_cross_entropy
from megatron_peakflat.vocab.api import auto_chunk_tokens

H = 16



CASES = [
    # (V, tokens per rank (cycled), chunk tokens over the ring, label smoothing, ignore fraction, all ignored,
    #  into main_grad, hint: 'right' | 'wrong')
    (103, [13, 7, 11, 5], 4, 0.0, 0.2, False, False, "right"),
    (97, [29, 31, 17, 23], 16, 0.1, 0.1, False, True, "right"),
    (61, [9, 14, 3, 8], 1000, 0.05, 0.0, False, True, "wrong"),
    (61, [9, 14, 3, 8], 6, 0.0, 0.3, False, False, "wrong"),
    (61, [9, 14, 3, 8], 5, 0.0, 0.0, True, True, "right"),
]


def _shards(V: int, P: int) -> list[int]:
    base = [V // P + (r % 3) - 1 for r in range(P)] if P > 1 else [V]
    base[-1] = V - sum(base[:-1])
    return base


def _checks(rank: int, world: int) -> list[str]:
    group = dist.new_group(list(range(world)))
    done = []
    for i, (V, toks, chunk, eps, ign, all_ign, into, hint) in enumerate(CASES):
        tokens = [toks[r % len(toks)] for r in range(world)]
        shards = _shards(V, world)
        start = sum(shards[:rank])
        g = torch.Generator().manual_seed(200 + i)
        w = torch.randn(V, H, generator=g) * 0.5
        xs = [torch.randn(n, H, generator=g) for n in tokens]
        ys = []
        for n in tokens:
            y = torch.randint(0, V, (n,), generator=g)
            y[torch.rand(n, generator=g) < ign] = -100
            if all_ign:
                y[:] = -100
            ys.append(y)
        gs = [torch.randn(n, generator=g) for n in tokens]
        # 'right': the hint is the real upstream gradient; 'wrong': it is off on some tokens
        hints = [gg.clone() if hint == "right" else gg + (torch.rand(n, generator=g) < 0.5) * 0.7
                 for gg, n in zip(gs, tokens)]

        wr = w.clone().requires_grad_(True)
        xr = [t.clone().requires_grad_(True) for t in xs]
        refs = [reference_linear_cross_entropy(xr[r], wr, ys[r], label_smoothing=eps) for r in range(world)]
        sum((l * gg).sum() for l, gg in zip(refs, gs)).backward()
        ref_dw = wr.grad[start:start + shards[rank]]

        x = xs[rank].clone().requires_grad_(True)
        wp = w[start:start + shards[rank]].clone().requires_grad_(True)
        held = torch.randn(wp.shape, generator=torch.Generator().manual_seed(rank))
        if into:
            wp.main_grad, wp.grad_added_to_main_grad = held.clone(), False
        stats.reset()
        loss = ring_linear_cross_entropy(x, wp, ys[rank], group, label_smoothing=eps, kernel="torch", vocab_size=V,
                                         grad="in-forward", grad_hint=hints[rank], chunk_tokens=chunk,
                                         schedule="gather" if i % 3 == 0 else "auto",
                                         dw_into_main_grad=into, accumulate="input" if i % 2 else "fp32")
        (loss * gs[rank]).sum().backward()
        what = f"case {i} (V={V}, P={world}, chunk={chunk}, hint {hint})"
        st = stats.snapshot()["vocab"]
        assert st["grad"] == "in-forward", what
        assert st["schedule"] == ("gather" if world > 1 else "single"), (what, st)  # collectives, not a ring
        assert st.get("hint_corrections", 0) == (1 if hint == "wrong" and not all_ign else 0), (what, st)
        assert st["in_forward_chunks"] == -(-max(tokens) // -(-chunk // world)), (what, st)
        assert loss.shape == (tokens[rank],) and loss.dtype == torch.float32, what
        assert torch.all(loss[ys[rank] == -100] == 0), what
        dw = (wp.main_grad - held) if into else wp.grad
        if into:
            assert wp.grad_added_to_main_grad, what
        if all_ign:
            assert torch.all(loss == 0) and torch.all(x.grad == 0) and torch.all(dw == 0), what
        else:
            assert max_rel_error(loss, refs[rank]) < 1e-5, (what, "loss", max_rel_error(loss, refs[rank]))
            assert max_rel_error(x.grad, xr[rank].grad) < 1e-5, (what, "dX", max_rel_error(x.grad, xr[rank].grad))
            assert max_rel_error(dw, ref_dw) < 1e-5, (what, "dW", max_rel_error(dw, ref_dw))
        done.append(what)

    # no autograd: the loss only (no gradient work, no chunks counted)
    V, n = 50, 12
    shards = _shards(V, world)
    start = sum(shards[:rank])
    g = torch.Generator().manual_seed(9)
    w = torch.randn(V, H, generator=g)
    xs = [torch.randn(n, H, generator=g) for _ in range(world)]
    ys = [torch.randint(0, V, (n,), generator=g) for _ in range(world)]
    stats.reset()
    with torch.no_grad():
        loss = ring_linear_cross_entropy(xs[rank], w[start:start + shards[rank]], ys[rank], group, grad="in-forward")
    assert stats.snapshot()["vocab"]["grad"] == "recompute" and "in_forward_chunks" not in stats.snapshot()["vocab"]
    assert stats.snapshot()["vocab"]["schedule"] in (("activations", "weights") if world > 1 else ("single",))
    assert max_rel_error(loss, reference_linear_cross_entropy(xs[rank], w, ys[rank])) < 1e-5
    return done


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_in_forward_matches_full_cross_entropy(world: int) -> None:
    out = run_distributed(_checks, world, timeout=180)
    assert all(len(o) == len(CASES) for o in out)


@pytest.mark.parametrize("reduction,hint", [("mean", None), ("sum", None), ("mean", 0.25), ("sum", 3.0)])
def test_reductions_take_their_hint(reduction: str, hint: float | None) -> None:
    """The default hint (1.0) is what ``.backward()`` of a mean or sum gives: no recompute; a hint that is
    a number scales it the same way the reduction's gradient does."""
    torch.manual_seed(1)
    x = torch.randn(41, H, requires_grad=True)
    w = torch.randn(77, H, requires_grad=True)
    y = torch.randint(0, 77, (41,))
    y[::5] = -100
    stats.reset()
    out = ring_linear_cross_entropy(x, w, y, reduction=reduction, grad="in-forward", grad_hint=hint, chunk_tokens=8)
    ref = reference_linear_cross_entropy(x, w, y, reduction=reduction)
    scale = 1.0 if hint is None else hint
    errs = loss_and_grad_errors(out, ref, (x, w), torch.tensor(scale))
    assert stats.snapshot()["vocab"].get("hint_corrections", 0) == 0
    assert max(errs) < 1e-5, errs


def test_hint_is_checked_token_by_token() -> None:
    """The hint is compared with the real gradient token by token: a small token's 10% miss is corrected
    even beside a token whose gradient is a million times larger, and each token's dX is the real one."""
    torch.manual_seed(3)
    x = torch.randn(2, H, requires_grad=True)
    w = torch.randn(29, H, requires_grad=True)
    y = torch.tensor([4, 17])
    real = torch.tensor([1000.0, 1.1e-3])
    stats.reset()
    loss = ring_linear_cross_entropy(x, w, y, grad="in-forward", grad_hint=torch.tensor([1000.0, 1e-3]),
                                     kernel="torch")
    loss.backward(real)
    assert stats.snapshot()["vocab"].get("hint_corrections", 0) == 1
    xr = x.detach().clone().requires_grad_(True)
    reference_linear_cross_entropy(xr, w.detach(), y).backward(real)
    for t in range(2):
        assert max_rel_error(x.grad[t], xr.grad[t]) < 1e-5, (t, max_rel_error(x.grad[t], xr.grad[t]))


def test_bad_hint_shape_and_chunk() -> None:
    x, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="grad_hint of shape"):
        ring_linear_cross_entropy(x, w, y, grad="in-forward", grad_hint=torch.ones(3), reduction="none")
    with pytest.raises(ValueError, match="grad_hint of shape"):
        ring_linear_cross_entropy(x, w, y, grad="in-forward", grad_hint=torch.ones(4), reduction="mean")
    with pytest.raises(ValueError, match="grad='sideways'"):
        ring_linear_cross_entropy(x, w, y, grad="sideways")
    with pytest.raises(ValueError, match="chunk_tokens=-1"):
        ring_linear_cross_entropy(x, w, y, grad="in-forward", chunk_tokens=-1)


def test_auto_chunk_tokens() -> None:
    # at most h tokens, 2 GiB of [chunk, V/P] bf16 logits and 1/8 of the tokens, a multiple of 128 tokens per rank
    assert auto_chunk_tokens(201088, 2, 1, 32768, 7168) == 4096  # 1/8 of the tokens (2 GiB would be 5340)
    assert auto_chunk_tokens(201088, 2, 1, 10**6, 7168) == 5248  # 2 GiB
    assert auto_chunk_tokens(100544, 2, 2, 32768, 7168) == 2 * 2048
    assert auto_chunk_tokens(100544, 2, 2, 16384, 7168) == 2 * 1024
    assert auto_chunk_tokens(10**9, 2, 4, 10**6, 7168) == 4 * 128  # at least 128 per rank
    # h tokens: at N=65536, H=4096, V=128256 the 1/8 share (8192) would hold 1.96 GiB of logits, twice dW's bytes
    assert auto_chunk_tokens(128256, 2, 1, 65536, 4096) == 4096
    assert auto_chunk_tokens(201088, 2, 1, 10**6, 5000) == 4992  # rounded down to 128 tokens


def test_auto_chunk_tokens_takes_at_least_an_eighth_of_the_tokens() -> None:
    """The 1/8 share of the tokens is rounded up: 2047 tokens give ceil(2047 / 8) = 256, a whole 128-token
    multiple, where rounding down (255) would fall to 128."""
    assert auto_chunk_tokens(1000, 2, 1, 2047, 4096) == 256


def _liger_flce_peak(n: int, h: int, v: int, w: int) -> int:
    """Liger's fused linear cross-entropy (liger-kernel's ops/fused_linear_cross_entropy.py, bf16, no fp32
    accumulation): it holds dX [n, h] and dW [v, h] in the inputs' dtype and one [chunk, v] block of logits,
    chunk = next_power_of_2(ceil(n / ceil(v / h))), at most n (so a chunk's logits are about the hidden
    states' size). Its fp32 loss per token is counted too. On one H100 this model gives 1.97 GiB at n=65536,
    h=4096, v=128256, the measured peak there."""
    inc = -(-v // h)
    chunk = min(n, 1 << (max(1, -(-n // inc)) - 1).bit_length())
    return n * h * w + v * h * w + chunk * v * w + 4 * n


def test_auto_chunk_keeps_the_training_path_under_liger_at_every_benchmarked_shape() -> None:
    """The training path (in-forward, dW into DDP's main_grad, the CUDA kernel's one block of logits in the
    input dtype), as the planner predicts it with the automatic chunk, stays at or under the Liger model's peak
    over N up to 65536, V 128256-201088, H 4096-7168, at TP=1 and on a TP=2 ring with sequence parallelism (per
    rank, against Liger's one-GPU peak at the same N). The previous rule (1/8 of the tokens up to 2 GiB of
    logits) exceeded it at N=65536, H=4096, V=128256: 2.46 GiB against 1.97."""
    from megatron_peakflat.config import PeakflatConfig
    from megatron_peakflat.planner import model as M
    from megatron_peakflat.planner.model import RunConfig
    from megatron_peakflat.planner.shapes import ModelShape
    from megatron_peakflat.vocab.config import VocabConfig

    pf = PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))
    checked = 0
    for h in (4096, 5120, 7168):
        for v in (128256, 151936, 201088):
            s = ModelShape(name="v", hidden=h, layers=1, heads=32, kv_heads=8, head_dim=128, ffn=1024, vocab=v)
            for n in (4096, 8192, 16384, 24576, 32768, 65536):
                liger = _liger_flce_peak(n, h, v, 2)
                for tp in (1, 2):
                    run = RunConfig(seq_len=n, tp=tp, sequence_parallel=tp > 1)
                    ours = M.vocab_ring_dtp(s, run, pf)
                    assert M.vocab_grad(pf) == "in-forward"
                    assert ours <= liger, (n, h, v, tp, ours / 2**30, liger / 2**30)
                    checked += 1
    assert checked == 3 * 3 * 6 * 2
    # the hold-out shape, as measured: Liger 1.97 GiB; ours now dX 0.5 + one 4096-token chunk 0.98 GiB
    s = ModelShape(name="v", hidden=4096, layers=1, heads=32, kv_heads=8, head_dim=128, ffn=1024, vocab=128256)
    assert _liger_flce_peak(65536, 4096, 128256, 2) / 2**30 == pytest.approx(1.97, abs=0.01)
    assert M.vocab_ring_dtp(s, RunConfig(seq_len=65536), pf) / 2**30 == pytest.approx(1.48, abs=0.01)


def test_stats_peak_keeps_the_largest_value() -> None:
    """``stats.peak`` (the vocabulary's largest block of logits over calls) keeps the maximum, not the last value."""
    stats.reset()
    stats.peak("x", "k", 5)
    stats.peak("x", "k", 3)
    assert stats.snapshot()["x"]["k"] == 5
    stats.reset()


def _extra_peak(n: int, V: int, chunk: int) -> int:
    torch.manual_seed(0)
    x = torch.randn(n, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(V, H), False
    y = torch.randint(0, V, (n,))
    with LiveBytesMeter() as meter:
        loss = ring_linear_cross_entropy(x, w, y, grad="in-forward", chunk_tokens=chunk, kernel="torch",
                                         dw_into_main_grad=True)
        loss.sum().backward()
        peak = meter.peak - x.grad.nbytes  # dX itself is the floor; dW went into main_grad
    return peak


def test_in_forward_working_set_is_one_chunk() -> None:
    """The working set is one [chunk, V] block (the CPU kernel's fp32 temporaries) and per-token state:
    it does not grow with the tokens, and no [n, V] logits exist."""
    chunk, V = 32, 2048
    peaks = {n: _extra_peak(n, V, chunk) for n in (128, 512, 2048)}
    bound = 4 * chunk * V * 4 + 2 * chunk * H * 4
    for n, p in peaks.items():
        assert p <= bound + 64 * n, (n, p, bound)
        assert p < n * V * 4 // 4 or n <= chunk * 4, (n, p)
    assert peaks[2048] - peaks[128] <= 64 * (2048 - 128), peaks  # only O(n) per-token state grows


def _ring_extra_peaks(rank: int, world: int, V: int, chunk: int, sizes: tuple[int, ...]) -> dict[int, int]:
    group = dist.new_group(list(range(world)))
    peaks = {}
    for n in sizes:  # tokens on every rank
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(n, H, generator=g, requires_grad=True)
        w = torch.randn(V // world, H, generator=g, requires_grad=True)
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(V // world, H), False
        y = torch.randint(0, V, (n,), generator=g)
        with LiveBytesMeter() as meter:
            loss = ring_linear_cross_entropy(x, w, y, group, grad="in-forward", chunk_tokens=chunk, kernel="torch",
                                             dw_into_main_grad=True)
            loss.sum().backward()
            peaks[n] = meter.peak - x.grad.nbytes  # dX itself is the floor; dW went into main_grad
    return peaks


def test_in_forward_ring_working_set_is_one_chunk_of_the_shard() -> None:
    """On a ring of 2 gloo ranks, tokens growing 16x: each rank's working set is one [chunk, V/P] block and
    the chunk's hidden rows (the same formula as one rank's, V/P for V), plus O(n) per-token state."""
    world, chunk, V = 2, 64, 4096
    for rank, peaks in enumerate(run_distributed(_ring_extra_peaks, world, V, chunk, (128, 512, 2048), timeout=180)):
        bound = 4 * chunk * (V // world) * 4 + 2 * chunk * H * 4
        for n, p in peaks.items():
            assert p <= bound + 64 * n, (rank, n, p, bound)
        assert peaks[2048] < 2048 * (V // world) * 4 // 8, (rank, peaks)  # far from this rank's [n, V/P] logits
        assert peaks[2048] - peaks[128] <= 64 * (2048 - 128), (rank, peaks)


def _ddp_like(p: torch.nn.Parameter) -> None:
    """Megatron DDP's gradient plumbing on one parameter: an fp32 main_grad and the hook on its
    AccumulateGrad node that adds ``param.grad`` there unless ``grad_added_to_main_grad``."""
    p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape), False

    def hook(*_):
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    p._acc = p.expand_as(p).grad_fn.next_functions[0][0]  # kept alive, as DDP keeps its grad_accs
    p._acc.register_hook(hook)


@pytest.mark.parametrize("grad", ["recompute", "in-forward"])
def test_tied_weight_gradient_joins_the_embeddings_in_main_grad(grad: str) -> None:
    """An output layer tied to the input embedding (weight_shared): dW goes into main_grad, backward returns
    none for the weight, and the DDP hook adds the embedding's gradient: main_grad is the whole gradient."""
    torch.manual_seed(3)
    V, n = 40, 24
    ids = torch.randint(0, V, (n,))
    y = torch.randint(0, V, (n,))
    w0 = torch.randn(V, H)
    proj = torch.randn(H, H) * 0.3

    def loss_of(w: torch.Tensor, **kw) -> torch.Tensor:
        h = torch.tanh(torch.nn.functional.embedding(ids, w) @ proj)  # the lookup uses the same weight
        if kw:
            return ring_linear_cross_entropy(h, w, y, reduction="mean", kernel="torch", **kw)
        return reference_linear_cross_entropy(h, w, y, reduction="mean")

    ref = torch.nn.Parameter(w0.clone())
    loss_of(ref).backward()
    w = torch.nn.Parameter(w0.clone())
    _ddp_like(w)
    stats.reset()
    loss_of(w, dw_into_main_grad=True, weight_shared=True, grad=grad, chunk_tokens=8).backward()
    assert stats.snapshot()["vocab"]["dw_into_main_grad"] == 1
    assert not w.grad_added_to_main_grad and w.grad is None
    assert max_rel_error(w.main_grad, ref.grad) < 1e-5, max_rel_error(w.main_grad, ref.grad)
    # without weight_shared the hook would skip the embedding's part: main_grad is short of it
    w2 = torch.nn.Parameter(w0.clone())
    _ddp_like(w2)
    loss_of(w2, dw_into_main_grad=True, grad=grad, chunk_tokens=8).backward()
    assert max_rel_error(w2.main_grad, ref.grad) > 1e-3
