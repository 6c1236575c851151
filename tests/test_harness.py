"""The test harness itself: the gloo launcher at world 1/2/4 and the live-bytes meter."""

import gc

import pytest
import torch
import torch.distributed as dist

from megatron_peakflat.testing import DistributedTestError, LiveBytesMeter, run_distributed


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return (rank, dist.get_world_size(), t.item())


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_launcher_runs_world(world):
    out = run_distributed(_all_reduce_rank, world)
    expected = world * (world + 1) / 2
    assert out == [(r, world, expected) for r in range(world)]


def test_launcher_reports_the_failing_rank():
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert "rank 1" in str(e.value) and "boom on rank one" in str(e.value)


def test_meter_counts_a_known_pattern_exactly():
    keep = torch.ones(1000)  # allocated before: never counted
    with LiveBytesMeter() as m:
        a = torch.empty(100, dtype=torch.float32)  # 400 B
        b = torch.empty(50, dtype=torch.float64)  # 400 B
        v = a.view(10, 10)  # a view: no new storage
        a.add_(1)  # in place: nothing new
        keep.mul_(2)  # in place on a pre-existing storage: nothing new
        torch.mul(a, 2, out=a)  # out=: nothing new
        assert (m.live, m.peak) == (800, 800)
        del b
        gc.collect()
        assert (m.live, m.peak) == (400, 800)
        c = torch.zeros(25)  # 100 B
        del a, v
        gc.collect()
        assert (m.live, m.peak) == (100, 800)
        m.reset_peak()
        d = torch.empty(300)  # 1200 B
        del d
        assert (m.live, m.peak) == (100, 1300)
        assert m.allocations == 4
    del c


def test_meter_tracks_autograd_saved_tensors():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    with LiveBytesMeter() as m:
        y = torch.relu(x @ w)  # x@w dies at once; relu's output is kept (saved for backward)
        loss = y.sum()  # a 4-byte scalar
        assert m.live == 64 * 16 * 4 + 4
        loss.backward()  # grads of x and w are new storages; the saved output is released
        del y, loss
        gc.collect()
        assert m.live == (64 * 32 + 32 * 16) * 4
    assert m.peak >= 2 * 64 * 16 * 4
