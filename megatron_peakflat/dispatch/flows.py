"""Expert-major chunks cut per flow: host arithmetic for the ``"expert"`` chunk membership.

A flow is the pairs one source rank sends to one destination rank over a whole layer call. Each flow,
ordered by expert (then token), is cut into K consecutive slices whose sizes differ by at most one;
slice j of every flow forms chunk j. So:
- every destination receives 1/K of each source's pairs for it in every chunk (rounded), whatever the
  routing: a hot expert can fill a flow but never piles into one chunk or one rank, as cutting a
  source's pairs in expert order across destinations would (its slices would hold one rank's experts);
- within a flow an expert's pairs sit in consecutive chunks, so an expert is computed, its weights read
  and its gradient accumulated in about one chunk per flow instead of in all K (strided chunks);
- the slices that get the extra pair of a flow's remainder follow each other round the chunks from one
  flow to the next, so no source puts more than ``ceil(n_s / K)`` pairs into any chunk.

Pure numpy on [P, E] counts that every rank holds after the schedule's one all-gather, so every rank
computes the same K and the same routes with no further communication.
"""

from __future__ import annotations

import numpy as np

__all__ = ["flow_slice_sizes", "flow_routes"]


def flow_slice_sizes(flows: np.ndarray, K: int) -> np.ndarray:
    """[P_src, P_dst, K]: pairs of flow (s, d) in chunk j.

    Slice sizes are ``n // K`` or one more; the ``n mod K`` larger slices of flow (s, d) take the chunks
    after those of flow (s, d - 1), round the K chunks, so every chunk of source s holds
    ``floor(n_s / K)`` or ``ceil(n_s / K)`` pairs.
    """
    flows = np.asarray(flows, dtype=np.int64)
    base, rem = flows // K, flows % K
    start = np.cumsum(rem, axis=1) - rem  # [P_src, P_dst]: first chunk of each flow's larger slices
    j = np.arange(K)
    extra = (j[None, None, :] - start[:, :, None]) % K < rem[:, :, None]
    return base[:, :, None] + extra


def flow_routes(route: np.ndarray, K: int, expert_order: np.ndarray) -> np.ndarray:
    """[K, P_src, E, P_dst]: pairs of (chunk j, source s, expert e) computed on rank d.

    ``route`` [P_src, E, P_dst]: the layer's pairs of (source, expert) computed on each rank (the plan's
    split, ``plan.chunk_routes`` with one chunk). ``expert_order``: the order of experts within a flow
    (a permutation of E). ``flow_routes(...).sum(0) == route``, and the pairs of flow (s, d) in chunk j
    are the j-th slice of ``flow_slice_sizes`` in ``expert_order``.
    """
    route = np.asarray(route, dtype=np.int64)
    P, E, _ = route.shape
    sizes = route.transpose(0, 2, 1)[:, :, expert_order]  # [P_src, P_dst, E] in flow order
    sl = flow_slice_sizes(sizes.sum(2), K)
    s_hi = np.cumsum(sl, axis=2)
    s_lo = s_hi - sl
    e_hi = np.cumsum(sizes, axis=2)
    e_lo = e_hi - sizes
    inter = np.minimum(e_hi[:, :, None, :], s_hi[:, :, :, None]) - np.maximum(e_lo[:, :, None, :], s_lo[:, :, :, None])
    out = np.zeros((K, P, E, P), dtype=np.int64)
    out[:, :, expert_order, :] = np.maximum(inter, 0).transpose(2, 0, 3, 1)
    return out
