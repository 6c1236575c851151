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


class _NoStream:
    """Stands in for CUDA streams and events on CPU, where every operation runs in program order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _FileSymmetricMemory:
    """Symmetric memory for ranks of one host on CPU: each rank's buffer is a shared file that its peers map;
    the barrier is the group's. The copy-engine transport's own code then runs unchanged over gloo."""

    def __init__(self, folder: str, rank: int) -> None:
        self.folder, self.rank, self.generation = folder, rank, 0

    def _path(self, generation: int, rank: int) -> str:
        return f"{self.folder}/symm.{generation}.{rank}"

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.generation += 1
        return torch.from_file(self._path(self.generation, self.rank), shared=True, size=n, dtype=dtype)

    def rendezvous(self, buf: torch.Tensor, group):
        import torch.distributed as dist

        dist.barrier(group)  # every rank's file exists
        outer, generation, n = self, self.generation, buf.numel()

        class Handle:
            peers = {r: torch.from_file(outer._path(generation, r), shared=True, size=n, dtype=torch.uint8)
                     for r in range(dist.get_world_size(group))}

            def get_buffer(self, rank, sizes, dtype, storage_offset=0):
                count = int(np.prod(sizes))
                return self.peers[rank][storage_offset:storage_offset + count * dtype.itemsize].view(dtype).view(sizes)

            def barrier(self, channel=0, timeout_ms=0):
                dist.barrier(group)

        return Handle()


def _install_file_symmetric_memory(folder: str, rank: int) -> None:
    """In this worker process: symmetric memory backed by files in ``folder``, and CUDA streams and events
    that do nothing, so the transport's own code runs on CPU tensors."""
    import torch.distributed._symmetric_memory as symm_mem

    fake = _FileSymmetricMemory(folder, rank)
    symm_mem.empty, symm_mem.rendezvous = fake.empty, fake.rendezvous
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.set_stream = lambda stream: None
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.memory_allocated = lambda device=None: 0


def _transport_on_cpu(rank: int, world: int, folder: str) -> list[tuple[str, bool, int]]:
    """PipelinedLLEP's overlapped calls through the copy-engine transport (its pulls copy between shared
    files here) against the same calls over gloo's all-to-all, bit for bit."""
    import torch.distributed as dist

    from megatron_peakflat import stats
    from megatron_peakflat.dispatch.api import plan_layer
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.dispatch.pipelined import pipelined_moe
    from megatron_peakflat.dispatch.reference import ReferenceExperts
    from tests.test_dispatch import make_routing

    _install_file_symmetric_memory(folder, rank)

    group = dist.group.WORLD
    transport = copy_engine.CopyEngineTransport(group, torch.device("cpu"))
    H, F, k, E = 16, 8, 2, 4 * world
    e_p = E // world
    g = torch.Generator().manual_seed(5)
    fc1 = [torch.randn(2 * F, H, generator=g) * 0.3 for _ in range(E)]
    fc2 = [torch.randn(H, F, generator=g) * 0.3 for _ in range(E)]
    out_rows = []
    for T, skew in ((40 + 7 * rank, "balanced"), (90 + 5 * rank, "hot95"), (60, "all")):
        probs32, rmap = make_routing(T, E, k, skew, seed=rank + 3)
        x32 = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
        gout = torch.randn(T, H, generator=torch.Generator().manual_seed(rank + 9))
        for fused in (False, True):
            runs = []
            for ce in (None, transport):
                bank = ReferenceExperts(fc1[rank * e_p:(rank + 1) * e_p], fc2[rank * e_p:(rank + 1) * e_p], grouped=True)
                cfg = DispatchConfig(impl="pipelined-llep", chunk_cap=12, max_chunks=64, min_spill=2,
                                     imbalance_threshold=1.1)
                sched = plan_layer(rmap, bank, group, cfg, hidden=H, dtype_bytes=4)
                x, probs = x32.clone().requires_grad_(True), probs32.clone().requires_grad_(True)
                before = stats.snapshot().get("dispatch", {}).get("copy_engine_exchanges", 0)
                out = pipelined_moe(x, probs, sched, bank, group, gout if fused else None, overlap=True,
                                    transport=(lambda: ce))
                got = torch.autograd.grad(out, [x, probs, *bank.parameters()], gout)
                pulled = stats.snapshot()["dispatch"].get("copy_engine_exchanges", 0) - before
                assert (pulled > 0) == (ce is not None) and sched.K >= 2, (pulled, sched.K)
                runs.append([out.detach(), *got])
            same = all(torch.equal(a, b) for a, b in zip(*runs))
            out_rows.append((f"{skew},fused={fused},rank={rank}", same, transport.held_bytes))
    return out_rows


@pytest.mark.parametrize("world", [2, 3, 4])
def test_copy_engine_protocol_moves_the_same_bytes_as_all_to_all(world, tmp_path):
    """The transport's code, unchanged, over a file-backed stand-in for symmetric memory (gloo, CPU):
    balanced, 95% on one expert and every token on one expert, plain and fused backward, many
    overlapped chunks through 2 reused and growing slots: bit for bit what gloo's all-to-all gives."""
    for rows in run_distributed(_transport_on_cpu, world, str(tmp_path)):
        for name, same, held in rows:
            assert same, name
            assert held > 0, name


def _rows_sent(s: int, matrix: list[list[int]], width: int) -> torch.Tensor:
    n = int(sum(matrix[s]))
    return (torch.arange(n * width, dtype=torch.float64) % 4099 + 10000 * s).float().view(n, width)


def _growth_on_cpu(rank: int, world: int, folder: str) -> list[tuple[int, bool]]:
    """Three exchanges over the file-backed symmetric memory: only rank 0's rows of the second outgrow the
    slots. Each exchange's slot size here and whether the rows received are the ones sent."""
    import torch.distributed as dist

    _install_file_symmetric_memory(folder, rank)

    transport = copy_engine.CopyEngineTransport(dist.group.WORLD, torch.device("cpu"))
    width, out = 1024, []
    for n0 in (1, 300, 2):  # rows rank 0 sends each rank (4 KiB each); every other rank sends one
        matrix = [[n0] * world if s == 0 else [1] * world for s in range(world)]
        buf = transport.send_buffer(matrix, width, torch.float32)
        buf.copy_(_rows_sent(rank, matrix, width))
        got = transport.start(buf, matrix).wait()
        want = torch.cat([_rows_sent(s, matrix, width)[sum(matrix[s][:rank]):sum(matrix[s][:rank + 1])]
                          for s in range(world)])
        out.append((transport.slot_bytes, torch.equal(got, want)))
    return out


def test_copy_engine_slots_grow_together_when_one_rank_needs_room(tmp_path):
    """The slots are symmetric: when only rank 0's rows outgrow them, every rank grows them at that same
    exchange (from the split matrix all ranks share), to the same size, and every row still arrives."""
    per_rank = run_distributed(_growth_on_cpu, 2, str(tmp_path), timeout=60)
    assert per_rank[0] == per_rank[1], per_rank
    sizes = [size for size, _ in per_rank[0]]
    assert sizes[0] < 300 * 2 * 4096 <= sizes[1] == sizes[2], sizes
    assert all(same for rows in per_rank for _, same in rows), per_rank
