"""The tiled attention sublayer under context parallelism (``tile.context_parallel``), plain PyTorch on gloo ranks:
each rank holds chunks r and 2CP-1-r of the sequence, as Megatron's load-balanced layout cuts it.

Against the plain-PyTorch sublayer run whole on the whole sequence (``tile.reference``): each rank's output and
dx equal the whole run's rows of that rank, and every parameter's gradient summed over the ranks equals the
whole run's, at CP 2 and CP 3, GQA ratios 1, 2 and 4, tiles that do not divide a chunk, tile 1 and a tile longer
than a chunk. A rotary table of the wrong positions is caught. The live-bytes bound (``tile.bound`` with ``cp``)
holds on every rank, and on rank 0 (which holds the last chunk) the working set above its whole-sequence terms stays
the same from 2 to 4 tiles a chunk.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing import run_distributed

H, D = 24, 6
CASES = [  # (chunk tokens c, micro-batch, query heads, key/value heads, tile)
    (5, 2, 4, 1, 2),    # GQA 4, a chunk of 5 in tiles of 2, 2, 1
    (4, 2, 4, 4, 1),    # MHA, tiles of one token
    (3, 1, 8, 4, 9),    # GQA 2, a tile longer than a chunk (one tile per chunk)
    (6, 2, 8, 2, 4),    # GQA 4, tiles of 4 and 2
]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _errors(rank: int, world: int, c: int, b: int, nq: int, nkv: int, tile: int, wrong_positions: bool = False
            ) -> dict[str, float]:
    """Relative errors of this rank's tiled CP run against the whole layer: output, dx, each parameter (summed)."""
    import torch.distributed as dist

    from megatron_peakflat.attention.context_parallel import split_sequence
    from megatron_peakflat.tile.api import tiled_self_attention
    from megatron_peakflat.tile.ops import TileOps
    from megatron_peakflat.tile.reference import ReferenceAttentionLayer

    seq = 2 * world * c
    layer = ReferenceAttentionLayer(H, nq, nkv, D, seq, seed=seq + tile)
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(seq, b, H, generator=g), torch.randn(seq, b, H, generator=g)
    whole_x = x.clone().requires_grad_(True)
    whole = layer(whole_x)
    whole.backward(dy)
    ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    ops = layer.cp_ops(world, rank)
    if wrong_positions:  # the rank's rows at positions 0 .. 2c-1, as if the share were a sequence of its own
        ops = TileOps(qkv=layer.qkv, attend=layer.attend, project=layer.project)
    mine = split_sequence(x, world, rank).requires_grad_(True)
    y = tiled_self_attention(mine, ops, tile, list(layer.parameters()), dist.group.WORLD)
    y.backward(split_sequence(dy, world, rank))
    out = {"output": _rel(y.detach(), split_sequence(whole.detach(), world, rank)),
           "dx": _rel(mine.grad, split_sequence(whole_x.grad, world, rank))}
    for n, p in layer.named_parameters():
        summed = p.grad.clone()
        dist.all_reduce(summed)
        out[n] = _rel(summed, ref[n])
    return out


def _measured_peak(rank: int, world: int, c: int, tile: int, dtype: torch.dtype, b: int = 2, nq: int = 8,
                   nkv: int = 2, d: int = 16, h: int = 64, block: int = 16) -> int:
    """Peak live bytes of one forward and backward of the CP tiled sublayer on this rank (flash-class double)."""
    import torch.distributed as dist

    from megatron_peakflat.attention.context_parallel import split_sequence
    from megatron_peakflat.testing.live_bytes import LiveBytesMeter
    from megatron_peakflat.tile.ops import TileOps
    from megatron_peakflat.tile.context_parallel import TiledSelfAttentionCP
    from megatron_peakflat.tile.reference import ReferenceAttentionLayer
    from megatron_peakflat.testing.flash_double import FlashDouble

    seq = 2 * world * c
    layer = ReferenceAttentionLayer(h, nq, nkv, d, seq, dtype=dtype, seed=1)
    cp_ops = layer.cp_ops(world, rank)
    ops = TileOps(qkv=cp_ops.qkv, attend=lambda q, k, v: FlashDouble.apply(q, k, v, block), project=layer.project)
    g = torch.Generator().manual_seed(2)
    x = split_sequence(torch.randn(seq, b, h, generator=g), world, rank).to(dtype).requires_grad_(True)
    dy = split_sequence(torch.randn(seq, b, h, generator=g), world, rank).to(dtype)
    with LiveBytesMeter() as meter:
        y = TiledSelfAttentionCP.apply(x, ops, tile, dist.group.WORLD, *layer.parameters())
        y.backward(dy)
        del y
    return meter.peak


CP_ONLY = ("rank's dK and dV fp32 after the reduce-scatter", "a chunk held while the collectives reorder the layout")


def _bound_worker(rank: int, world: int) -> list[tuple]:
    from megatron_peakflat.tile.bound import tiled_attention_terms
    from megatron_peakflat.testing.flash_double import workspace_bytes

    T, b, nq, nkv, d, h, block = 8, 2, 8, 2, 16, 64, 16
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        e = torch.finfo(dtype).bits // 8
        for c in (2 * T, 4 * T):  # 2 and 4 tiles a chunk
            peak = _measured_peak(rank, world, c, T, dtype, b, nq, nkv, d, h, block)
            terms = tiled_attention_terms(T, 2 * c, b, h, nq, nkv, d, e, cp=world,
                                          attention_workspace_bytes=workspace_bytes(T, b, nq, d, block, e))
            # backward's (b) peaks: the two terms of the reduce-scatter that follows are not alive there
            at_b = terms.whole_bytes - sum(v for k, v in terms.whole.items() if k in CP_ONLY)
            rows.append((str(dtype), c, peak, terms.total, at_b, terms.tile_bytes))
    return rows


def _worker(rank: int, world: int) -> dict:
    out = {case: _errors(rank, world, *case) for case in CASES}
    out["wrong positions"] = _errors(rank, world, *CASES[0], wrong_positions=True)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_cp_tiles_match_the_whole_layer(world):
    results = run_distributed(_worker, world, timeout=240)
    for rank, per_case in enumerate(results):
        for case in CASES:
            errs = per_case[case]
            assert len(errs) == 2 + 5, errs  # output, dx and the five parameters
            assert max(errs.values()) < 1e-6, (rank, case, errs)
        # the comparison can fail: positions of the rank's rows instead of the sequence's change the output
        assert per_case["wrong positions"]["output"] > 1e-3, (rank, per_case["wrong positions"])


@pytest.mark.parametrize("world", [2, 3])
def test_cp_live_bytes_bound(world):
    """On every rank the measured peak is within the bound at CP ``world``, and above the bound's whole-sequence
    terms alive at backward's peak (all but the reduce-scatter's: ``CP_ONLY``) it stays the same from 2 to 4 tiles
    a chunk on rank 0 (its last chunk's tiles see the whole sequence): the working set grows with the sequence only through the gathered K and V, their fp32 gradient sums,
    the attention's prefix gradients, the incoming gradient and dx."""
    results = run_distributed(_bound_worker, world, timeout=240)
    for rank, rows in enumerate(results):
        above: dict[str, list[int]] = {}
        for dtype, c, peak, total, whole, tile_bytes in rows:
            assert peak <= total, (rank, dtype, c, peak, total)
            assert 0 < peak - whole <= tile_bytes, (rank, dtype, c, peak, whole, tile_bytes)
            above.setdefault(dtype, []).append(peak - whole)
        if rank == 0:  # it holds the last chunk, whose tiles see the whole sequence (on rank r the keys end at
            # chunk 2CP-r, so there the prefix gradients are smaller than the bound's whole-sequence term)
            for dtype, values in above.items():
                assert max(values) - min(values) <= 0.02 * values[0], (rank, dtype, values)
