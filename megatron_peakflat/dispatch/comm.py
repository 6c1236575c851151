"""Collectives of the dispatch, for any backend (NCCL on GPU, gloo on CPU) and for a group of one.

Every rank of the EP group calls these in the same order (the schedule is derived from the same
all-gathered counts on every rank), so no send/recv pairing can deadlock, in forward, in the
backward recompute, or under pipeline schedules.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["group_size", "group_rank", "Exchange", "all_to_all_start", "all_to_all", "all_gather_rows", "all_reduce_max"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 for None or when torch.distributed is not initialised."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in ``group``; 0 for None or when torch.distributed is not initialised."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


class Exchange:
    """An all-to-all in flight. ``wait()`` orders the current stream after it (NCCL: no host block) and
    returns the rows received; the rows sent stay referenced until then."""

    def __init__(self, out: torch.Tensor, work: Any = None, sent: torch.Tensor | None = None) -> None:
        self._out, self._work, self._sent = out, work, sent

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = self._sent = None
        return self._out


def all_to_all_start(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                     group: dist.ProcessGroup | None) -> Exchange:
    """Start sending rows ``x[send offsets of r]`` to rank r; the Exchange yields the rows received,
    ordered by source rank. In a group of one it yields ``x`` itself (no copy, nothing in flight)."""
    if group_size(group) == 1:
        return Exchange(x)
    out = x.new_empty((int(sum(recv_splits)), *x.shape[1:]))
    sent = x.contiguous()
    work = dist.all_to_all_single(out, sent, [int(s) for s in recv_splits], [int(s) for s in send_splits],
                                  group=group, async_op=True)
    return Exchange(out, work, sent)


def all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows ``x[send offsets of r]`` go to rank r; returns the rows received, ordered by source rank.

    In a group of one, returns ``x`` itself (no copy).
    """
    return all_to_all_start(x, send_splits, recv_splits, group).wait()


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[P, *x.shape]: every rank's ``x``, in group-rank order."""
    P = group_size(group)
    if P == 1:
        return x.unsqueeze(0)
    out = x.new_empty(P * x.numel())
    dist.all_gather_into_tensor(out, x.contiguous().reshape(-1), group=group)
    return out.view(P, *x.shape)


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The element-wise max of ``x`` over the group, in place; returns ``x``."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x
