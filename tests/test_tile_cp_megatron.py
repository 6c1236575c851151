"""The tiled attention sublayer under context parallelism inside Megatron-Core (CPU, gloo): exact against Megatron
at the same CP size.

Megatron's GPTModel on the local spec with the SDPA core attention (Megatron's local spec runs CP only through it:
K and V all-gathered, ``attention.context_parallel``), MoE with top-1 routing and every token on expert 1, grouped
K/V heads (GQA 4), RoPE at the tokens' positions in the sequence (Megatron's rotary table cut to the rank's chunks),
causal attention without a mask, full recompute; each rank fed chunks r and 2CP-1-r of the batch. The loss and
every parameter's gradient on every rank with ``--peakflat-tile`` on (tiles that do not divide a chunk) against the
same model with it off: at CP 2 and CP 3, with PipelinedLLEP on in both runs, with PipelinedLLEP, Ring-DTP and SCO
on (CP 2 and CP 3), and CP 2 x EP 2 (the experts spread over the CP ranks). And ``tests/_cp_driver.py`` (which the
two-GPU test runs) with the tile on, against Megatron at CP 1 on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing import run_distributed
from tests.test_tile_megatron import _compare, _loss_and_grads

MB, VOCAB = 2, 64


def _batch(seq: int, cp: int, rank: int, seed: int) -> dict:
    """This CP rank's share of a batch (chunks r and 2CP-1-r), no attention mask."""
    from megatron_peakflat.attention.context_parallel import split_sequence
    from megatron_peakflat.testing import megatron_cpu as mc

    b = mc.gpt_batch(seq, MB, VOCAB, seed=seed)
    out = {k: split_sequence(b[k], cp, rank, dim=1) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    out["attention_mask"] = None
    return out


def _case(rank: int, world: int, name: str, *, seq: int, tile: int, ep: int = 1, others: dict | None = None
          ) -> tuple[str, float]:
    """One model at CP ``world``, built with the components of ``others`` on; its loss and gradients on this rank
    with the tile off (Megatron's layers, the SDPA core attention's CP), then on."""
    import megatron_peakflat
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron_peakflat.tile.config import TileConfig

    destroy_moe_metrics_tracker()
    megatron_peakflat.remove()
    mc.init_megatron_parallel(ep=ep, context_parallel_size=world, seed=1234)
    config = mc.tiny_transformer_config(num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True,
                                        num_attention_heads=8, num_query_groups=2, context_parallel_size=world,
                                        **mc.recompute_config("full"))
    general = GeneralConfig(attention="sdpa")
    others = dict(others or {})
    megatron_peakflat.apply(PeakflatConfig(general=general, **others))
    try:
        torch.manual_seed(99)
        model = mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=seq)
        mc.skew_router(model, "all", seed=5)  # every token on expert 1
        cp_rank = parallel_state.get_context_parallel_rank()
        assert parallel_state.get_context_parallel_world_size() == world
        assert parallel_state.get_expert_model_parallel_world_size() == ep
        batch = _batch(seq, world, cp_rank, seed=11)
        core = model.decoder.layers[0].self_attention.core_attention
        assert type(core).__name__ == "SDPAttention" and core.cp_group is not None
        ref = _loss_and_grads(model, batch)
        megatron_peakflat.apply(PeakflatConfig(general=general, tile=TileConfig(enabled=True, tokens=tile), **others))
        stats.reset()
        got = _loss_and_grads(model, batch)
        snap = stats.snapshot().get("tile", {})
        assert core.cp_group is not None  # given back after each call
    finally:
        megatron_peakflat.remove()
    # each layer's sublayer runs in the forward and in the checkpoint's recompute
    assert snap.get("tiled_calls") == 2 * config.num_layers and "untiled_calls" not in snap, (name, snap)
    assert snap.get("tile_tokens") == min(tile, seq // (2 * world)), (name, snap)
    return name, _compare(f"{name} rank {rank}", got, ref)


def _worker(rank: int, world: int) -> list[tuple[str, float]]:
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.sco.config import SCOConfig
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron_peakflat.vocab.config import VocabConfig

    mc.install_cpu_shim()
    llep = dict(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=8, min_spill=0, imbalance_threshold=1.05))
    every = dict(llep, vocab=VocabConfig(impl="ring-dtp", block_size=16), sco=SCOConfig(enabled=True))
    out = []
    if world == 2:  # chunks of 6 tokens
        out.append(_case(rank, world, "cp2,llep,tile4", seq=24, tile=4, others=llep))
        out.append(_case(rank, world, "cp2xep2,all-components,tile5", seq=24, tile=5, ep=2, others=every))
    else:  # chunks of 4 tokens
        out.append(_case(rank, world, "cp3,llep,tile3", seq=24, tile=3, others=llep))
        out.append(_case(rank, world, "cp3,all-components,tile1", seq=24, tile=1, others=every))
    mc.destroy_megatron_parallel()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_cp_tiled_layer_matches_megatron_at_the_same_cp(world: int) -> None:
    out = run_distributed(_worker, world, timeout=300)
    assert len(out) == world and all(len(o) == len(out[0]) == 2 for o in out), out


def test_the_cp2_driver_runs_the_tile_on_two_gloo_ranks():
    """``tests/_cp_driver.py`` with the tile on, as ``tests/gpu/test_tile_cp_gpu.py`` runs it on two GPUs, here on
    CPU: every component and tiles of 3 (chunks of 4 tokens) at CP 2 against Megatron at CP 1 on the whole
    sequence, fp32: the loss, every reduced gradient and every parameter after the optimizer step within 1e-5."""
    from tests import _cp_driver as driver

    cases = [driver.Case("fp32-local-tile3", tile=3)]
    results = run_distributed(driver.rank_main, 2, cases, True, timeout=600)
    driver.check(results, cases)
