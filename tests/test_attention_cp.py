"""context_parallel_attention (plain torch, gloo) against full-sequence causal SDPA: outputs, dQ, dK and dV.

Every rank builds the same whole q, k, v and output gradient, runs the full-sequence reference, and then its own
share (Megatron's layout: chunks r and 2CP-1-r) through the CP attention; its share of the reference's output
and gradients must match within 1e-5 (fp32). CP = 1, 2, 3, 4 (2 x CP chunks each), MHA and GQA, odd sizes, and
an explicit document mask (additive) in place of the causal one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_peakflat.attention.context_parallel import (chunks_of_rank, context_parallel_attention, gather_sequence,
                                                          merge_sequence, split_sequence)
from megatron_peakflat.testing import run_distributed

CASES = [  # (chunk tokens c, micro-batch, query heads, key/value heads, head dim, scale)
    (5, 2, 6, 6, 8, None),
    (3, 1, 6, 2, 16, 0.3),
    (1, 3, 4, 1, 8, None),
]


def _reference(q, k, v, scale, bias=None):
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kb = kb.repeat_interleave(qb.shape[1] // kb.shape[1], dim=1)
    vb = vb.repeat_interleave(qb.shape[1] // vb.shape[1], dim=1)
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, is_causal=bias is None,
                                          scale=scale).permute(2, 0, 1, 3)


def _document_bias(s: int, b: int) -> torch.Tensor:
    """Additive [b, 1, s, s] mask: causal within documents (a boundary at a different place per sample), -10000
    elsewhere, as Megatron fills a --reset-attention-mask batch's mask."""
    pos = torch.arange(s)
    masked = []
    for i in range(b):
        doc = (pos >= (s // 3 + i)).long()
        masked.append((pos.view(1, s) > pos.view(s, 1)) | (doc.view(1, s) != doc.view(s, 1)))
    return torch.zeros(b, 1, s, s).masked_fill_(torch.stack(masked).unsqueeze(1), -10000.0)


def _rank(rank: int, world: int):
    group = dist.new_group(list(range(world)))
    errors = []
    for (c, b, h, g, d, scale), masked in [(case, False) for case in CASES] + [(CASES[1], True)]:
        s = 2 * world * c
        gen = torch.Generator().manual_seed(11 + c)
        q, k, v = (torch.randn(s, b, n, d, generator=gen, dtype=torch.float32) for n in (h, g, g))
        dout = torch.randn(s, b, h, d, generator=gen)
        bias = _document_bias(s, b) if masked else None
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _reference(*ref_in, scale, bias)
        ref.backward(dout)
        mine = [split_sequence(t, world, rank).requires_grad_() for t in (q, k, v)]
        my_bias = None if bias is None else split_sequence(bias, world, rank, dim=2)  # this rank's query rows
        out = context_parallel_attention(*mine, group, scale=scale, attn_bias=my_bias)
        out.backward(split_sequence(dout, world, rank))
        want = [ref.detach(), *(t.grad for t in ref_in)]
        got = [out.detach(), *(t.grad for t in mine)]
        errors.append([(a - split_sequence(w, world, rank)).abs().max().item() / max(1e-30, w.abs().max().item())
                       for a, w in zip(got, want)])
    return errors


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_attention_equals_full_sequence_sdpa(cp):
    results = run_distributed(_rank, cp, timeout=240)
    assert len(results) == cp
    for rank, errors in enumerate(results):
        assert len(errors) == len(CASES) + 1
        for case, errs in zip([*CASES, "document mask"], errors):
            assert max(errs) <= 1e-5, (rank, case, dict(zip(("out", "dq", "dk", "dv"), errs)))


def test_layout_is_megatrons():
    """chunks r and 2CP-1-r, as megatron.core.utils.get_batch_on_this_cp_rank cuts a [b, s] batch."""
    from megatron.core.utils import _get_batch_on_this_cp_rank_per_sequence_balancing as megatron_split

    assert [chunks_of_rank(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    tokens = torch.arange(2 * 24).view(2, 24)
    shares = []
    for r in range(4):
        class _Group:  # Megatron's function reads only the group's size and this rank's place in it
            pass

        import unittest.mock as mock

        with mock.patch("torch.distributed.get_world_size", lambda group=None: 4), \
                mock.patch("torch.distributed.get_rank", lambda group=None, r=r: r):
            theirs = megatron_split({"tokens": tokens.clone()}, cp_group=_Group())["tokens"]
        ours = split_sequence(tokens, 4, r, dim=1)
        assert torch.equal(ours, theirs), r
        shares.append(ours)
    assert torch.equal(merge_sequence(shares, dim=1), tokens)
    with pytest.raises(ValueError, match="2 x CP = 8"):
        split_sequence(torch.zeros(12), 4, 0)


def _gather_rank(rank: int, world: int):
    group = dist.new_group(list(range(world)))
    whole = torch.arange(2 * world * 3 * 2, dtype=torch.float32).view(2 * world * 3, 2)
    share = split_sequence(whole, world, rank).requires_grad_()
    full = gather_sequence(share, group)
    weight = torch.arange(full.numel(), dtype=torch.float32).view_as(full) * (rank + 1)
    (full * weight).sum().backward()
    # every rank's loss weights the whole sequence; the share's gradient sums them over the ranks
    expect = split_sequence(torch.arange(full.numel(), dtype=torch.float32).view_as(full), world, rank)
    expect = expect * sum(range(1, world + 1))
    return torch.equal(full.detach(), whole), torch.equal(share.grad, expect)


def test_gather_forward_is_the_whole_sequence_and_backward_sums_the_shares():
    assert run_distributed(_gather_rank, 3) == [(True, True)] * 3


@pytest.mark.parametrize("megatron, words", [
    (dict(seq_length=4100), "--seq-length 4100 does not split"),
    (dict(window_size=(64, 0)), "sliding-window"),
    (dict(softmax_type="learnable"), "--softmax-type learnable"),
    (dict(sft=True), "packed sequences of --sft"),
    (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
    (dict(multi_latent_attention=True), "multi-latent attention"),
])
@pytest.mark.parametrize("mode", ["sdpa", "auto"])
def test_start_up_refuses_what_cp_attention_does_not_run(megatron, words, mode):
    """With --context-parallel-size 4 on the local spec, 'sdpa' (and 'auto', which picks it without Transformer
    Engine) refuses at start-up what it cannot run, naming the flag and the fix; CP 1 lets the same flags through
    to the hand-back to Megatron (or to the refusals that apply there)."""
    from megatron_peakflat import PeakflatConfig, PeakflatConfigError
    from megatron_peakflat.integration.attention import transformer_engine_available
    from tests.test_config import parse_with_megatron

    if mode == "auto" and transformer_engine_available():
        pytest.skip("Transformer Engine is installed: 'auto' leaves its attention in place")
    base = dict(seq_length=4096, transformer_impl="local", context_parallel_size=4)
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(parse_with_megatron("--peakflat-attention", mode, **{**base, **megatron}))
    assert e.value.flag == "--peakflat-attention" and e.value.value == mode
    assert words in e.value.problem and "--context-parallel-size 4" in e.value.problem, e.value.problem
    assert e.value.fix
    if "seq_length" in megatron:
        assert "multiple of 8 (e.g. 4104)" in e.value.fix
    assert PeakflatConfig.from_args(parse_with_megatron("--peakflat-attention", mode, **base)).general.attention == mode
    if mode == "auto" or "seq_length" in megatron or "sft" in megatron or "hybrid_context_parallel" in megatron:
        one = PeakflatConfig.from_args(parse_with_megatron("--peakflat-attention", mode,
                                                           **{**base, **megatron, "context_parallel_size": 1}))
        assert one.general.attention == mode


def _memory_rank(rank: int, world: int):
    from megatron_peakflat.attention.context_parallel import _GatherKeyValueChunks
    from megatron_peakflat.testing import LiveBytesMeter

    group = dist.new_group(list(range(world)))
    c, b, g, d = 6, 2, 3, 4
    s, row = 2 * world * c, 2 * b * g * d * 4  # bytes of one token's K and V, fp32
    ends = tuple((j + 1) * c for j in (rank, 2 * world - 1 - rank))
    kv = torch.randn(2 * c, 2, b, g, d).requires_grad_()
    with LiveBytesMeter() as m:
        outs = _GatherKeyValueChunks.apply(kv, group, ends)
        held = m.live  # what stays alive for backward: the whole sequence's K and V, once
    grads = [torch.ones_like(o) for o in outs]
    with LiveBytesMeter() as m:
        torch.autograd.backward(outs, grads)
        backward_peak = m.peak
    # each sequence chunk's gradient is the number of this group's query chunks that saw it, summed over ranks
    seen = torch.zeros(2 * world)
    for r in range(world):
        for j in (r, 2 * world - 1 - r):
            seen[: j + 1] += 1
    want = split_sequence(seen.repeat_interleave(c).view(s, 1, 1, 1, 1).expand(s, 2, b, g, d), world, rank)
    return held == s * row, backward_peak <= 3 * c * row, torch.equal(kv.grad, want), (held, backward_peak, c * row)


def test_gathered_kv_is_held_once_and_its_backward_builds_no_whole_sequence_buffer():
    """The planner's cp_gathered_kv rows: forward keeps the whole sequence's K and V once ([s, 2, b, g, d]); backward,
    given SDPA's gradients, allocates only this rank's share and one chunk at a time (3 chunks' worth), never a
    whole-sequence gradient or a rank-major copy of it. The reduced gradients are right too."""
    for held, small, right, sizes in run_distributed(_memory_rank, 3):
        assert held and small and right, sizes


@pytest.mark.parametrize("case", ["causal", "bottom-right", "mask"])
def test_grouped_heads_repeated_where_the_kernel_takes_none(case, monkeypatch):
    """Where no fused kernel takes grouped K/V heads (CUDA without flash: fp32, an explicit mask), ``_attend``
    repeats them to the query heads instead of letting torch fall back to its [b, h, L, S] math backend: the
    same output and the same gradients as the grouped call, in fp32. Off CUDA the heads go as they are."""
    from megatron_peakflat.attention import context_parallel as cpa

    g = torch.Generator().manual_seed(3)
    S, L = 40, {"causal": 40, "bottom-right": 16, "mask": 16}[case]
    q = torch.randn(L, 2, 8, 16, generator=g)
    k, v = (torch.randn(S, 2, 2, 16, generator=g) for _ in range(2))
    dy = torch.randn(L, 2, 8, 16, generator=g)
    bias = torch.randn(2, 1, L, S, generator=g) if case == "mask" else None
    assert cpa.grouped_heads_taken(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), 0.0)

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = cpa._attend(*leaves, None, 0.0, bias)
        out.backward(dy)
        return [out.detach()] + [t.grad for t in leaves]

    grouped = run()
    repeats = []
    monkeypatch.setattr(cpa, "grouped_heads_taken", lambda *a: repeats.append(1) or False)
    repeated = run()
    assert repeats, "the repeated path did not run"
    for a, b in zip(repeated, grouped):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())


@pytest.mark.parametrize("case", ["causal", "bottom-right", "mask", "mask per head", "no mask"])
def test_one_call_per_kv_head_equals_one_grouped_call(case, monkeypatch):
    """At long key lengths ``_attend`` runs grouped K/V heads as one SDPA call per K/V head (``kv_head_calls``), so
    that flash's backward expands dK/dV for one group of query heads at a time: the same output and the same
    gradients as one call over every head (fp32), and as many calls as K/V heads."""
    from megatron_peakflat.attention import calls
    from megatron_peakflat.attention import context_parallel as cpa

    g = torch.Generator().manual_seed(4)
    S, L, b, heads, groups = 48, {"causal": 48, "bottom-right": 20, "no mask": 20}.get(case, 20), 2, 8, 4
    q = torch.randn(L, b, heads, 16, generator=g)
    k, v = (torch.randn(S, b, groups, 16, generator=g) for _ in range(2))
    dy = torch.randn(L, b, heads, 16, generator=g)
    bias = {"mask": torch.randn(b, 1, L, S, generator=g),
            "mask per head": torch.randn(b, heads, L, S, generator=g)}.get(case)
    sdpa_calls = []
    real = cpa._sdpa
    monkeypatch.setattr(cpa, "_sdpa", lambda *a: sdpa_calls.append(1) or real(*a))

    def run() -> list[torch.Tensor]:
        sdpa_calls.clear()
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = cpa._attend(*leaves, None, 0.0, bias, causal=case != "no mask")
        out.backward(dy)
        return [out.detach()] + [t.grad for t in leaves]

    assert calls.kv_head_calls(heads, groups, S * b) == 1  # below the threshold: one call
    whole = run()
    assert len(sdpa_calls) == 1
    monkeypatch.setattr(calls, "GROUPED_CALL_MIN_KEYS", S * b)
    per_head = run()
    assert len(sdpa_calls) == groups
    for a, w in zip(per_head, whole):
        assert a.shape == w.shape and torch.allclose(a, w, rtol=1e-5, atol=1e-6), float((a - w).abs().max())


def test_kv_head_calls():
    """One call per K/V head only where the heads are grouped and the keys reach the threshold; a head count that
    does not divide is refused."""
    from megatron_peakflat.attention.calls import GROUPED_CALL_MIN_KEYS, kv_head_calls

    assert kv_head_calls(64, 8, GROUPED_CALL_MIN_KEYS) == 8
    assert kv_head_calls(64, 8, GROUPED_CALL_MIN_KEYS - 1) == 1
    assert kv_head_calls(64, 64, 10 * GROUPED_CALL_MIN_KEYS) == 1
    assert kv_head_calls(64, 1, GROUPED_CALL_MIN_KEYS) == 1  # one K/V head: nothing to split
    with pytest.raises(ValueError, match="must divide"):
        kv_head_calls(64, 6, GROUPED_CALL_MIN_KEYS)
