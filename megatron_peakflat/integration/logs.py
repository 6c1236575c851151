"""The package's logger, its rank filter, and its once-per-process lines (hand-backs, chosen paths).

Every line goes to the ``megatron_peakflat`` logger. ``install_rank_filter`` (run by ``apply``) keeps a job of
many ranks to one copy of each line:

- a line that is the same on every rank (a decision taken from the flags) is logged by rank 0 only, and by the
  first rank of each later pipeline stage (the stage's decisions, e.g. the loss on the last one, are made there:
  those lines say which rank logged them);
- a line whose content depends on the rank (a measured per-rank figure, this host's memory, a failure on this
  rank) is marked ``extra=PER_RANK`` and is logged by every rank, prefixed ``[rank N]``;
- ``--peakflat-log-all-ranks`` brings back every rank's lines, each prefixed with its rank.

Nothing here imports Megatron: the rank comes from torch.distributed once it is initialised, before that
from ``RANK`` as torchrun (and Megatron's launchers) set it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("megatron_peakflat")
_said: set[str] = set()

PER_RANK: dict[str, Any] = {"per_rank": True}
"""``extra=`` for a line whose content differs per rank: every rank logs it, prefixed ``[rank N]``."""


def _stage_leader() -> bool:
    """Whether this rank is the first of its pipeline stage (data-, context- and tensor-parallel rank 0), once
    Megatron's parallel state exists; False before."""
    try:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return False
        return ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 - a logging filter must never raise
        return False


def current_rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a logging filter must never raise
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankFilter(logging.Filter):
    """Drop, on ranks other than 0 and the first rank of each later pipeline stage, every record not marked
    per-rank (unless ``all_ranks``); prefix the lines kept from ranks other than 0, and every per-rank line, with
    ``[rank N]``."""

    def __init__(self, all_ranks: bool = False) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        everywhere = self.all_ranks or bool(getattr(record, "per_rank", False))
        rank = current_rank()
        if rank != 0 and not everywhere and not _stage_leader():
            return False
        if (rank != 0 or everywhere) and getattr(record, "peakflat_rank", None) is None:
            record.peakflat_rank = rank
            record.msg = f"[rank {rank}] {record.msg}"
        return True


def install_rank_filter(all_ranks: bool = False) -> list[RankFilter]:
    """Put one RankFilter on the package's logger, replacing any earlier one (so a second ``apply`` with other
    flags takes effect); return the ones it replaced, for ``restore_rank_filters``."""
    previous = remove_rank_filter()
    log.addFilter(RankFilter(all_ranks))
    return previous


def restore_rank_filters(previous: list[RankFilter]) -> None:
    """Put back the filters ``install_rank_filter`` replaced (a refused ``apply`` leaves logging as it was)."""
    remove_rank_filter()
    for f in previous:
        log.addFilter(f)


def remove_rank_filter() -> list[RankFilter]:
    """Take the RankFilter off the package's logger (every rank logs every line again); return what was removed."""
    removed = [f for f in log.filters if isinstance(f, RankFilter)]
    for f in removed:
        log.removeFilter(f)
    return removed


def info_once(msg: str, *args: Any, level: int = logging.INFO, per_rank: bool = False) -> None:
    """Log ``msg % args`` the first time this exact line comes up in the process, never again. ``per_rank``:
    the line's content depends on the rank (see the module's docstring)."""
    line = msg % args if args else msg
    if line not in _said:
        _said.add(line)
        log.log(level, line, extra=PER_RANK if per_rank else None)
