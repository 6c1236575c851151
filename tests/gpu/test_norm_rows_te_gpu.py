"""Transformer Engine's RMSNorm in row slices (``--peakflat-tile``'s sliced whole-sequence norms, one GPU): under a
forced limit of a few hundred rows (``norm_rows.forced_max_rows``), the norm's output, dx and weight gradient
against the same TE RMSNorm unsliced, on [s, b, h] with slices that do not divide s. fp32 within 1e-5 relative
(the weight gradient sums over the slices in another order); bf16 within one bf16 epsilon (2^-8) relative (TE
may launch its kernels otherwise for fewer rows). A sliced path that dropped or misplaced a slice is off by O(1).
CPU: skipped.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.integration.attention import transformer_engine_available

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Transformer Engine's norms; "
                                 "tests/test_tile_norm_rows_megatron.py runs the local spec's on CPU)"),
              pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine")]


def _run(norm, x, dy, forced):  # noqa: ANN001
    import megatron_peakflat
    from megatron_peakflat.config import PeakflatConfig
    from megatron_peakflat.integration import norm_rows
    from megatron_peakflat.tile.config import TileConfig

    norm.weight.grad = None
    x = x.detach().clone().requires_grad_(True)
    megatron_peakflat.apply(PeakflatConfig(tile=TileConfig(enabled=True)))
    try:
        norm_rows.slice_norm(norm, "test norm")
        if forced is None:
            y = norm(x)
        else:
            with norm_rows.forced_max_rows(forced):
                y = norm(x)
    finally:
        megatron_peakflat.remove()
    y.backward(dy)
    return y.detach().float(), x.grad.float(), norm.weight.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_te_rmsnorm_in_row_slices_matches_unsliced(dtype):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    s, b, h = 1000, 2, 2880
    norm = te.RMSNorm(h, eps=1e-5, params_dtype=dtype, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, device="cuda", dtype=dtype))
    x = (torch.randn(s, b, h, device="cuda") * 3 + 1).to(dtype)
    dy = torch.randn(s, b, h, device="cuda").to(dtype)
    ref = _run(norm, x, dy, None)
    got = _run(norm, x, dy, 2 * 333 + 1)  # slices of 333 positions (666 rows): 4 slices, the last of one position
    names = ("output", "dx", "weight grad")
    for name, g, r in zip(names, got, ref):
        err = float((g - r).abs().max()) / max(float(r.abs().max()), 1e-30)
        tol = 1e-5 if dtype == torch.float32 else 2**-8
        assert err <= tol, (name, err)
