"""PipelinedLLEP, the user-facing call: least-loaded plan + chunked, recomputed dispatch.

    out = llep_moe(x, probs, routing_map, bank, group, cfg)

``x`` [T, H] rows of this rank, ``probs`` [T, E] dense router probabilities (gradients flow to the
routed entries), ``routing_map`` [T, E] bool, ``bank`` this rank's experts (an ExpertBank), ``group``
the expert-parallel process group (None: one rank), ``cfg`` a DispatchConfig.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import stats
from . import comm, copy_engine
from .copy_engine import CopyEngineTransport
from .config import DispatchConfig
from .experts import ExpertBank
from .pipelined import pipelined_moe
from .bound import auto_max_foreign, working_set_bound
from .schedule import Schedule, build_schedule

__all__ = ["llep_moe", "plan_layer", "hosting_limit", "transport_for", "working_set_bound"]


def _layout_order(bank: ExpertBank) -> list[int] | None:
    order = getattr(bank, "layout_order", None)
    return order() if order is not None else None


def hosting_limit(cfg: DispatchConfig, bank: ExpertBank, group: dist.ProcessGroup | None, hidden: int | None,
                  dtype_bytes: int | None) -> int:
    """The most foreign experts one rank hosts in a layer call: ``cfg.max_foreign_experts``, or under 'auto'
    ``bound.auto_max_foreign`` for rows of ``hidden`` elements of ``dtype_bytes`` and this bank's experts
    (the same on every rank: every rank's experts have the same shapes); 0 in a group of one. Raises
    ValueError when 'auto' in a larger group has no ``hidden`` or the chunk cap is still 'auto'."""
    if cfg.max_foreign_experts is not None:
        return cfg.max_foreign_experts
    if comm.group_size(group) == 1:
        return 0  # a group of one has no foreign experts
    if hidden is None or dtype_bytes is None or cfg.chunk_cap is None:
        raise ValueError("max_foreign_experts 'auto' depends on the hidden size, the rows' dtype and the chunk cap: "
                         "pass hidden= and dtype_bytes= with cfg.resolved(topk), or a number")
    params = bank.expert_params(0)
    return auto_max_foreign(ep=comm.group_size(group), num_local_experts=bank.num_local_experts,
                            chunk_cap=cfg.chunk_cap, hidden=hidden, dtype_bytes=dtype_bytes,
                            expert_numel=sum(p.numel() for p in params), weight_bytes=params[0].element_size())


def plan_layer(routing_map: torch.Tensor, bank: ExpertBank, group: dist.ProcessGroup | None,
               cfg: DispatchConfig, *, num_chunks: int | None = None, hidden: int | None = None,
               dtype_bytes: int | None = None) -> Schedule:
    """The schedule of one layer call (one device-to-host sync); ``num_chunks`` forces K.

    A collective over ``group`` (see ``build_schedule``); records the chunk count, imbalance, spills and
    the hosting limit (``hosting_limit``: ``hidden`` and ``dtype_bytes`` describe the rows, needed under
    'auto') in ``stats`` under "dispatch".
    """
    if num_chunks is not None and num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks}: must be at least 1")
    if cfg.chunk_cap is None and num_chunks is None:
        raise ValueError("chunk_cap 'auto' depends on the router's top-k: pass cfg.resolved(topk)")
    max_foreign = hosting_limit(cfg, bank, group, hidden, dtype_bytes)
    sched = build_schedule(routing_map, num_local_experts=bank.num_local_experts, group=group,
                           chunk_cap=cfg.chunk_cap or 1,  # read only when num_chunks is None
                           max_chunks=cfg.max_chunks, alpha=cfg.alpha,
                           min_spill=cfg.min_spill, imbalance_threshold=cfg.imbalance_threshold,
                           num_chunks=num_chunks, local_order=_layout_order(bank), membership=cfg.membership,
                           min_split_chunks=cfg.overlap_min_chunks, max_foreign=max_foreign)
    stats.record("dispatch", "chunks", sched.K)
    stats.peak("dispatch", "max_chunks_seen", sched.K)
    stats.record("dispatch", "imbalance", round(sched.plan.imbalance, 3))
    stats.record("dispatch", "max_foreign_experts", max_foreign)
    stats.add("dispatch", "calls", 1)
    stats.add("dispatch", "rebalanced_calls", int(sched.plan.rebalanced))
    stats.add("dispatch", "spilled_experts", len(sched.plan.helpers(bank.num_local_experts)))
    stats.peak("dispatch", "max_hosted_experts", len(sched.weight_recvs))
    stats.peak("dispatch", "max_chunk_rows", sched.max_chunk_rows())
    return sched


def llep_moe(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, bank: ExpertBank,
             group: dist.ProcessGroup | None, cfg: DispatchConfig, *, num_chunks: int | None = None,
             out_grad: torch.Tensor | None = None, need_output: bool = True) -> torch.Tensor:
    """MoE output [T, H]: exact (up to summation order) against an unchunked MoE on the same weights.

    ``out_grad``: the gradient the output will receive, when the caller knows it (a recompute); the
    chunks' backward then runs in this call (``pipelined``), and the result stays exact if it differs.
    ``need_output=False`` (with ``out_grad``): zeros are returned instead of the output, whose values
    the caller knows nothing reads; the gradients are the same.

    Raises ValueError on mismatched shapes, when ``E`` is not the group size times the bank's experts, or
    when ``cfg.chunk_cap`` is still 'auto' (``cfg.resolved(topk)`` makes it a number). No rank hosts more
    foreign experts than ``hosting_limit`` gives.
    """
    if x.dim() != 2 or probs.shape != routing_map.shape or probs.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)}, probs {tuple(probs.shape)}, routing_map {tuple(routing_map.shape)}: "
                         "expected x [T, H] and probs, routing_map [T, E]")
    sched = plan_layer(routing_map, bank, group, cfg, num_chunks=num_chunks, hidden=x.shape[1],
                       dtype_bytes=x.element_size())
    return pipelined_moe(x, probs, sched, bank, group, out_grad, overlap=cfg.overlap,
                         overlap_min_chunks=cfg.overlap_min_chunks, pack=cfg.pack_collectives,
                         transport=functools.partial(transport_for, cfg.transport, group, x.device),
                         need_output=need_output)


def transport_for(choice: str, group: dist.ProcessGroup | None, device: torch.device) -> CopyEngineTransport | None:
    """The copy-engine transport for an overlapped call under ``--peakflat-dispatch-transport choice``, or
    None for NCCL. A collective on its first call for a group (every rank of it calls alike).

    Raises RuntimeError when ``choice`` is 'copy-engine' and the copy engines cannot serve ``group``.
    """
    if choice == "nccl":
        stats.record("dispatch", "transport", _collectives(group))
        return None
    ce, why = copy_engine.for_group(group, device)
    if ce is None:
        if choice == "copy-engine":
            raise RuntimeError(f"--peakflat-dispatch-transport copy-engine: {why}; pass --peakflat-dispatch-transport "
                               "auto (NCCL where the copy engines cannot serve) or nccl")
        stats.record("dispatch", "transport", f"{_collectives(group)}: {why}")
        return None
    stats.record("dispatch", "transport", "copy-engine")
    return ce


def _collectives(group: dist.ProcessGroup | None) -> str:
    """What carries the all-to-alls when the copy engines do not: the group's backend (NCCL on GPUs, gloo in
    the CPU tests and the CPU demo)."""
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return "nccl"
