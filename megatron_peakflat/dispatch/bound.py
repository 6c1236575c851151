"""PipelinedLLEP's chunk count and working-set bound as plain arithmetic (no torch import), shared by
the component (``api.working_set_bound``) and the memory planner (``memory/model.py``)."""

from __future__ import annotations

__all__ = ["chunk_count", "overlap_on", "working_set_bound"]


def chunk_count(num_tokens: int, max_pairs_per_token: int, chunk_cap: int, max_chunks: int) -> int:
    """K on one rank: enough chunks that ``ceil(T / K) * k <= chunk_cap``, at most ``max_chunks``.

    The host twin of the device arithmetic in ``schedule.build_schedule`` (which avoids a sync), for
    planners; ``build_schedule`` then takes the max over the group.
    """
    tokens_per_chunk = max(1, chunk_cap // max(1, max_pairs_per_token))
    return int(min(max_chunks, max(1, -(-num_tokens // tokens_per_chunk))))


def overlap_on(forced: bool, min_chunks: int, num_chunks: int, ep: int) -> bool:
    """Whether a layer call of ``num_chunks`` chunks keeps its neighbours' all-to-alls in flight: only at
    ``ep`` > 1 (a group of one sends nothing), always when ``forced`` (--peakflat-dispatch-overlap), else
    when the call has at least ``min_chunks`` chunks (0: never). The extra buffers are a fixed number of
    chunk rows, so the more chunks a call needs the smaller their share of what one chunk would hold."""
    return ep > 1 and (forced or (min_chunks > 0 and num_chunks >= min_chunks))


def working_set_bound(*, num_tokens: float, hidden: int, ffn: int, num_experts: int, topk: int, chunk_rows: float,
                      expert_param_bytes: float, dtype_bytes: int, glu: bool = True, ep: int = 1,
                      overlap: bool = False) -> float:
    """Bytes PipelinedLLEP allocates in one forward+backward of one layer, at most.

    Terms: the output and the input gradient ([T, H] each), the probs gradient ([T, E] fp32), the
    routing metadata (64 bytes per token, plus what the schedule keeps per token-expert pair for the
    backward: its token and expert (two int64) and the combine's map (three int32), 28 k bytes per
    token), the local experts' weight gradients (2 x ``expert_param_bytes``, room for spilled experts'
    weights), and one chunk's working set: ``chunk_rows`` rows (at most P * (c + k) per chunk) times
    the dispatch, combine and expert activation rows. Only the first four grow with T. With ``ep`` > 1
    the next chunk's dispatch and the previous chunk's combine are in flight while a chunk computes
    when ``overlap`` is on: two more chunks' rows sent and received (8 H per row). Integer inputs give
    an integer; the planner passes its fractional token and expert counts.
    """
    f1 = ffn * (2 if glu else 1)
    per_row = dtype_bytes * ((20 if ep > 1 and overlap else 12) * hidden + 3 * f1 + 4 * ffn) + 64
    per_token = 2 * hidden * dtype_bytes + 4 * num_experts + 8 * 8 + 28 * topk
    return num_tokens * per_token + 2 * expert_param_bytes + chunk_rows * per_row
