"""The per-layer schedule of PipelinedLLEP: chunk count, plan, and every split size and index.

``build_schedule`` costs one or two tiny collectives (an all-gather of the per-expert counts for
``"expert"`` chunks; an all-reduce of the chunk count and an all-gather of the per-chunk expert counts
otherwise) and exactly one device-to-host copy. Everything else is host arithmetic
on [P, K, E] integers, one upload of its results, and device index work queued behind it. Forward and
backward reuse the same schedule, so the backward recompute issues no synchronisation and exchanges
exactly what the forward exchanged.

``build_schedule`` takes four steps, one function each (or one per membership): count the chunks and plan
on the host (``_count_flow_chunks``, ``_count_strided_chunks``); stage what the device needs in one upload
(``_stage_pair_order``, ``_stage_regroup``); order the pairs on the device (``_order_flow_pairs``,
``_order_strided_pairs``); expand each chunk's regroup index (``_regroup_indices``).

Guarantees:
- ``K`` is identical on every rank of the group (its largest source decides), ``1 <= K <= max_chunks``, and
  when K is not clamped, no source puts more than ``chunk_cap`` token-expert pairs into one chunk;
- chunk membership is ``"expert"`` (cut per flow; ``"auto"``), ``"strided"`` or ``"hybrid"``, see
  ``build_schedule``;
- every local token-expert pair appears in exactly one chunk's send list, once;
- ``combine`` lists every local pair exactly once, under its token, in its chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import comm
from .combine import CombineMap, combine_map
from .bound import chunk_count, split_floor
from .config import MEMBERSHIPS, resolve_membership
from .flows import flow_routes, flow_slice_sizes
from .plan import Plan, chunk_routes, least_loaded_plan
from .upload import Uploads, to_device

__all__ = ["Schedule", "build_schedule", "MEMBERSHIPS", "resolve_membership"]

COLD = (3, 4)
"""In ``"hybrid"`` membership, an expert is cold on a source when it holds fewer than 3/4 of the mean
pairs per expert there (an integer test, ``4 * count * E < 3 * n``, the same on host and device)."""


@dataclass
class Schedule:
    """Everything one layer call's forward and backward need to replay the same chunks and collectives."""

    K: int
    """Chunks of this layer call, the same on every rank of the group."""
    plan: Plan
    """The least-loaded plan over the whole layer call."""
    ep: int
    """P: ranks in the expert-parallel group."""
    rank: int
    """This rank's index in the group."""
    num_local_experts: int
    """Experts owned by each rank; rank r owns experts ``r * num_local_experts`` onwards."""
    pair_token: torch.Tensor
    """[n] long: token of each local pair, ordered by (chunk, destination rank, expert, token)."""
    pair_entry: torch.Tensor
    """[n] long: each local pair's element of a contiguous [T, E] tensor (``token * E + expert``), same order,
    so that a chunk reads its probabilities, and adds their gradients, through one 1-D index."""
    chunk_offsets: list[int]
    """[K + 1]: the pairs of chunk j are ``pair_*[chunk_offsets[j]:chunk_offsets[j + 1]]``."""
    flow_splits: list[list[list[int]]]
    """[K][P][P]: pairs rank s sends rank d in chunk j, for every rank (``send_splits`` and ``recv_splits``
    are this rank's row and column; a copy-engine exchange pulls from each peer's buffer at the offset
    this gives, ``copy_engine.pull_plan``)."""
    regroup: list[torch.Tensor | None]
    """[K]: index turning received rows (source, expert, token) into (expert, source, token); None: identity."""
    ungroup: list[torch.Tensor | None]
    """[K]: the inverse of ``regroup[j]``, turning computed rows back into the received order (so the
    combine gathers rows, a vectorised copy, instead of scattering them element by element)."""
    compute_experts: list[int]
    """Global ids of the experts this rank computes for (its own and any spilled to it), in row order:
    own experts in the bank's ``local_order`` (ascending by default), then foreign ones ascending."""
    tokens_per_expert: list[list[int]]
    """[K][len(compute_experts)]: rows per compute expert in chunk j, after regrouping."""
    rows_cum: torch.Tensor | None = None
    """[K, C] int32 on the device: cumulative ``tokens_per_expert`` of each chunk (grouped-GEMM offsets),
    uploaded once per layer call so that no chunk uploads (and synchronises) again."""
    combine: CombineMap | None = None
    """Each chunk's pairs by token, for the combine (``combine.add_rows``)."""
    weight_sends: list[tuple[int, int]] = field(default_factory=list)
    """(destination rank, expert) for each expert whose weights this rank sends, by (rank, expert)."""
    weight_recvs: list[tuple[int, int]] = field(default_factory=list)
    """(owner rank, expert) for each foreign expert this rank receives, by (rank, expert)."""

    @functools.cached_property
    def send_splits(self) -> list[list[int]]:
        """[K][P]: pairs this rank sends to each rank in chunk j."""
        return [chunk[self.rank] for chunk in self.flow_splits]

    @functools.cached_property
    def recv_splits(self) -> list[list[int]]:
        """[K][P]: pairs this rank receives from each rank in chunk j."""
        return [[row[self.rank] for row in chunk] for chunk in self.flow_splits]

    @property
    def pair_expert(self) -> torch.Tensor:
        """[n] long: global expert of each local pair, same order (computed from ``pair_entry``, not kept)."""
        return self.pair_entry % (self.ep * self.num_local_experts)

    @property
    def moves_weights(self) -> bool:
        """True when the plan spills any expert (the same answer on every rank)."""
        return bool(self.plan.helpers(self.num_local_experts))

    def max_chunk_rows(self) -> int:
        """The most rows this rank receives in any chunk (the expert working set of one chunk)."""
        return max((sum(r) for r in self.recv_splits), default=0)


def _nonzero(mask: torch.Tensor, n: int) -> torch.Tensor:
    try:
        return torch.nonzero_static(mask, size=n)
    except (RuntimeError, NotImplementedError, AttributeError):
        return mask.nonzero()


def _expert_major_counts(per_expert: torch.Tensor, expert_key: torch.Tensor, K: torch.Tensor, rows: int
                         ) -> torch.Tensor:
    """[rows, E]: pairs of each expert in each chunk when the n pairs, sorted by ``expert_key`` then
    token, are cut at ``ceil(j n / K)`` (the ``"expert"`` membership), computed without a host sync."""
    order = torch.argsort(expert_key)
    sizes = per_expert.to(torch.int64)[order]
    hi = torch.cumsum(sizes, 0)
    lo = hi - sizes
    n = hi[-1]
    cut = (torch.arange(rows + 1, device=per_expert.device).clamp(max=K) * n + K - 1) // K  # [rows + 1]
    inter = torch.minimum(hi[None, :], cut[1:, None]) - torch.maximum(lo[None, :], cut[:-1, None])
    counts = torch.empty(rows, per_expert.numel(), dtype=torch.int64, device=per_expert.device)
    counts[:, order] = inter.clamp(min=0)
    return counts


def _cold(per_expert: torch.Tensor | np.ndarray, n: int | torch.Tensor, E: int) -> torch.Tensor | np.ndarray:
    """Experts holding fewer than ``COLD`` of the mean pairs per expert (``"hybrid"`` membership)."""
    return per_expert * E * COLD[1] < COLD[0] * n


def _ceil_div(a: torch.Tensor, b: torch.Tensor | int) -> torch.Tensor:
    return (a + b - 1) // b


def _chunk_counts_on_device(routing_map: torch.Tensor, per_expert: torch.Tensor, expert_key: np.ndarray, *, P: int,
                            group: dist.ProcessGroup | None, membership: str, chunk_cap: int, max_chunks: int,
                            num_chunks: int | None, min_split_chunks: int) -> tuple[np.ndarray, int, torch.Tensor, torch.Tensor]:
    """``"strided"`` and ``"hybrid"``: K (max over the group) and every source's pairs per (chunk,
    expert), computed on the device and all-gathered in the schedule's one device-to-host copy.
    Returns (counts [P, K, E], K, the experts whose pairs go expert-major [E] bool, expert_key on the device)."""
    T, E = routing_map.shape
    dev = routing_map.device
    # The experts whose pairs go expert-major (the others' pairs are strided): none, or the cold ones.
    major = _cold(per_expert, per_expert.sum(), E) if membership == "hybrid" else torch.zeros(
        (E,), dtype=torch.bool, device=dev)
    if num_chunks is not None:
        K_dev = torch.tensor(int(num_chunks), device=dev, dtype=torch.int64)
        kmax_cap = int(num_chunks)
    else:
        per_tok = routing_map.sum(1)  # pairs of each token
        kmax = per_tok.max().clamp(min=1) if T > 0 else torch.ones((), device=dev, dtype=torch.int64)
        per_chunk = (chunk_cap // kmax).clamp(min=1)
        K_dev = _ceil_div(T, per_chunk).clamp(1, max_chunks).to(torch.int64)
        if membership == "hybrid":
            # Chunk j holds the strided pairs of its ceil(T / K) tokens and ceil(n_cold / K) cold pairs:
            # B(K) = ceil(T / K) smax + ceil(n_cold / K) <= cap. The smallest such K among 8 from the lower
            # bound; else the K of (T / K + 1) smax + n_cold / K + 1 <= cap.
            smax = (routing_map & ~major).sum(1).max() if T > 0 else torch.zeros((), device=dev, dtype=torch.int64)
            n_cold = (per_expert * major).sum()
            lo = torch.maximum(K_dev, _ceil_div(T * smax + n_cold, chunk_cap))
            cand = lo + torch.arange(8, device=dev)
            ok = _ceil_div(torch.full_like(cand, T), cand) * smax + _ceil_div(n_cold, cand) <= chunk_cap
            room = (chunk_cap - smax - 1).clamp(min=1)
            K_dev = torch.where(ok.any(), cand[ok.to(torch.int8).argmax()], _ceil_div(T * smax + n_cold, room))
            K_dev = K_dev.clamp(1, max_chunks)
        if P > 1 and min_split_chunks > 0:  # bound.split_floor, on the device
            floor = torch.maximum(K_dev, (2 * K_dev).clamp(max=min_split_chunks)).clamp(max=max_chunks)
            K_dev = torch.where(K_dev >= 2, floor, K_dev)
        kmax_cap = max_chunks
    K_dev = comm.all_reduce_max(K_dev.reshape(1).clone(), group)
    key_dev = to_device(expert_key, dev)
    counts = torch.zeros(kmax_cap, E, device=dev, dtype=torch.int64)
    counts.index_add_(0, torch.arange(T, device=dev) % K_dev, (routing_map & ~major).to(torch.int64))
    if membership == "hybrid":
        counts += _expert_major_counts(per_expert * major, key_dev, K_dev, kmax_cap)
    payload = torch.cat([counts.reshape(-1), K_dev.reshape(1)])
    host = comm.all_gather_rows(payload, group).cpu().numpy()  # the one device-to-host sync
    K = int(host[0, -1])
    return host[:, :-1].reshape(P, kmax_cap, E)[:, :K, :], K, major, key_dev


def build_schedule(routing_map: torch.Tensor, *, num_local_experts: int, group: dist.ProcessGroup | None,
                   chunk_cap: int, max_chunks: int, alpha: float, min_spill: int,
                   imbalance_threshold: float, num_chunks: int | None = None,
                   local_order: Sequence[int] | None = None, membership: str = "auto",
                   min_split_chunks: int = 0, max_foreign: int | None = None) -> Schedule:
    """Plan one MoE layer call. ``routing_map`` [T, E] bool. ``num_chunks`` forces K (tests, peers).

    ``local_order``: the order of this rank's local experts among the rows it computes (an expert
    bank lays them out as its weights are laid out in memory, so that grouped GEMMs need no copy);
    foreign experts follow, ascending. None: every compute expert ascending.

    ``membership``: which chunk a local token-expert pair joins.
    - ``"expert"``: each flow (this rank's pairs for one destination rank, in the plan's split) sorted
      by (expert, token) and cut into K consecutive slices (``flows.py``). Each chunk then holds a
      few experts' rows per destination, so an expert's weights are read, and its gradient
      accumulated, in about one chunk instead of in all K (the cost that makes strided chunking
      slower than one chunk), while every destination gets 1/K of each flow in every chunk, however
      hot an expert is. K is the smallest with ``ceil(n_s / K) <= chunk_cap`` for every source s,
      computed on the host from the all-gathered counts (no all-reduce). Within a flow experts are
      ordered local index first, owner rank second, on every rank alike.
    - ``"strided"``: token i joins chunk ``i mod K`` with all its pairs. At EP > 1 this spreads a hot
      expert's rows over every chunk (expert-major chunks pile them into one chunk and one rank).
    - ``"hybrid"``: the pairs of cold experts (under ``COLD`` of the mean load on this source)
      expert-major, the others strided: a cold expert is computed, its weights read and its gradient
      accumulated in about one chunk (with few rows per chunk those costs are not hidden behind its
      GEMMs), while hot experts stay spread over every chunk and rank. Balanced routing has no cold
      experts, so it is strided there. K may exceed the strided K: a chunk's bound is the strided
      pairs of its tokens plus an equal share of the cold pairs.
    - ``"auto"``: expert.
    Either way no source puts more than ``chunk_cap`` pairs in a chunk (unless K hit max_chunks).

    ``min_split_chunks``: at EP > 1 a call that the cap splits gets at least this many chunks
    (``bound.split_floor``; the overlap rule of ``--peakflat-dispatch-overlap-min-chunks``).

    ``max_foreign``: the most experts of other ranks one rank hosts (``plan.least_loaded_plan``; None: no limit).

    A collective: every rank of ``group`` must call it for the same layer call. See the module
    docstring for what the result guarantees.
    """
    T, E = routing_map.shape
    dev = routing_map.device
    P, me = comm.group_size(group), comm.group_rank(group)
    membership, local_order = _checked_arguments(E, P, num_local_experts, membership, local_order)
    # 1. Count: K, every source's pairs per (chunk, expert) and the plan, through the one device-to-host copy.
    per_expert = routing_map.sum(0)  # local pairs of each expert
    planning = dict(alpha=alpha, min_spill=min_spill, imbalance_threshold=imbalance_threshold,
                    max_foreign=max_foreign)
    if membership == "expert":
        ch = _count_flow_chunks(per_expert, P=P, group=group, num_local_experts=num_local_experts,
                                chunk_cap=chunk_cap, max_chunks=max_chunks, num_chunks=num_chunks,
                                min_split_chunks=min_split_chunks, planning=planning)
    else:
        ch = _count_strided_chunks(routing_map, per_expert, _expert_major_key(local_order, num_local_experts, P, E),
                                   P=P, group=group, membership=membership, chunk_cap=chunk_cap,
                                   max_chunks=max_chunks, num_chunks=num_chunks, min_split_chunks=min_split_chunks,
                                   planning=planning)
    K = ch.K
    owner = np.arange(E) // num_local_experts
    compute = _compute_experts(ch.plan, me, num_local_experts, local_order)

    # 2. Stage every host array the device work below needs and send them in one copy: the GPU waits for
    # the host from the sync above until the first kernel below, so host time here is GPU idle time.
    mine = ch.counts[me]  # [K, E]
    n = int(mine.sum())
    chunk_offsets = [0, *np.cumsum(mine.sum(1)).tolist()]
    recv = ch.routes[:, :, :, me]  # [K, P_src, E]
    flows = ch.routes.sum(2)  # [K, P_src, P_dst]
    tpe = recv[:, :, compute].sum(1).tolist()  # [K][C]
    up = Uploads()
    slots = _stage_pair_order(up, ch, me, compute, P)
    regroup_slots = _stage_regroup(up, recv, flows, compute, me) if P > 1 else None
    s_offsets = up.add(chunk_offsets)
    s_cum = up.add(np.cumsum(np.asarray(tpe, dtype=np.int64).reshape(K, len(compute)), axis=1))
    up.send(dev)

    # 3. On the device: local pairs ordered by (chunk, destination, expert, token). In a group of one the
    # rows are computed in this order, so "expert" means its position in ``compute`` there.
    nz = _nonzero(routing_map, n)
    tok, exp = nz[:, 0].contiguous(), nz[:, 1].contiguous()
    del nz
    if membership == "expert":
        tok, exp = _order_flow_pairs(tok, exp, up, slots, K=K, P=P, E=E)
    else:
        tok, exp = _order_strided_pairs(tok, exp, up, slots, ch, mine, membership=membership, T=T, K=K, P=P, E=E)
    # 4. On the device: each chunk's regroup and ungroup index, and the combine map.
    regroup, ungroup = _regroup_indices(up, regroup_slots, K)
    helpers = ch.plan.helpers(num_local_experts)
    sends = sorted((r, e) for e, r in helpers if owner[e] == me)
    recvs = sorted((int(owner[e]), e) for e, r in helpers if r == me)
    cmap = combine_map(tok, chunk_offsets, T, up.get(s_offsets))
    rows_cum = up.get(s_cum).to(torch.int32)
    entry = tok * E + exp
    del exp
    return Schedule(K, ch.plan, P, me, num_local_experts, tok, entry, chunk_offsets, flows.tolist(), regroup, ungroup,
                    compute, tpe, rows_cum, cmap, sends, recvs)


# ---- the steps of build_schedule, in the order it takes them -----------------------------------------------


def _checked_arguments(E: int, P: int, num_local_experts: int, membership: str, local_order: Sequence[int] | None
                       ) -> tuple[str, Sequence[int]]:
    """The membership resolved (``"auto"`` -> its choice) and ``local_order`` (None -> ascending), after
    checking the expert count, the membership's name and that ``local_order`` is a permutation."""
    if E != P * num_local_experts:
        raise ValueError(f"routing_map has {E} experts but the EP group holds {P} x {num_local_experts}")
    if membership not in MEMBERSHIPS:
        raise ValueError(f"membership {membership!r}: expected one of {MEMBERSHIPS}")
    membership = resolve_membership(membership)
    if local_order is None:
        local_order = range(num_local_experts)
    if sorted(local_order) != list(range(num_local_experts)):
        raise ValueError(f"local_order {list(local_order)} is not a permutation of {num_local_experts} local experts")
    return membership, local_order


def _expert_major_key(local_order: Sequence[int], num_local_experts: int, P: int, E: int) -> np.ndarray:
    """[E]: each global expert's place in expert-major order: the position of its local index in
    ``local_order`` first, its owner rank second."""
    slot = np.empty(num_local_experts, dtype=np.int64)
    slot[np.asarray(list(local_order), dtype=np.int64)] = np.arange(num_local_experts)
    return slot[np.arange(E) % num_local_experts] * P + np.arange(E) // num_local_experts


@dataclass
class _Chunks:
    """A layer call's chunks as counted on the host, after the schedule's one device-to-host copy."""

    K: int
    plan: Plan
    counts: np.ndarray
    """[P, K, E]: every source's pairs per (chunk, expert)."""
    routes: np.ndarray
    """[K, P_src, E, P_dst]: the pairs of each (chunk, source, expert) that each rank computes."""
    per_expert: np.ndarray | None = None
    """``"expert"``: [P, E] every source's pairs per expert."""
    layer_routes: np.ndarray | None = None
    """``"expert"``: [P_src, E, P_dst] the plan's split of the whole layer call."""
    flow_pos: np.ndarray | None = None
    """``"expert"``: [E] each expert's place in a flow (a permutation)."""
    major: torch.Tensor | None = None
    """``"strided"``/``"hybrid"``: [E] bool on the device, the experts whose pairs go expert-major."""
    key_dev: torch.Tensor | None = None
    """``"strided"``/``"hybrid"``: ``_expert_major_key`` on the device."""

    @property
    def by_flow(self) -> bool:
        """True for ``"expert"`` membership (each flow cut on the host)."""
        return self.layer_routes is not None


def _count_flow_chunks(per_expert: torch.Tensor, *, P: int, group: dist.ProcessGroup | None, num_local_experts: int,
                       chunk_cap: int, max_chunks: int, num_chunks: int | None, min_split_chunks: int,
                       planning: dict[str, Any]) -> _Chunks:
    """``"expert"``: K, the plan and every flow's cut, on the host once every rank's per-expert counts are
    known (one all-gather, the schedule's one device-to-host copy; K needs no all-reduce)."""
    E = per_expert.numel()
    host = comm.all_gather_rows(per_expert.to(torch.int64), group).cpu().numpy()  # the one device-to-host sync
    plan = least_loaded_plan(host.sum(0), P, **planning)
    layer_routes = chunk_routes(host[:, None, :], plan.assign)[0]  # [P_src, E, P_dst]
    if num_chunks is not None:
        K = int(num_chunks)
    else:
        K = split_floor(chunk_count(int(host.sum(1).max(initial=0)), chunk_cap, max_chunks), P, min_split_chunks,
                        max_chunks)
    # Each expert's place in a flow: local index first, owner second. The same on every rank (each rank
    # cuts the others' flows as they do), so not local_order, which follows each rank's weight addresses.
    flow_pos = (np.arange(E) % num_local_experts) * P + np.arange(E) // num_local_experts  # a permutation
    routes = flow_routes(layer_routes, K, np.argsort(flow_pos))  # [K, P_src, E, P_dst]
    return _Chunks(K, plan, routes.sum(3).transpose(1, 0, 2), routes, per_expert=host, layer_routes=layer_routes,
                   flow_pos=flow_pos)


def _count_strided_chunks(routing_map: torch.Tensor, per_expert: torch.Tensor, expert_key: np.ndarray, *, P: int,
                          group: dist.ProcessGroup | None, membership: str, chunk_cap: int, max_chunks: int,
                          num_chunks: int | None, min_split_chunks: int, planning: dict[str, Any]) -> _Chunks:
    """``"strided"`` and ``"hybrid"``: K and the counts from the device (``_chunk_counts_on_device``), then
    the plan over the whole layer call and its routes, on the host."""
    cnt, K, major, key_dev = _chunk_counts_on_device(
        routing_map, per_expert, expert_key, P=P, group=group, membership=membership, chunk_cap=chunk_cap,
        max_chunks=max_chunks, num_chunks=num_chunks, min_split_chunks=min_split_chunks)
    plan = least_loaded_plan(cnt.sum((0, 1)), P, **planning)
    return _Chunks(K, plan, cnt, chunk_routes(cnt, plan.assign), major=major, key_dev=key_dev)


def _compute_experts(plan: Plan, me: int, num_local_experts: int, local_order: Sequence[int]) -> list[int]:
    """Global ids of the experts rank ``me`` computes for: its own in ``local_order``, then foreign ones ascending."""
    E = plan.assign.shape[0]
    owner = np.arange(E) // num_local_experts
    base = me * num_local_experts
    foreign = sorted(int(e) for e in np.nonzero(plan.assign[:, me])[0] if owner[e] != me)
    return [base + int(li) for li in local_order] + foreign


@dataclass
class _PairOrderSlots:
    """Where ``_stage_pair_order`` put, in the schedule's one upload, what ordering the pairs needs."""

    pos: int | None = None
    """[E]: each expert's position in ``compute`` (a group of one whose compute order is not ascending)."""
    estart: int | None = None
    """``"expert"``: [E] the first of this rank's pairs of each expert."""
    ebounds: int | None = None
    """``"expert"``: [E, P] the end of each destination's range of them."""
    flowpos: int | None = None
    """``"expert"``: [E] ``_Chunks.flow_pos``."""
    starts: int | None = None
    """``"expert"``: [P_dst * K] the first pair of each (destination, chunk) slice of this rank's flows."""
    group_start: int | None = None
    """``"strided"``/``"hybrid"`` at P > 1: [K * E] the start of each (chunk, expert) group of this rank's pairs."""
    source_offset: int | None = None
    """``"strided"``/``"hybrid"`` at P > 1: [K * E] this rank's offset among the sources of each group."""
    bounds: int | None = None
    """``"strided"``/``"hybrid"`` at P > 1: [K * E, P] the end of each destination's range of each group."""


def _stage_pair_order(up: Uploads, ch: _Chunks, me: int, compute: list[int], P: int) -> _PairOrderSlots:
    """Add to ``up`` the host arrays that put this rank's pairs in (chunk, destination, expert, token) order."""
    E = ch.counts.shape[2]
    K = ch.K
    slots = _PairOrderSlots()
    if P == 1 and compute != list(range(E)):
        pos = np.empty(E, dtype=np.int64)
        pos[compute] = np.arange(E)
        slots.pos = up.add(pos)
    if ch.by_flow:
        host = ch.per_expert
        slots.estart = up.add(np.cumsum(host[me]) - host[me])
        slots.ebounds = up.add(np.cumsum(ch.layer_routes[me], axis=1))
        slots.flowpos = up.add(ch.flow_pos)
        sl = flow_slice_sizes(ch.layer_routes.sum(1), K)[me].reshape(-1)  # [P_dst * K]
        slots.starts = up.add(np.cumsum(sl) - sl)
    elif P > 1:
        mine = ch.counts[me]
        slots.group_start = up.add(np.cumsum(mine.reshape(-1)) - mine.reshape(-1))
        slots.source_offset = up.add((np.cumsum(ch.counts, axis=0) - ch.counts)[me].reshape(-1))
        slots.bounds = up.add(np.cumsum(ch.routes.sum(1), axis=2).reshape(K * E, P))
    return slots


@dataclass
class _RegroupSlots:
    """Where ``_stage_regroup`` put the regroup and ungroup runs, and the received rows per chunk."""

    runs: list[int]
    """Slots of (regroup deltas, their sizes, ungroup deltas, their sizes), each [K, P * C]."""
    first: np.ndarray
    """[K]: the first received row of each chunk, among all the layer call's received rows."""
    received: np.ndarray
    """[K]: rows this rank receives in each chunk."""


def _stage_regroup(up: Uploads, recv: np.ndarray, flows: np.ndarray, compute: list[int], me: int) -> _RegroupSlots:
    """Add to ``up`` the runs of every chunk's regroup and ungroup (P > 1). Every chunk's runs expand in
    one call (``_regroup_indices``), so each chunk's deltas count from its first received row."""
    received = flows[:, :, me].sum(1)  # [K]
    first = np.cumsum(received) - received
    reg_delta, reg_size, ung_delta, ung_size = _regroup_runs(recv[:, :, compute], compute)  # each [K, P * C]
    runs = [up.add(a) for a in (reg_delta - first[:, None], reg_size, ung_delta - first[:, None], ung_size)]
    return _RegroupSlots(runs, first, received)


def _order_flow_pairs(tok: torch.Tensor, exp: torch.Tensor, up: Uploads, slots: _PairOrderSlots, *, K: int, P: int,
                      E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``"expert"``: the pairs (``tok``, ``exp``, by token) in (chunk, destination, expert, token) order.

    A pair's rank among this source's pairs of its expert (by token) picks its destination, as
    chunk_routes split them; its position in its flow, ordered by (expert order, token), its slice."""
    rows = torch.arange(tok.numel(), device=tok.device)
    order = torch.argsort(exp, stable=True)
    tok, exp = tok[order], exp[order]
    dest = (rows - up.get(slots.estart)[exp]).unsqueeze(1).ge(up.get(slots.ebounds)[exp]).sum(1)
    order = torch.argsort(dest * E + up.get(slots.flowpos)[exp], stable=True)
    tok, exp = tok[order], exp[order]
    cell = torch.searchsorted(up.get(slots.starts), rows, right=True) - 1  # destination * K + chunk
    rank_of = exp if slots.pos is None else up.get(slots.pos)[exp]
    order = torch.argsort(((cell % K) * P + cell // K) * E + rank_of, stable=True)
    return tok[order], exp[order]


def _order_strided_pairs(tok: torch.Tensor, exp: torch.Tensor, up: Uploads, slots: _PairOrderSlots, ch: _Chunks,
                         mine: np.ndarray, *, membership: str, T: int, K: int, P: int, E: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``"strided"`` and ``"hybrid"``: the pairs in (chunk, destination, expert, token) order.

    Strided pairs join chunk token mod K; the expert-major pair at position p of the (expert key,
    token) order of the n_major such pairs joins chunk floor(p K / n_major), as
    _expert_major_counts cut them. Sorted by (chunk, expert, token), then stably by destination."""
    dev = tok.device
    n = tok.numel()
    rows = torch.arange(n, device=dev)
    per_expert_host = mine.sum(0)
    n_major = int(per_expert_host[_cold(per_expert_host, n, E)].sum()) if membership == "hybrid" else 0
    j = tok % K
    if n_major:  # the device's choice of cold experts, counted on the host
        major, key_dev = ch.major, ch.key_dev
        by_expert = torch.argsort(torch.where(major[exp], key_dev[exp] * max(1, T) + tok, E * max(1, T)))[:n_major]
        j[by_expert] = torch.arange(n_major, device=dev) * K // n_major
        del by_expert
    key = j * E + (exp if slots.pos is None else up.get(slots.pos)[exp])
    del j
    order = torch.argsort(key, stable=True)
    tok, exp, key = tok[order], exp[order], key[order]
    if P > 1:
        pos = rows - up.get(slots.group_start)[key] + up.get(slots.source_offset)[key]
        dest = (pos.unsqueeze(1) >= up.get(slots.bounds)[key]).sum(1)
        order = torch.sort(key // E * P + dest, stable=True).indices
        tok, exp = tok[order], exp[order]
    return tok, exp


def _regroup_indices(up: Uploads, slots: _RegroupSlots | None, K: int
                     ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Each chunk's regroup and ungroup index, expanded from the uploaded runs in one call each
    (None for every chunk in a group of one, where received rows are already in computed order)."""
    regroup: list[torch.Tensor | None] = [None] * K
    ungroup: list[torch.Tensor | None] = [None] * K
    if slots is None:
        return regroup, ungroup
    total = int(slots.received.sum())
    d_reg, n_reg, d_ung, n_ung = (up.get(s).reshape(-1) for s in slots.runs)
    r = torch.arange(total, device=d_reg.device)
    reg_all = torch.repeat_interleave(d_reg, n_reg, output_size=total).add_(r)
    ung_all = torch.repeat_interleave(d_ung, n_ung, output_size=total).add_(r)
    del r
    for jj in range(K):
        a, b = int(slots.first[jj]), int(slots.first[jj] + slots.received[jj])
        regroup[jj], ungroup[jj] = reg_all[a:b], ung_all[a:b]
    return regroup, ungroup


def _regroup_runs(blocks: np.ndarray, compute: Sequence[int]) -> tuple[np.ndarray, ...]:
    """The runs that turn one chunk's received rows into computed rows and back, for the device.

    ``blocks`` [..., P, C]: rows received from source s for compute expert ``compute[c]`` (any leading
    dimensions, e.g. the K chunks of a layer call at once). Received rows are laid out by (source, expert
    ascending); computed rows by (``compute`` position, source). Returns (regroup deltas, their run
    sizes, ungroup deltas, their run sizes), each [..., P * C]: ``regroup`` is ``repeat(deltas, sizes) +
    arange`` in computed order (row i of block b reads received row ``i + delta[b]``), ``ungroup`` the
    same in received order, its inverse.
    """
    *lead, P, C = blocks.shape
    asc = np.argsort(np.asarray(compute), kind="stable")
    recv_sizes = blocks[..., asc].reshape(*lead, P * C)
    rstart = np.empty_like(blocks)
    rstart[..., asc] = (np.cumsum(recv_sizes, axis=-1) - recv_sizes).reshape(*lead, P, C)
    comp_sizes = np.swapaxes(blocks, -1, -2).reshape(*lead, C * P)
    cstart = np.swapaxes((np.cumsum(comp_sizes, axis=-1) - comp_sizes).reshape(*lead, C, P), -1, -2)
    return (np.swapaxes(rstart - cstart, -1, -2).reshape(*lead, C * P), comp_sizes,
            (cstart - rstart)[..., asc].reshape(*lead, P * C), recv_sizes)
