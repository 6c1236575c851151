"""The tiled attention sublayer inside Megatron-Core (CPU, gloo): exact against the untiled layer.

Megatron's GPTModel on the local spec with torch SDPA as core attention (the tiled sublayer refuses Megatron's
DotProductAttention), MoE with every token routed to one expert (top-1, so that at EP > 1 some ranks get no
token), grouped K/V heads (GQA 4), RoPE, causal attention without an explicit mask, full recompute: the loss and
every parameter's gradient with ``--peakflat-tile`` on, at tiles that do not divide the sequence, against the
same model with it off, at world sizes 1, 2 and 3 (EP over the ranks; 3 and 6 experts at world 3; and TP=2
without sequence parallelism, dense, at world 2); with
PipelinedLLEP, Ring-DTP and SCO on in both runs; with an MTP layer (world 1). Also: the SDPA core attention's
bottom-right alignment, Megatron DDP with overlapped gradient reduction (world 2), Megatron's pretrain loop
(three iterations, same losses), and the hand-backs to Megatron's sublayer (an explicit mask, Megatron's local
DotProductAttention), logged and exact.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing import max_rel_error, run_distributed
from tests.conftest import needs_pretrain_entry

SEQ, MB, VOCAB = 24, 2, 64


def _batch(seed: int) -> dict:
    from megatron_peakflat.testing import megatron_cpu as mc

    b = mc.gpt_batch(SEQ, MB, VOCAB, seed=seed)
    b["attention_mask"] = None  # causal from the mask type, as in long-context training
    return b


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    from megatron_peakflat.testing import megatron_cpu as mc

    for p in model.parameters():
        p.grad = None
    model.train()
    loss = mc.gpt_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(what: str, got, ref, tol: float = 1e-5) -> float:  # noqa: ANN001
    """The loss and every gradient within ``tol`` of the reference, relative to the tensor's largest entry, or to
    a thousandth of the model's largest gradient where a tensor's own is smaller than that (the saturated
    routers of the skewed runs have gradients of 1e-5 made of cancelling terms, whose rounding is relatively
    larger)."""
    assert got[1].keys() == ref[1].keys() and len(ref[1]) > 10, (what, got[1].keys() ^ ref[1].keys())
    errs = [max_rel_error(got[0], ref[0])]
    assert errs[0] <= tol, (what, "loss", errs[0])
    floor = 1e-3 * max(float(g.abs().max()) for g in ref[1].values())
    for n in ref[1]:
        diff = float((got[1][n].double() - ref[1][n].double()).abs().max())
        errs.append(diff / max(float(ref[1][n].abs().max()), floor))
        assert errs[-1] <= tol, (what, n, errs[-1])
    return max(errs)


class TEDotProductAttention(torch.nn.Module):
    """Transformer Engine's ``DotProductAttention`` as Megatron's layer and the tiled sublayer call it, in torch
    (TE needs CUDA): sbhd operands, the mask type at each call (``causal_bottom_right`` aligns the queries to the
    last key), grouped K/V heads checked against ``num_gqa_groups_per_partition`` as TE's forward checks them, and
    the output [sq, b, heads x head_dim]. ``calls``: the K/V heads of each call."""

    te_forward_mask_type = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_gqa_groups_per_partition, self.cp_group, self.calls = groups, None, []

    def forward(self, q, k, v, attention_mask, attn_mask_type, attention_bias=None,  # noqa: ANN001, ANN201
                packed_seq_params=None):
        assert attention_mask is None and attention_bias is None and packed_seq_params is None
        groups = self.num_gqa_groups_per_partition
        assert k.shape[2] == v.shape[2] == groups, (k.shape, groups)
        assert attn_mask_type.name in ("causal", "causal_bottom_right"), attn_mask_type
        self.calls.append(k.shape[2])
        L, S = q.shape[0], k.shape[0]
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        repeats = qb.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(repeats, dim=1), vb.repeat_interleave(repeats, dim=1)
        mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
        return out.permute(2, 0, 1, 3).reshape(L, q.shape[1], -1)


def _case(rank: int, world: int, name: str, *, experts: int, tile: int, others: dict | None = None,
          attention: str = "sdpa", mask: bool = False, expect_tiled: bool = True, tp: int = 1,
          per_kv_head: bool = False, te_core: bool = False, **config_over) -> tuple[str, float]:
    """One model, built with the components of ``others`` on; its loss and gradients with the tile off, then on.
    ``per_kv_head``: grouped heads run as one call per K/V head at every length (the SDPA attention's own split;
    with ``te_core``, the tiled sublayer's split of ``TEDotProductAttention``, which each layer's core attention
    then is)."""
    import megatron_peakflat
    from megatron_peakflat.attention import calls as attention_calls
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron_peakflat.tile.config import TileConfig
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    megatron_peakflat.remove()
    mc.init_megatron_parallel(tp=tp, ep=world // tp, seed=1234)
    over = dict(num_moe_experts=experts, num_attention_heads=8, num_query_groups=2, recompute_granularity="full",
                recompute_method="uniform", recompute_num_layers=1)
    if experts:
        over.update(moe_router_topk=1, moe_router_pre_softmax=True)
    over.update(config_over)
    config = mc.tiny_transformer_config(**over)
    others = dict(others or {})
    general = GeneralConfig(attention=attention)
    megatron_peakflat.apply(PeakflatConfig(general=general, **others))
    torch.manual_seed(99)
    model = mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, moe=experts is not None)
    if experts:
        mc.skew_router(model, "all", seed=5 + rank)  # every token on expert 1 (top-1): other ranks get none
    cores = []
    if te_core:
        for layer in model.decoder.layers:
            cores.append(TEDotProductAttention(config.num_query_groups // tp))
            layer.self_attention.core_attention = cores[-1]
    batch = _batch(11 + rank)
    if mask:
        batch["attention_mask"] = mc.gpt_batch(SEQ, MB, VOCAB)["attention_mask"]
    threshold = attention_calls.GROUPED_CALL_MIN_KEYS
    if per_kv_head:
        attention_calls.GROUPED_CALL_MIN_KEYS = 1
    try:
        ref = _loss_and_grads(model, batch)
        megatron_peakflat.apply(PeakflatConfig(general=general, tile=TileConfig(enabled=True, tokens=tile), **others))
        stats.reset()
        got = _loss_and_grads(model, batch)
        snap = stats.snapshot().get("tile", {})
    finally:
        megatron_peakflat.remove()
        attention_calls.GROUPED_CALL_MIN_KEYS = threshold
    # each layer's sublayer runs in the forward and, under full recompute, in the checkpoint's recompute
    calls = (config.num_layers + (config.mtp_num_layers or 0)) * (2 if config.recompute_granularity else 1)
    if expect_tiled:
        assert snap.get("tiled_calls") == calls and "untiled_calls" not in snap, (name, snap)
        assert snap.get("tile_tokens") == min(tile, SEQ), (name, snap)
    else:
        assert snap.get("untiled_calls") == calls and "tiled_calls" not in snap, (name, snap)
    if te_core:
        groups = config.num_query_groups // tp
        split = per_kv_head and groups < config.num_attention_heads // tp
        assert (snap.get("te_kv_head_calls", 0) > 0) == split, (name, snap)
        for core in cores:  # the untiled layer's calls take every K/V head; the tiled sublayer's one each if split
            n_ref = 2 if config.recompute_granularity else 1
            assert core.calls[:n_ref] == [groups] * n_ref and len(core.calls) > n_ref, (name, core.calls)
            assert set(core.calls[n_ref:]) == ({1} if split else {groups}), (name, core.calls)
    return name, _compare(f"{name} rank {rank}", got, ref)


def _ddp_case(rank: int, world: int) -> tuple[str, float]:
    """Megatron DDP with overlapped gradient reduction in small buckets, full recompute, 2 iterations: each
    parameter's gradient reaches DDP's hook once per step (a second arrival fails in Megatron's bucket), and
    main_grad after finish_grad_sync matches the untiled model's."""
    import megatron_peakflat
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron_peakflat.tile.config import TileConfig
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    megatron_peakflat.remove()
    mc.init_megatron_parallel(ep=world, seed=1234)
    config = mc.tiny_transformer_config(num_moe_experts=4, num_attention_heads=8, num_query_groups=2,
                                        recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=1)
    off = PeakflatConfig(general=GeneralConfig(attention="sdpa"))
    on = PeakflatConfig(general=GeneralConfig(attention="sdpa"), tile=TileConfig(enabled=True, tokens=5))
    megatron_peakflat.apply(off)
    try:
        torch.manual_seed(3)
        inner = [mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ) for _ in range(2)]
        inner[1].load_state_dict(inner[0].state_dict())
        ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True, bucket_size=4000)
        models = [DistributedDataParallel(config, ddp_cfg, m) for m in inner]
        assert len(models[1].buffers[0].buckets) > 3
        worst = 0.0
        for it in range(2):
            batch = _batch(40 + it + rank)
            grads = []
            for m, cfg in zip(models, (off, on)):
                megatron_peakflat.apply(cfg)
                grads.append(mc.ddp_main_grads(m, batch))
            for n, g in grads[0].items():
                e = max_rel_error(grads[1][n], g)
                assert e <= 1e-5, ("ddp", it, n, e)
                worst = max(worst, e)
    finally:
        megatron_peakflat.remove()
    return "ddp-overlap,full-recompute", worst


def _sdpa_bottom_right(rank: int) -> tuple[str, float]:
    """SDPAttention with ``causal_bottom_right``: the last t queries over all keys as in the whole causal
    attention, for t < L, and plain causal at t = L."""
    import megatron_peakflat
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron.core.transformer.enums import AttnMaskType

    mc.init_megatron_parallel(seed=1234)
    megatron_peakflat.apply(PeakflatConfig(general=GeneralConfig(attention="sdpa")))
    try:
        config = mc.tiny_transformer_config(num_moe_experts=None, num_attention_heads=8, num_query_groups=2)
        model = mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, moe=False)
        core = model.decoder.layers[0].self_attention.core_attention
        assert type(core).__name__ == "SDPAttention"
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(13, 2, 8, 8, generator=g, requires_grad=True)
        k, v = torch.randn(13, 2, 2, 8, generator=g), torch.randn(13, 2, 2, 8, generator=g)
        whole = core(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        worst = 0.0
        for t in (1, 5, 13):
            part = core(q[-t:], k, v, None, attn_mask_type=AttnMaskType.causal_bottom_right)
            worst = max(worst, max_rel_error(part, whole[-t:]))
        top_left = core(q[-5:], k[:5], v[:5], None, attn_mask_type=AttnMaskType.causal)  # a wrong alignment differs
        assert max_rel_error(top_left, whole[-5:]) > 1e-2
    finally:
        megatron_peakflat.remove()
    assert worst < 1e-6, worst
    return "sdpa-bottom-right", worst


def _worker(rank: int, world: int) -> list[tuple[str, float]]:
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.sco.config import SCOConfig
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron_peakflat.vocab.config import VocabConfig

    mc.install_cpu_shim()
    others = dict(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=8, min_spill=0, imbalance_threshold=1.05),
                  vocab=VocabConfig(impl="ring-dtp", block_size=16), sco=SCOConfig(enabled=True))
    out = []
    if world == 1:
        out.append(_sdpa_bottom_right(rank))
        out.append(_case(rank, world, "gqa4,tile5", experts=4, tile=5))
        out.append(_case(rank, world, "gqa4,tile5,per-kv-head", experts=4, tile=5, per_kv_head=True))
        out.append(_case(rank, world, "gqa4,tile5,te,per-kv-head", experts=4, tile=5, per_kv_head=True,
                         te_core=True))
        out.append(_case(rank, world, "gqa4,tile5,te,one-call", experts=4, tile=5, te_core=True))
        out.append(_case(rank, world, "tile1,mha", experts=4, tile=1, num_query_groups=8, num_layers=1))
        out.append(_case(rank, world, "all-components,tile7", experts=4, tile=7, others=others))
        out.append(_case(rank, world, "mtp,tile8", experts=4, tile=8, mtp_num_layers=1, mtp_loss_scaling_factor=0.3))
        out.append(_case(rank, world, "explicit-mask,handed-back", experts=4, tile=5, mask=True, expect_tiled=False))
        # (without recompute: Megatron's own causal mask is built on 'cuda', which the CPU shim misses in a
        # checkpoint's recompute)
        out.append(_case(rank, world, "local-attention,handed-back", experts=4, tile=5, attention="local",
                         expect_tiled=False, recompute_granularity=None, recompute_method=None,
                         recompute_num_layers=None))
    elif world == 2:
        out.append(_case(rank, world, "ep2,gqa4,tile5", experts=4, tile=5))
        out.append(_case(rank, world, "ep2,gqa4,tile5,per-kv-head", experts=4, tile=5, per_kv_head=True))
        out.append(_case(rank, world, "ep2,gqa4,tile5,te,per-kv-head", experts=4, tile=5, per_kv_head=True,
                         te_core=True))
        out.append(_case(rank, world, "ep2,all-components,tile9", experts=4, tile=9, others=others))
        out.append(_ddp_case(rank, world))
        # TP=2 without sequence parallelism: heads split over the ranks, the output projection reduced per tile
        out.append(_case(rank, world, "tp2,gqa4,tile7", experts=None, tile=7, tp=2, sequence_parallel=False,
                         num_layers=1))
    else:
        out.append(_case(rank, world, "ep3,3-experts,tile5", experts=3, tile=5))
        out.append(_case(rank, world, "ep3,3-experts,tile4,te,per-kv-head", experts=3, tile=4, per_kv_head=True,
                         te_core=True))
        out.append(_case(rank, world, "ep3,6-experts,tile7", experts=6, tile=7))
    mc.destroy_megatron_parallel()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tiled_layer_matches_megatron(world: int) -> None:
    out = run_distributed(_worker, world, timeout=240)
    assert all(len(o) == len(out[0]) > 0 for o in out)


@needs_pretrain_entry
def test_pretrain_same_losses_with_the_tile_on():
    """Through Megatron's own pretrain loop (CPU dry run, local spec with the SDPA core attention, full recompute,
    MoE): three iterations with ``--peakflat-tile`` on (tiles of 7 of 32 tokens) give the losses and grad norms
    of the run with it off; with the dataloader's mask left on, start-up refuses, naming the fix."""
    from megatron_peakflat.testing.subproc import MODEL_BUILT, TINY_GPT_ARGS, logged, run_module

    args = [*TINY_GPT_ARGS, "--train-iters", "3", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--transformer-impl", "local", "--peakflat-attention", "sdpa", "--seed", "1234"]
    tile = ["--peakflat-tile", "--peakflat-tile-tokens", "7"]
    refused = run_module("megatron_peakflat.testing.pretrain_dryrun", *args, *tile)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0 and MODEL_BUILT not in text
    assert "--peakflat-tile=True" in text and "--no-create-attention-mask-in-dataloader" in text, text[-3000:]
    runs = []
    for extra in ([], tile):
        out = run_module("megatron_peakflat.testing.pretrain_dryrun", *args, *extra,
                         "--no-create-attention-mask-in-dataloader")
        runs.append(out.stdout + out.stderr)
        assert out.returncode == 0, runs[-1][-3000:]
    off, on = runs
    assert "attention sublayer over tiles of 7 of 32 tokens" in on and "runs where" not in on
    assert len(logged(off, "lm loss")) == 3
    assert logged(on, "lm loss") == pytest.approx(logged(off, "lm loss"), rel=1e-5)
    assert logged(on, "grad norm") == pytest.approx(logged(off, "grad norm"), rel=1e-4)
