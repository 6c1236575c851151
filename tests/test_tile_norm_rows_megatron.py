"""The whole-sequence norms in row slices inside Megatron-Core (CPU, gloo, fp32), ``integration.norm_rows``.

Megatron's GPTModel on the local spec (SDPA core attention, MoE, GQA, RoPE, full recompute, an MTP layer), with
``--peakflat-tile`` on and a forced limit of a few rows (``norm_rows.forced_max_rows``): the pre-MLP norms, the
final norm and MTP's norms run in slices that do not divide the sequence, and the loss and every parameter's
gradient equal those of the same model with the tile on and no slicing, and of unpatched Megatron.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing import run_distributed
from tests.test_tile_megatron import MB, SEQ, VOCAB, _batch, _loss_and_grads


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max()) / max(float(ref.double().abs().max()), 1e-30)


def _worker(rank: int, world: int, forced: int, mtp: int) -> dict:
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.integration import norm_rows
    from megatron_peakflat.testing import megatron_cpu as mc
    from megatron_peakflat.tile.config import TileConfig
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    mc.install_cpu_shim()
    destroy_moe_metrics_tracker()
    megatron_peakflat.remove()
    mc.init_megatron_parallel(ep=world, seed=1234)
    config = mc.tiny_transformer_config(num_moe_experts=4, num_attention_heads=8, num_query_groups=2,
                                        recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=1, moe_router_topk=1, moe_router_pre_softmax=True,
                                        **(dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3) if mtp else {}))
    general = GeneralConfig(attention="sdpa")
    megatron_peakflat.apply(PeakflatConfig(general=general))
    torch.manual_seed(99)
    model = mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, moe=True)
    batch = _batch(11 + rank)
    seen: list[tuple[str, int, int]] = []
    real = norm_rows.row_sliced

    def spy(fn, x, most):  # noqa: ANN001
        seen.append((type(fn.__self__).__name__, x.shape[0] * x.shape[1], most))
        return real(fn, x, most)

    norm_rows.row_sliced = spy
    try:
        megatron_peakflat.remove()
        unpatched = _loss_and_grads(model, batch)
        megatron_peakflat.apply(PeakflatConfig(general=general, tile=TileConfig(enabled=True, tokens=5)))
        whole = _loss_and_grads(model, batch)
        assert not seen, seen  # no limit on the local spec's norms: nothing sliced
        stats.reset()
        with norm_rows.forced_max_rows(forced):
            sliced = _loss_and_grads(model, batch)
        calls = stats.snapshot().get("tile", {}).get("sliced_norm_calls", 0)
    finally:
        norm_rows.row_sliced = real
        megatron_peakflat.remove()
    errs = {}
    for what, ref in (("whole", whole), ("unpatched", unpatched)):
        assert sliced[1].keys() == ref[1].keys() and len(ref[1]) > 10
        errs[what] = max([_rel(sliced[0], ref[0])] + [_rel(sliced[1][n], ref[1][n]) for n in ref[1]])
    mc.destroy_megatron_parallel()
    return dict(errs=errs, calls=calls, seen=seen, layers=config.num_layers)


@pytest.mark.parametrize("world,forced,mtp", [(1, 5, 1), (1, 2, 0), (2, 7, 0)])
def test_sliced_norms_match_megatron(world: int, forced: int, mtp: int) -> None:
    """Slices of 2 positions x micro-batch 2 (forced 5 rows, 24 positions: 12 slices), of 1 position (forced 2),
    of 3 positions (forced 7: 8 slices); at world 2, EP 2."""
    for out in run_distributed(_worker, world, forced, mtp, timeout=240):
        assert out["errs"]["whole"] <= 1e-6 and out["errs"]["unpatched"] <= 1e-6, out["errs"]
        rows = SEQ * MB
        assert out["seen"] and all(r == rows and most == forced for _, r, most in out["seen"]), out["seen"]
        # each layer's pre-MLP norm in the forward and in its checkpoint's recompute, and the final norm; with
        # MTP also its embedding, hidden and final norms and its layer's pre-MLP norm (some of them recomputed)
        assert out["calls"] == len(out["seen"]), out
        if mtp:
            assert out["calls"] >= 2 * out["layers"] + 1 + 4, out
        else:
            assert out["calls"] == 2 * out["layers"] + 1, out


def test_forced_max_rows_only_slices_past_it():
    from megatron_peakflat.integration import norm_rows

    norm, x = torch.nn.LayerNorm(4), torch.randn(3, 2, 4)
    with norm_rows.forced_max_rows(6):
        assert norm_rows.max_rows(norm, x) is None
    with norm_rows.forced_max_rows(5):
        assert norm_rows.max_rows(norm, x) == 5
    assert norm_rows.max_rows(norm, x) is None  # not Transformer Engine's: no limit
