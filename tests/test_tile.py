"""The tiled attention sublayer (``tile.TiledSelfAttention``) against a plain-PyTorch sublayer run whole: the
output, dx and every parameter's gradient on odd shapes (sequence not a multiple of the tile, tile 1, tile
longer than the sequence, GQA ratios 1, 4 and 8, batch 2); one tile over the sequence equals the whole layer bit
for bit; bottom-right causal alignment; each parameter's gradient arrives once; and the live-bytes bound
(``tile.bound``) holds, with a working set that stops growing with the number of tiles."""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing.live_bytes import LiveBytesMeter
from megatron_peakflat.tile.api import tiled_self_attention
from megatron_peakflat.tile.attention import TiledSelfAttention
from megatron_peakflat.tile.ops import TileOps, tile_starts
from megatron_peakflat.tile.bound import (AUTO_MAX_TILE, AUTO_MIN_TILE, auto_tile_tokens,
                                            tiled_attention_peak_bytes, tiled_attention_terms)
from megatron_peakflat.tile.reference import ReferenceAttentionLayer, causal_attention
from megatron_peakflat.testing.flash_double import FlashDouble, workspace_bytes

H, D = 24, 6


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _run(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, tile: int | None, ops: TileOps | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    if tile is None:
        y = layer(x)
    else:
        y = tiled_self_attention(x, ops or layer.ops(), tile, list(layer.parameters()))
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("seq,batch,q_heads,kv_heads,tile", [
    (13, 2, 4, 1, 5),    # GQA 4, last tile shorter
    (13, 2, 4, 4, 1),    # MHA (ratio 1), tile of one token
    (11, 1, 8, 1, 4),    # GQA 8
    (13, 2, 8, 1, 20),   # tile longer than the sequence
    (17, 2, 8, 2, 3),    # GQA 4, many tiles, odd sequence
])
def test_matches_whole_layer(seq, batch, q_heads, kv_heads, tile):
    layer = ReferenceAttentionLayer(H, q_heads, kv_heads, D, seq, seed=seq + tile)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(seq, batch, H, generator=g)
    dy = torch.randn(seq, batch, H, generator=g)
    ref = _run(layer, x, dy, None)
    got = _run(layer, x, dy, tile)
    assert _rel(got[0], ref[0]) < 1e-6
    assert _rel(got[1], ref[1]) < 1e-6
    assert got[2].keys() == ref[2].keys() and len(ref[2]) == 5
    for name in ref[2]:
        assert _rel(got[2][name], ref[2][name]) < 1e-6, name


def test_one_tile_is_the_whole_layer_bit_for_bit():
    """With a tile covering the sequence it is a checkpointed sublayer: the same numbers, not merely close."""
    layer = ReferenceAttentionLayer(H, 8, 2, D, 13, seed=5)
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(13, 2, H, generator=g), torch.randn(13, 2, H, generator=g)
    ref = _run(layer, x, dy, None)
    for tile in (13, 64):
        got = _run(layer, x, dy, tile)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        for name in ref[2]:
            assert torch.equal(got[2][name], ref[2][name]), name


def test_a_wrong_schedule_is_caught():
    """The comparison above can fail: K and V rows from the wrong positions (RoPE of tile 0 for every tile)
    change the output."""
    layer = ReferenceAttentionLayer(H, 4, 2, D, 12, seed=6)
    x, dy = torch.randn(12, 2, H), torch.randn(12, 2, H)
    ref = _run(layer, x, dy, None)
    wrong = TileOps(qkv=lambda x_t, start: layer.qkv(x_t, 0), attend=layer.attend, project=layer.project)
    got = _run(layer, x, dy, 4, wrong)
    assert _rel(got[0], ref[0]) > 1e-3


def test_bottom_right_alignment():
    """The last t queries against all L keys see what they see in the whole causal attention."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(11, 2, 8, 16, generator=g)
    k, v = torch.randn(11, 2, 2, 16, generator=g), torch.randn(11, 2, 2, 16, generator=g)
    whole = causal_attention(q, k, v)
    for t in (1, 4, 11):
        assert torch.allclose(causal_attention(q[-t:], k, v), whole[-t:], atol=1e-6, rtol=1e-6)
    # aligned top left instead, query 0 of the tile would see key 0 only
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q[-4:].permute(1, 2, 0, 3), k.permute(1, 2, 0, 3).repeat_interleave(4, 1),
        v.permute(1, 2, 0, 3).repeat_interleave(4, 1), attn_mask=torch.ones(4, 11, dtype=torch.bool).tril())
    assert not torch.allclose(top_left.permute(2, 0, 1, 3).reshape(4, 2, -1), whole[-4:], atol=1e-3)


def test_each_parameter_gradient_arrives_once():
    """Backward returns each parameter's gradient (summed over the tiles) once: one AccumulateGrad call per
    parameter, as DDP's gradient hooks with overlapped reduction require."""
    layer = ReferenceAttentionLayer(H, 4, 2, D, 13, seed=8)
    calls: dict[str, int] = {}
    nodes = []  # kept, as DDP keeps them: an accumulator node nobody holds is dropped with its hooks
    for name, p in layer.named_parameters():
        node = p.view_as(p).grad_fn.next_functions[0][0]
        nodes.append(node)
        node.register_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    x = torch.randn(13, 2, H, requires_grad=True)
    tiled_self_attention(x, layer.ops(), 3, list(layer.parameters())).sum().backward()
    assert calls == {name: 1 for name, _ in layer.named_parameters()}


def test_fused_weight_gradient_placeholder_is_passed_on():
    """A parameter whose gradient the op writes into ``main_grad`` itself (``grad_added_to_main_grad``, as
    Megatron's fused weight-gradient accumulation does) gets the op's placeholder back, not a sum of them."""
    layer = ReferenceAttentionLayer(H, 4, 2, D, 10, seed=9)
    w = layer.w_o
    w.main_grad = torch.zeros_like(w)
    w.grad_added_to_main_grad = True
    placeholders: list[torch.Tensor] = []

    class FusedWgrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, o, weight):  # noqa: ANN001, ANN205
            ctx.save_for_backward(o)
            return o @ weight.detach().t()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            (o,) = ctx.saved_tensors
            w.main_grad += g.reshape(-1, g.shape[-1]).t() @ o.reshape(-1, o.shape[-1])
            placeholders.append(torch.full_like(w, len(placeholders) + 1.0))  # a sum would differ
            return g @ w.detach(), placeholders[-1]

    def project(o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + FusedWgrad.apply(o, w) + layer.b_o

    ops = TileOps(qkv=layer.qkv, attend=layer.attend, project=project)
    x = torch.randn(10, 2, H)
    dy = torch.randn(10, 2, H)
    _run(layer, x, dy, 4, ops)
    assert len(placeholders) == 3 and torch.equal(w.grad, placeholders[-1])
    del w.grad_added_to_main_grad
    ref = _run(layer, x, dy, None)
    assert _rel(w.main_grad, ref[2]["w_o"]) < 1e-6


def test_tile_starts_and_bad_tile():
    assert tile_starts(13, 5) == [0, 5, 10] and tile_starts(4, 9) == [0]
    layer = ReferenceAttentionLayer(H, 4, 2, D, 8)
    with pytest.raises(ValueError, match="at least 1 token"):
        tiled_self_attention(torch.randn(8, 1, H), layer.ops(), 0, list(layer.parameters()))


def test_shared_parameter_is_one_input():
    layer = ReferenceAttentionLayer(H, 4, 2, D, 8, seed=10)
    x, dy = torch.randn(8, 2, H), torch.randn(8, 2, H)
    ref = _run(layer, x, dy, None)
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    tiled_self_attention(xg, layer.ops(), 3, list(layer.parameters()) * 2).backward(dy)
    assert _rel(layer.w_qkv.grad, ref[2]["w_qkv"]) < 1e-6


def _measured_peak(seq: int, tile: int, dtype: torch.dtype, batch: int = 2, q_heads: int = 8, kv_heads: int = 2,
                   head_dim: int = 16, hidden: int = 64, block: int = 8) -> int:
    """Peak live bytes of one forward and backward of the tiled sublayer (with the flash-class double)."""
    layer = ReferenceAttentionLayer(hidden, q_heads, kv_heads, head_dim, seq, dtype=dtype, seed=1)
    ops = TileOps(qkv=layer.qkv, attend=lambda q, k, v: FlashDouble.apply(q, k, v, block), project=layer.project)
    x = torch.randn(seq, batch, hidden, dtype=dtype, requires_grad=True)
    dy = torch.randn(seq, batch, hidden, dtype=dtype)
    with LiveBytesMeter() as meter:
        y = TiledSelfAttention.apply(x, ops, tile, *layer.parameters())
        y.backward(dy)
        del y
    return meter.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_live_bytes_bound(dtype):
    """Measured with a flash-class attention (keys in blocks, no [t, L] scores): the bound holds at every
    sequence length, and the measured peak less the bound's whole-sequence terms stays the same from 4 tiles to
    16 tiles (the working set grows with the sequence only through K, V, their gradients and dx); the whole layer in
    one tile needs more."""
    e = torch.finfo(dtype).bits // 8
    T, b, nq, nkv, d, h, block = 16, 2, 8, 2, 16, 64, 16
    above_whole, peaks = {}, {}
    for seq in (4 * T, 8 * T, 16 * T):
        peaks[seq] = peak = _measured_peak(seq, T, dtype, block=block)
        terms = tiled_attention_terms(T, seq, b, h, nq, nkv, d, e,
                                      attention_workspace_bytes=workspace_bytes(T, b, nq, d, block, e))
        assert peak <= terms.total, (seq, peak, terms.total)
        assert terms.total == tiled_attention_peak_bytes(T, seq, b, h, nq, nkv, d, e,
                                                         attention_workspace_bytes=workspace_bytes(T, b, nq, d,
                                                                                                   block, e))
        above_whole[seq] = peak - terms.whole_bytes
        assert 0 < above_whole[seq] <= terms.tile_bytes
    assert max(above_whole.values()) - min(above_whole.values()) <= 0.02 * above_whole[4 * T], above_whole
    assert _measured_peak(16 * T, 16 * T, dtype, block=block) > peaks[16 * T] + 4 * above_whole[4 * T]


def test_bound_terms_scale():
    """Whole-sequence terms scale with the sequence and not the tile; tile terms the other way round."""
    a = tiled_attention_terms(4096, 2**20, 1, 2880, 64, 8, 64, 2)
    b = tiled_attention_terms(4096, 2**19, 1, 2880, 64, 8, 64, 2)
    c = tiled_attention_terms(8192, 2**20, 1, 2880, 64, 8, 64, 2)
    assert a.tile == b.tile and a.whole == c.whole
    assert a.whole["K and V"] == 2 * b.whole["K and V"] == 2 * 2**20 * 8 * 64 * 2
    assert c.tile["mixed QKV"] == 2 * a.tile["mixed QKV"] == 2 * 4096 * (64 + 16) * 64 * 2
    with pytest.raises(ValueError, match="tile must be at least 1"):
        tiled_attention_peak_bytes(0, 16, 1, 8, 2, 1, 4, 2)


def test_auto_tile_tokens():
    assert auto_tile_tokens(100) == 100 and auto_tile_tokens(AUTO_MIN_TILE) == AUTO_MIN_TILE
    assert auto_tile_tokens(8192) == 4096  # seq/4 = 2048 is below the floor
    assert auto_tile_tokens(40000) == 8192  # a quarter is 10000: 8192 below it
    assert auto_tile_tokens(65536) == auto_tile_tokens(2**20) == AUTO_MAX_TILE == 16384
    with pytest.raises(ValueError):
        auto_tile_tokens(0)


def test_peak_report_region():
    """With the peak report on, forward and backward are measured as the region 'tile' (here on the live-bytes
    meter as the allocator): two calls, the larger (backward) within the bound."""
    from megatron_peakflat.runtime import meter as peak_meter

    T, seq, b, nq, nkv, d, h, block = 16, 64, 2, 8, 2, 16, 64, 16
    layer = ReferenceAttentionLayer(h, nq, nkv, d, seq, seed=2)
    ops = TileOps(qkv=layer.qkv, attend=lambda q, k, v: FlashDouble.apply(q, k, v, block), project=layer.project)
    x = torch.randn(seq, b, h, requires_grad=True)
    dy = torch.randn(seq, b, h)
    with LiveBytesMeter() as live:
        peak_meter.set_backend(lambda: live.live, lambda: live.peak, live.reset_peak)
        peak_meter.enable(True)
        peak_meter.reset()
        try:
            TiledSelfAttention.apply(x, ops, T, *layer.parameters()).backward(dy)
            got = peak_meter.measured()
        finally:
            peak_meter.enable(False)
            peak_meter.set_backend(None)
            peak_meter.reset()
    assert set(got) == {"tile"} and got["tile"].calls == 2
    bound = tiled_attention_peak_bytes(T, seq, b, h, nq, nkv, d, 4,
                                       attention_workspace_bytes=workspace_bytes(T, b, nq, d, block, 4))
    assert 0 < got["tile"].delta <= bound
