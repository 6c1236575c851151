"""The copy-engine transport's host side: what each rank pulls, and when it declines (CPU).

The pulls themselves run on GPUs only: tests/gpu/test_dispatch_gpu.py checks them bit for bit
against NCCL's all-to-all at EP=2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_peakflat.dispatch import copy_engine
from megatron_peakflat.dispatch.api import transport_for
from megatron_peakflat.dispatch.copy_engine import pull_plan
from megatron_peakflat.testing import run_distributed


def _all_to_all_by_pulls(matrix: np.ndarray, sent: list[list[tuple[int, int, int]]]) -> list[list]:
    """Every rank's received rows, assembled from ``pull_plan`` as the transport copies them."""
    out = []
    for me in range(len(matrix)):
        plan = pull_plan(matrix.tolist(), me)
        got: list = [None] * int(matrix[:, me].sum())
        for s, src_row, dst_row, n in plan:
            got[dst_row:dst_row + n] = sent[s][src_row:src_row + n]
        out.append(got)
    return out


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_pulls_lay_rows_out_as_all_to_all_single(P):
    """Rank s's buffer holds its rows for rank 0, then rank 1, ...; each receiver's pulls give every row
    meant for it once, ordered by source (all_to_all_single's layout), on random and sparse matrices."""
    rng = np.random.default_rng(P)
    for trial in range(50):
        matrix = rng.integers(0, 6, size=(P, P))
        if trial % 3 == 0:
            matrix[rng.random((P, P)) < 0.5] = 0
        sent = [[(s, d, i) for d in range(P) for i in range(matrix[s, d])] for s in range(P)]
        got = _all_to_all_by_pulls(matrix, sent)
        for me in range(P):
            want = [(s, me, i) for s in range(P) for i in range(matrix[s, me])]
            assert got[me] == want
            assert all(n > 0 for *_, n in pull_plan(matrix.tolist(), me))


def test_pull_plan_by_hand():
    matrix = [[1, 2, 0], [3, 0, 4], [0, 5, 6]]
    assert pull_plan(matrix, 0) == [(0, 0, 0, 1), (1, 0, 1, 3)]
    assert pull_plan(matrix, 1) == [(0, 1, 0, 2), (2, 0, 2, 5)]
    assert pull_plan(matrix, 2) == [(1, 3, 0, 4), (2, 5, 4, 6)]


def test_declines_off_cuda_and_in_a_group_of_one():
    assert copy_engine.for_group(None, torch.device("cuda", 0))[0] is None
    assert transport_for("auto", None, torch.device("cpu")) is None
    assert transport_for("nccl", None, torch.device("cpu")) is None


def _forced_on_cpu(rank: int, world: int) -> str:
    import torch.distributed as dist

    assert transport_for("auto", dist.group.WORLD, torch.device("cpu")) is None
    with pytest.raises(RuntimeError) as e:
        transport_for("copy-engine", dist.group.WORLD, torch.device("cpu"))
    return str(e.value)


def test_forced_copy_engine_names_the_flag_and_the_fix_where_it_cannot_run():
    """Forced on CPU tensors (gloo, 2 ranks): a clear error naming the flag, why, and what to pass."""
    for msg in run_distributed(_forced_on_cpu, 2):
        assert msg.startswith("--peakflat-dispatch-transport copy-engine: copy engines need CUDA tensors")
        assert "auto" in msg and "nccl" in msg


def test_copy_engine_buffers_carry_one_hidden_row_each():
    """Split for the copy engines: each row-wide piece gets its own buffer (so slots hold one hidden row
    per pair), a piece of one value per row rides along; over NCCL everything shares one buffer."""
    from megatron_peakflat.dispatch.pipelined import _pack_groups

    h, bf, f32 = (4096,), torch.bfloat16, torch.float32
    dispatch_bwd = [(h, bf), ((), f32), (h, bf)]
    assert _pack_groups(dispatch_bwd, split=True) == [[0, 1], [2]]
    assert _pack_groups(dispatch_bwd, split=False) == [[0, 1, 2]]
    assert _pack_groups([(h, bf), ((), f32)], split=True) == [[0, 1]]
    assert _pack_groups([(h, bf)], split=True) == [[0]]
