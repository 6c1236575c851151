"""The least-loaded plan: which rank computes how many tokens of each expert.

Pure host arithmetic on small integer arrays (numpy). Every rank calls it on the same all-gathered
counts, so every rank gets the same plan without further communication.

Guarantees of ``least_loaded_plan``:
- ``assign[e].sum() == load[e]`` for every expert (every token-expert pair assigned exactly once);
- below the imbalance threshold lambda the plan is plain EP (each expert on its owner);
- otherwise experts are visited by descending load (ties: lower id first); an expert keeps what fits
  under the capacity ``alpha * mean`` at home and spills the rest to the least-loaded other ranks,
  skipping spills smaller than ``min_spill`` unless they are the remainder; when every rank is full,
  the remainder goes to the least-loaded rank (capacity is a target, never a reason to drop tokens);
- with ``max_foreign``, no rank computes tokens of more than that many experts of other ranks: a rank
  at the limit takes no new expert, and a spill that only such ranks had room for stays on its owner
  (exact either way; ``bound.flow_chunk_rows`` bounds the load it leaves there);
- a rank reaches the capacity by a spill at most once, so every spill of an expert but its last fills
  its helper (``bound.weight_sends_bound``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Plan", "least_loaded_plan", "chunk_routes"]


@dataclass(frozen=True)
class Plan:
    assign: np.ndarray
    """[E, P] int64: tokens of expert e computed on rank r."""
    rebalanced: bool
    """False when the imbalance was below lambda and plain EP runs."""
    imbalance: float
    """max/mean rank load under plain EP."""

    @property
    def rank_load(self) -> np.ndarray:
        return self.assign.sum(0)

    def helpers(self, num_local_experts: int) -> list[tuple[int, int]]:
        """(expert, helper rank) pairs where a rank other than the owner computes tokens of the expert."""
        out = []
        for e, r in zip(*np.nonzero(self.assign)):
            if r != e // num_local_experts:
                out.append((int(e), int(r)))
        return out


def least_loaded_plan(load: np.ndarray, ep: int, *, alpha: float = 1.0, min_spill: int = 0,
                      imbalance_threshold: float = 1.0, max_foreign: int | None = None) -> Plan:
    """Plan the tokens of each expert over ``ep`` ranks (see the module docstring for guarantees).
    ``max_foreign``: the most experts of other ranks one rank may compute tokens of (None: no limit)."""
    load = np.asarray(load, dtype=np.int64)
    E = load.shape[0]
    if ep < 1 or E % ep:
        raise ValueError(f"ep={ep}: the number of experts ({E}) must be a positive multiple of the EP size")
    if alpha < 1.0:
        raise ValueError(f"alpha={alpha}: must be >= 1")
    if max_foreign is not None and max_foreign < 0:
        raise ValueError(f"max_foreign={max_foreign}: must be >= 0 (or None: no limit)")
    e_p = E // ep
    owner = np.arange(E) // e_p
    native = load.reshape(ep, e_p).sum(1)
    total = int(load.sum())
    mean = total / ep
    imbalance = float(native.max() / mean) if total > 0 else 1.0
    assign = np.zeros((E, ep), dtype=np.int64)
    if ep == 1 or total == 0 or imbalance < imbalance_threshold:
        assign[np.arange(E), owner] = load
        return Plan(assign, False, imbalance)

    cap = int(math.ceil(alpha * mean))
    assigned = np.zeros(ep, dtype=np.int64)
    pending = native.copy()  # native load of experts not yet visited: room a rank will need later
    hosted = np.zeros(ep, dtype=np.int64)  # experts of other ranks each rank computes tokens of

    def may_host(e: int, home: int, r: int) -> bool:
        return r == home or assign[e, r] > 0 or max_foreign is None or hosted[r] < max_foreign

    for e in np.argsort(-load, kind="stable"):
        n = int(load[e])
        if n == 0:
            continue
        home = int(owner[e])
        pending[home] -= n
        keep = min(n, max(cap - int(assigned[home] + pending[home]), 0))
        assign[e, home] += keep
        assigned[home] += keep
        rest = n - keep

        while rest > 0:
            eff = assigned + pending
            others = [int(r) for r in np.argsort(eff, kind="stable") if r != home]
            placed = refused = False
            for r in others:
                room = cap - int(eff[r])
                if room <= 0:
                    continue
                take = min(rest, room)
                if take < min_spill and take < rest:
                    continue
                if not may_host(e, home, r):
                    refused = True  # room, but the hosting limit: try the next rank
                    continue
                hosted[r] += int(assign[e, r] == 0)
                assign[e, r] += take
                assigned[r] += take
                rest -= take
                placed = True
                break
            if not placed:
                # Only ranks at the hosting limit had room: the rest stays home. Otherwise every helper is
                # full or too small a spill: the least-loaded rank that may host it takes the remainder,
                # home included (the remainder is never dropped).
                r = home if refused else next(int(r) for r in np.argsort(assigned + pending, kind="stable")
                                              if may_host(e, home, int(r)))
                hosted[r] += int(r != home and assign[e, r] == 0)
                assign[e, r] += rest
                assigned[r] += rest
                rest = 0
    return Plan(assign, True, imbalance)


def chunk_routes(counts: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """Split every chunk's pairs of each expert over compute ranks in the plan's proportions.

    ``counts`` [P, K, E]: pairs that source rank s sends to expert e in chunk j. ``assign`` [E, P]:
    the plan over the whole layer (``assign.sum(1) == counts.sum((0, 1))``).
    Returns ``routes`` [K, P_src, E, P_dst]: pairs of (chunk j, source s, expert e) computed on rank r.

    Within one (chunk, expert), the pairs are ordered by (source, token) and cut into consecutive
    ranges, one per compute rank in ascending order, of sizes proportional to the plan; so
    ``routes.sum(3) == counts.transpose(1, 0, 2)`` exactly and each chunk is balanced like the layer.
    """
    P, K, E = counts.shape
    n = counts.transpose(1, 0, 2).astype(np.int64)  # [K, P, E]
    tot = n.sum(1)  # [K, E]
    load = assign.sum(1)  # [E]
    cum = np.cumsum(assign, axis=1)  # [E, P]
    safe = np.maximum(load, 1)
    hi = (cum[None, :, :] * tot[:, :, None]) // safe[None, :, None]  # [K, E, P]
    hi[:, :, -1] = tot  # exact end
    lo = np.concatenate([np.zeros_like(hi[:, :, :1]), hi[:, :, :-1]], axis=2)
    off = np.cumsum(n, axis=1) - n  # [K, P, E] exclusive over sources
    start = off[:, :, :, None]
    end = (off + n)[:, :, :, None]
    routes = np.minimum(end, hi[:, None, :, :]) - np.maximum(start, lo[:, None, :, :])
    return np.maximum(routes, 0)
