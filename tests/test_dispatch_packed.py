"""``dispatch/packed.py``: several per-row tensors as the columns of one buffer, bit for bit."""

import pytest
import torch

from megatron_peakflat.dispatch.packed import row_layout


@pytest.mark.parametrize("base,probs", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                        (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64)])
def test_pieces_round_trip_bit_for_bit_and_stay_aligned(base, probs):
    rows, H = 5, 12
    x = torch.randn(rows, H).to(base)
    p = torch.randn(rows, dtype=torch.float64).to(probs)
    g = torch.randn(rows, H).to(base)
    lay = row_layout([(x.shape[1:], x.dtype), ((), p.dtype), (g.shape[1:], g.dtype)])
    assert lay is not None
    es = x.element_size()
    assert (lay.width * es) % 16 == 0 and all((a * es) % 16 == 0 for a in lay.starts)
    ends = [a + c for a, c in zip(lay.starts, lay.cols)]
    assert all(e <= a for e, a in zip(ends, lay.starts[1:])) and ends[-1] <= lay.width  # no overlap
    buf = lay.empty(rows, x.device)
    vx, vp, vg = lay.views(buf)
    assert vx.shape == x.shape and vp.shape == p.shape and vp.dtype == probs and vg.shape == g.shape
    idx = torch.tensor([3, 0, 4, 1, 2])
    vx.index_copy_(0, idx, x)
    vp.copy_(p)
    torch.index_select(g, 0, idx, out=vg)
    got_x, got_p, got_g = lay.views(buf.clone())  # what a receiver of the buffer reads
    assert torch.equal(got_x[idx], x)
    assert torch.equal(got_p, p)
    assert torch.equal(got_g, g[idx])


def test_unpackable_rows_travel_separately():
    # an odd number of bf16 values is not a whole number of fp32 columns
    assert row_layout([((4,), torch.float32), ((3,), torch.bfloat16)]) is None
    assert row_layout([((4,), torch.float32), ((4,), torch.bfloat16)]) is not None
