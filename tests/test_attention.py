"""SDPAttention equals Megatron's DotProductAttention (outputs and input gradients), causal and padded, and with
context parallelism against DotProductAttention on the whole sequence."""

import pytest
import torch

from megatron_peakflat.testing import run_distributed


def _per_kv_head_calls_from_the_first_key() -> list[str]:
    """Every grouped-head attention as one SDPA call per K/V head (attention/calls.py, normally from 32768 keys);
    returns the package log's lines, where the attention says so."""
    import logging

    from megatron_peakflat.attention import calls

    calls.GROUPED_CALL_MIN_KEYS = 1
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megatron_peakflat").addHandler(handler)
    logging.getLogger("megatron_peakflat").setLevel(logging.INFO)
    return lines


def _compare(rank, world_size, per_kv_head=False):
    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel, tiny_transformer_config

    init_megatron_parallel(tp=world_size)
    said = _per_kv_head_calls_from_the_first_key() if per_kv_head else []
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_peakflat.integration.attention import sdpa_core_attention_class

    SDPAttention = sdpa_core_attention_class()
    results, split = [], False
    s, b, hn = 37, 2, 16
    for groups, mask_type, mask_kind in [
        (8, AttnMaskType.causal, None),
        (8, AttnMaskType.causal, "causal"),
        (4, AttnMaskType.causal, None),
        (8, AttnMaskType.padding, "padding"),
        (4, AttnMaskType.padding, "padding"),
    ]:
        cfg = tiny_transformer_config(num_attention_heads=8, num_query_groups=groups, kv_channels=hn,
                                      hidden_size=64, num_moe_experts=None)
        ref = DotProductAttention(cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self")
        ours = SDPAttention(cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self")
        np_ = 8 // world_size
        ng = groups // world_size
        split = split or 1 < ng < np_  # grouped, with more than one K/V head to split over
        g = torch.Generator().manual_seed(7)
        q = torch.randn(s, b, np_, hn, generator=g)
        k = torch.randn(s, b, ng, hn, generator=g)
        v = torch.randn(s, b, ng, hn, generator=g)
        mask = None
        if mask_kind == "causal":
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
        elif mask_kind == "padding":
            valid = torch.tensor([s, s - 9])
            keys = torch.arange(s).view(1, 1, 1, s) >= valid.view(b, 1, 1, 1)
            mask = keys.expand(b, 1, s, s)
        outs, grads = [], []
        for mod in (ref, ours):
            qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
            out = mod(qi, ki, vi, mask, attn_mask_type=mask_type)
            out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
            outs.append(out.detach())
            grads.append([t.grad for t in (qi, ki, vi)])
        assert outs[0].shape == outs[1].shape == (s, b, np_ * hn)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        for gr, go in zip(*grads):
            torch.testing.assert_close(go, gr, rtol=1e-5, atol=1e-5)
        results.append((groups, str(mask_type), mask_kind))
    return results, [ln for ln in said if "SDPA calls" in ln], per_kv_head and split


@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sdpa_matches_dot_product_attention(world, per_kv_head):
    """At TP = world: 8 heads, 8 or 4 query groups, so each rank holds 8/TP heads and at least one group; also with
    grouped heads run as one call per K/V head, which the attention says once."""
    res = run_distributed(_compare, world, per_kv_head)
    assert len(res) == world and all(len(r) == 5 for r, _, _ in res)
    for _, said, split in res:
        assert len(said) == (1 if split else 0), said
    assert any(split for _, _, split in res) == (per_kv_head and world < 4)  # at TP 4 each rank has one K/V head


def _handed_back(rank, world_size):
    """A config SDPA does not reproduce (here off-by-one softmax, gpt-oss's) runs Megatron's own forward."""
    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel, tiny_transformer_config

    init_megatron_parallel(tp=1)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_peakflat.integration.attention import sdpa_core_attention_class

    SDPAttention = sdpa_core_attention_class()
    s, b, hn = 11, 2, 16
    cfg = tiny_transformer_config(num_attention_heads=4, num_query_groups=4, kv_channels=hn, hidden_size=64,
                                  num_moe_experts=None, softmax_type="off-by-one")
    ref = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours = SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    plain_cfg = tiny_transformer_config(num_attention_heads=4, num_query_groups=4, kv_channels=hn, hidden_size=64,
                                        num_moe_experts=None)
    plain = DotProductAttention(plain_cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, b, 4, hn, generator=g) for _ in range(3))
    before = SDPAttention._handed_back
    out_ref, out_ours, out_plain = (m(q, k, v, None, attn_mask_type=AttnMaskType.causal) for m in (ref, ours, plain))
    return before, SDPAttention._handed_back, torch.equal(out_ours, out_ref), (out_ours - out_plain).abs().max().item()


def test_sdpa_hands_a_softmax_it_does_not_reproduce_back_to_megatron():
    (res,) = run_distributed(_handed_back, 1)
    before, after, equal, off_by_one_effect = res
    assert not before and after and equal
    assert off_by_one_effect > 1e-4  # the off-by-one softmax differs from vanilla, so the equality says something


def _compare_cp(rank, world_size, per_kv_head=False):
    """SDPAttention at CP = world (this rank's chunks r and 2CP-1-r) against DotProductAttention on the whole
    sequence at CP = 1: causal (no mask) and with the dataloader's explicit causal mask, MHA and GQA."""
    import copy

    from megatron_peakflat.attention.context_parallel import split_sequence
    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel, tiny_transformer_config

    init_megatron_parallel(context_parallel_size=world_size)
    if per_kv_head:
        _per_kv_head_calls_from_the_first_key()
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_peakflat.integration.attention import sdpa_core_attention_class

    SDPAttention = sdpa_core_attention_class()
    s, b, hn, worst = 4 * world_size * 3, 2, 16, 0.0
    for groups, explicit in [(8, False), (2, False), (2, True)]:
        cfg = tiny_transformer_config(num_attention_heads=8, num_query_groups=groups, kv_channels=hn,
                                      hidden_size=64, num_moe_experts=None, context_parallel_size=world_size)
        one = copy.copy(cfg)
        one.context_parallel_size = 1
        ref = DotProductAttention(one, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        ours = SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        assert ours.cp_group is not None and ours.config.context_parallel_size == world_size
        g = torch.Generator().manual_seed(5)
        q = torch.randn(s, b, 8, hn, generator=g)
        k, v = (torch.randn(s, b, groups, hn, generator=g) for _ in range(2))
        dout = torch.randn(s, b, 8 * hn, generator=g)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s).expand(b, 1, s, s)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        out_ref = ref(*whole, mask if explicit else None, attn_mask_type=AttnMaskType.causal)
        out_ref.backward(dout)
        mine = [split_sequence(t, world_size, rank).requires_grad_() for t in (q, k, v)]
        my_mask = split_sequence(mask, world_size, rank, dim=2) if explicit else None
        out = ours(*mine, my_mask, attn_mask_type=AttnMaskType.causal)
        out.backward(split_sequence(dout, world_size, rank))
        for got, want in zip([out.detach(), *(t.grad for t in mine)], [out_ref.detach(), *(t.grad for t in whole)]):
            want = split_sequence(want, world_size, rank)
            assert got.shape == want.shape
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_sdpa_with_context_parallelism_matches_dot_product_attention_on_the_whole_sequence(cp, per_kv_head):
    res = run_distributed(_compare_cp, cp, per_kv_head)
    assert len(res) == cp and max(res) <= 1e-5, res
