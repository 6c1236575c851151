"""PipelinedLLEP's chunk count and working-set bound as plain arithmetic (no torch import), shared by
the component (``api.working_set_bound``) and the memory planner (``planner/model.py``)."""

from __future__ import annotations

__all__ = ["chunk_count", "split_floor", "overlap_on", "flow_chunk_rows", "working_set_bound", "HOSTED_FRACTION",
           "SEGMENT_PIECE_MIN_ROWS", "segment_piece_rows",
           "hosted_expert_bytes", "auto_max_foreign", "hosting_capped", "weight_sends_bound"]

HOSTED_FRACTION = 0.25
"""--peakflat-dispatch-max-foreign-experts auto: the experts a rank hosts for other ranks take at most this
share of one chunk's dispatch and combine rows at the cap (EP x c rows of 12 x hidden elements)."""


SEGMENT_PIECE_MIN_ROWS = 256
"""The per-expert path's smallest expert call: below this many rows a call's fixed cost outweighs its memory."""


def segment_piece_rows(chunk_rows: int, num_local_experts: int) -> int:
    """The most rows one expert call of the per-expert path takes (grouped GEMMs off, or not bf16): the chunk's rows
    over the rank's local experts, what each gets under balanced routing, and at least ``SEGMENT_PIECE_MIN_ROWS``.
    An expert with more rows in the chunk runs in pieces of this size, so one call's transients (the activation's
    gradients, fc1's output gradient, dX) stay bounded whatever the routing; skewed routing costs more calls, not
    more memory."""
    return max(SEGMENT_PIECE_MIN_ROWS, -(-int(chunk_rows) // max(1, int(num_local_experts))))


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


def hosting_capped(max_foreign: int | None, ep: int, num_local_experts: int) -> bool:
    """Whether a limit of ``max_foreign`` hosted experts per rank can ever refuse a spill: only when it is
    below the (P - 1) x E_p foreign experts a rank could host (None: no limit)."""
    return max_foreign is not None and ep > 1 and max_foreign < (ep - 1) * num_local_experts


def flow_chunk_rows(*, pairs_per_rank: float, ep: int, chunk_cap: int, max_chunks: int, alpha: float,
                    imbalance_threshold: float, min_spill: int, num_local_experts: int = 1,
                    max_foreign: int | None = None) -> int:
    """The most rows one rank receives in one chunk of per-flow (``"expert"``) chunks, whatever the
    routing, when no rank sends more than ``pairs_per_rank`` token-expert pairs.

    Why: with n_max the most pairs of any source and K >= n_max / c_eff its chunks (c_eff: the cap, or
    ``pairs_per_rank / max_chunks`` where K hit its limit), every flow puts at most ceil(n_sd / K) pairs
    into a chunk, so rank d receives at most load_d / K + P per chunk. The least-loaded plan keeps
    load_d <= max(lambda * mean, ceil(alpha * mean), mean + (P - 1) * m) + R_d with mean <= n_max: below
    lambda it is plain EP; above, a rank takes spills only up to the capacity ceil(alpha * mean), and a
    remainder that no rank has room for (every other rank within m of the capacity) goes to the
    least-loaded rank that may host it, which then holds less than mean + (P - 1) * m
    (``plan.least_loaded_plan``). R_d is what the hosting limit ``max_foreign`` (per rank, over the
    ``num_local_experts`` E_p of each rank) keeps at home: a spill stays on its owner only when a rank
    with room already hosts ``max_foreign`` other experts, visited earlier and so each at least the load
    n_1 of the owner's first refused expert; the at most E_p refused ones hold no more than n_1 each, and
    every load sums to P * mean, so R_d <= min(E_p * n_1, P * mean - max_foreign * n_1)
    <= E_p * P * mean / (E_p + max_foreign); 0 when the limit cannot bind (``hosting_capped``). Hence
    ``ceil((max(alpha, lambda) + R / mean) * c_eff) + (P - 1) * m + P + 1`` rows; at EP=1, c_eff. Far below
    P * (c + k) at large P (the bound of strided and hybrid chunks, which route each chunk by the plan's
    proportions, and of any membership whatever the plan: callers take the smaller) unless the hosting
    limit keeps much at home.
    """
    c_eff = max(int(chunk_cap), -(-int(pairs_per_rank) // max(1, int(max_chunks))))
    if ep <= 1:
        return c_eff
    e_p = max(1, int(num_local_experts))
    kept = e_p * ep / (e_p + max_foreign) if hosting_capped(max_foreign, ep, e_p) else 0.0  # type: ignore[operator]
    return int(-(-(max(alpha, imbalance_threshold) + kept) * c_eff // 1)) + (ep - 1) * int(min_spill) + ep + 1


def hosted_expert_bytes(expert_numel: float, dtype_bytes: int) -> float:
    """Bytes one hosted (foreign) expert costs its helper at most, at once: its weights (received in forward
    and again in backward) and the fp32 sum of their gradient over the chunks; once the chunks are done the
    weights are dropped, and the gradient it sends home takes their place (written from the fp32 sum, which
    is then freed)."""
    return expert_numel * (dtype_bytes + 4)


def auto_max_foreign(*, ep: int, num_local_experts: int, chunk_cap: int, hidden: int, dtype_bytes: int,
                     expert_numel: int, weight_bytes: int | None = None, fraction: float = HOSTED_FRACTION) -> int:
    """--peakflat-dispatch-max-foreign-experts auto: the most foreign experts whose ``hosted_expert_bytes``
    fit in ``fraction`` of one chunk's dispatch and combine rows at the cap (EP x c rows of 12 x hidden
    elements, the first term of the chunk's working set), and at most the (P - 1) x E_p a rank could host.
    0 where one expert's weights cost more than that: no weights move, and the plan keeps every expert home.
    ``dtype_bytes``: the rows' element size; ``weight_bytes``: the weights' (None: the same)."""
    if ep <= 1:
        return 0
    budget = fraction * ep * chunk_cap * 12 * hidden * dtype_bytes
    per = hosted_expert_bytes(expert_numel, dtype_bytes if weight_bytes is None else weight_bytes)
    return int(min((ep - 1) * num_local_experts, budget // per if per > 0 else (ep - 1) * num_local_experts))


def weight_sends_bound(ep: int, num_local_experts: int, max_foreign: int | None) -> int:
    """The most expert-weight copies one rank sends per layer call (one per (helper, expert) pair).

    Why: each helper hosts at most min(E_p, ``max_foreign``) of one owner's experts; and every spill but an
    expert's last one fills its helper to the capacity, which no rank reaches twice
    (``plan.least_loaded_plan``), so one owner's E_p experts make at most (P - 1) + E_p spills."""
    if ep <= 1:
        return 0
    per_helper = num_local_experts if max_foreign is None else min(num_local_experts, max_foreign)
    return int(min((ep - 1) * per_helper, ep - 1 + num_local_experts))


def working_set_bound(*, num_tokens: float, hidden: int, ffn: int, num_experts: int, topk: int, chunk_rows: float,
                      expert_param_bytes: float, dtype_bytes: int, glu: bool = True, ep: int = 1,
                      overlap: bool = False, expert_numel: float = 0, hosted: float = 0, sent: float = 0) -> float:
    """Bytes PipelinedLLEP allocates in one forward+backward of one layer, at most.

    Terms: the output and the input gradient ([T, H] each), the probs gradient ([T, E] fp32), the
    routing metadata (64 bytes per token, plus what the schedule keeps per token-expert pair for the
    backward: its token and its element of [T, E] (two int64) and the combine's map (three int32), 28 k
    bytes per token), the local experts' weight gradients (2 x ``expert_param_bytes``: their fp32 sums
    and what they return), the moved experts' weights, and one chunk's working set: ``chunk_rows`` rows
    (at most P * (c + k) per chunk) times the dispatch, combine and expert activation rows. Only the
    first four grow with T. With ``ep`` > 1 the next chunk's dispatch and the previous chunk's combine
    are in flight while a chunk computes when ``overlap`` is on: two more chunks' rows sent and received
    (8 H per row). The copy-engine transport stays inside that term: its received rows are the same, and
    its two symmetric slots (one hidden row per pair each, sized to a source's largest chunk, at most
    c_eff + P pairs, under ``chunk_rows``, plus 1/16 headroom) replace the sent buffers.

    Moved experts (``expert_numel`` elements each): a rank hosting ``hosted`` foreign experts holds, at
    most at once, their weights or the gradients it sends home, and the fp32 sums of their gradients
    (``hosted_expert_bytes`` each); a rank sending ``sent`` weight copies (``weight_sends_bound``) holds one
    expert's bytes per copy, in its send buffer (forward, and again in backward) or in what it receives
    back. The sum covers every phase: the exchanges run while no chunk is alive, and a rank may be
    both. Integer inputs give an integer; the planner passes its fractional token and expert counts.
    """
    f1 = ffn * (2 if glu else 1)
    per_row = dtype_bytes * ((20 if ep > 1 and overlap else 12) * hidden + 3 * f1 + 4 * ffn) + 64
    per_token = 2 * hidden * dtype_bytes + 4 * num_experts + 8 * 8 + 28 * topk
    moved = hosted * hosted_expert_bytes(expert_numel, dtype_bytes) + sent * expert_numel * dtype_bytes
    return num_tokens * per_token + 2 * expert_param_bytes + moved + chunk_rows * per_row
