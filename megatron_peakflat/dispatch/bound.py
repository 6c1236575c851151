"""PipelinedLLEP's chunk count and working-set bound as plain arithmetic (no torch import), shared by
the component (``api.working_set_bound``) and the memory planner (``memory/model.py``)."""

from __future__ import annotations

__all__ = ["chunk_count", "split_floor", "overlap_on", "flow_chunk_rows", "working_set_bound"]


def chunk_count(num_pairs: int, chunk_cap: int, max_chunks: int) -> int:
    """K for a source of ``num_pairs`` token-expert pairs: the smallest with ``ceil(n / K) <= chunk_cap``,
    at most ``max_chunks`` (the ``"expert"`` membership's rule, ``schedule.build_schedule``, which takes
    the largest source of the group; planners pass one balanced rank's pairs)."""
    return int(min(max_chunks, max(1, -(-int(num_pairs) // max(1, chunk_cap)))))


def split_floor(num_chunks: int, ep: int, min_chunks: int, max_chunks: int) -> int:
    """The chunks of a layer call whose cap asks for ``num_chunks``: at ``ep`` > 1 a call the cap splits
    (K >= 2) overlaps its all-to-alls (``overlap_on``), and is cut into at least ``min_chunks``
    (--peakflat-dispatch-overlap-min-chunks; 0: no floor) so that the two chunks in flight hold at most
    2 / ``min_chunks`` of its rows, but into no more than twice the cap's K (chunks keep at least half
    the cap: smaller ones cost more per row than overlap saves). At most ``max_chunks``. Monotone in
    ``num_chunks``, so applying it before or after the max over the group gives the same K."""
    if ep > 1 and min_chunks > 0 and num_chunks >= 2:
        return int(min(max_chunks, max(num_chunks, min(min_chunks, 2 * num_chunks))))
    return int(num_chunks)


def overlap_on(forced: bool, min_chunks: int, num_chunks: int, ep: int) -> bool:
    """Whether a layer call of ``num_chunks`` chunks keeps its neighbours' all-to-alls in flight: only at
    ``ep`` > 1 (a group of one sends nothing), always when ``forced`` (--peakflat-dispatch-overlap), else
    when the call has two chunks or more and ``min_chunks`` > 0 (its chunks then follow ``split_floor``)."""
    return ep > 1 and (forced or (min_chunks > 0 and num_chunks >= 2))


def flow_chunk_rows(*, pairs_per_rank: float, ep: int, chunk_cap: int, max_chunks: int, alpha: float,
                    imbalance_threshold: float, min_spill: int) -> int:
    """The most rows one rank receives in one chunk of per-flow (``"expert"``) chunks, whatever the
    routing, when no rank sends more than ``pairs_per_rank`` token-expert pairs.

    Why: with n_max the most pairs of any source and K >= n_max / c_eff its chunks (c_eff: the cap, or
    ``pairs_per_rank / max_chunks`` where K hit its limit), every flow puts at most ceil(n_sd / K) pairs
    into a chunk, so rank d receives at most load_d / K + P per chunk. The least-loaded plan keeps
    load_d <= max(lambda * mean, ceil(alpha * mean), mean + (P - 1) * m) with mean <= n_max: below lambda it
    is plain EP; above, a rank takes spills only up to the capacity ceil(alpha * mean), and a remainder
    that no rank has room for (every other rank within m of the capacity) goes to the least-loaded rank,
    which then holds less than mean + (P - 1) * m (``plan.least_loaded_plan``). Hence
    ``ceil(max(alpha, lambda) * c_eff) + (P - 1) * m + P + 1`` rows; at EP=1, c_eff. Far below P * (c + k)
    at large P, the bound of strided and hybrid chunks, which route each chunk by the plan's proportions.
    """
    c_eff = max(int(chunk_cap), -(-int(pairs_per_rank) // max(1, int(max_chunks))))
    if ep <= 1:
        return c_eff
    return int(-(-max(alpha, imbalance_threshold) * c_eff // 1)) + (ep - 1) * int(min_spill) + ep + 1


def working_set_bound(*, num_tokens: float, hidden: int, ffn: int, num_experts: int, topk: int, chunk_rows: float,
                      expert_param_bytes: float, dtype_bytes: int, glu: bool = True, ep: int = 1,
                      overlap: bool = False) -> float:
    """Bytes PipelinedLLEP allocates in one forward+backward of one layer, at most.

    Terms: the output and the input gradient ([T, H] each), the probs gradient ([T, E] fp32), the
    routing metadata (64 bytes per token, plus what the schedule keeps per token-expert pair for the
    backward: its token and its element of [T, E] (two int64) and the combine's map (three int32), 28 k
    bytes per token), the local experts' weight gradients (2 x ``expert_param_bytes``, room for spilled experts'
    weights), and one chunk's working set: ``chunk_rows`` rows (at most P * (c + k) per chunk) times
    the dispatch, combine and expert activation rows. Only the first four grow with T. With ``ep`` > 1
    the next chunk's dispatch and the previous chunk's combine are in flight while a chunk computes
    when ``overlap`` is on: two more chunks' rows sent and received (8 H per row). The copy-engine
    transport stays inside that term: its received rows are the same, and its two symmetric slots
    (one hidden row per pair each, sized to a source's largest chunk, at most c_eff + P pairs, under
    ``chunk_rows``, plus 1/16 headroom) replace the sent buffers. Integer inputs give an integer; the
    planner passes its fractional token and expert counts.
    """
    f1 = ffn * (2 if glu else 1)
    per_row = dtype_bytes * ((20 if ep > 1 and overlap else 12) * hidden + 3 * f1 + 4 * ffn) + 64
    per_token = 2 * hidden * dtype_bytes + 4 * num_experts + 8 * 8 + 28 * topk
    return num_tokens * per_token + 2 * expert_param_bytes + chunk_rows * per_row
