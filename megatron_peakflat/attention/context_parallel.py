"""Causal attention over a sequence split across context-parallel (CP) ranks, K and V all-gathered.

Layout (Megatron's load-balanced one, ``megatron.core.utils.get_batch_on_this_cp_rank``): the sequence is cut
into 2 x CP equal chunks and CP rank r holds chunks r and 2CP-1-r, in that order, so that every rank does the
same causal work. Each rank's tensors are [2c, ...] with c = s / (2 CP).

Per layer (the semantics of Transformer Engine's ``all_gather`` CP communication type):

- K and V are all-gathered over the CP group into the whole sequence, in sequence order (one collective for
  both; under GQA they are the small ones);
- each of the rank's two query chunks attends to the gathered K/V up to the end of its own chunk, with the
  causal mask aligned to that end (``causal_lower_right``: query i of chunk j sees keys up to j c + i), which
  torch runs on flash / memory-efficient kernels where they apply, so no [c, s] mask or scores are built;
- in backward the gradients of the gathered K and V are reduce-scattered back to their owners: summed over the
  rank's two query chunks and reduced onto the owner one sequence chunk at a time.

Memory: the gathered K and V, [s, b, kv_heads, head_dim] each, are held per layer from forward to backward
(SDPA saves them). Backward holds the dK and dV that SDPA returns for the two query chunks, s + c tokens' worth
(c = s / 2CP), the rank's own 2c and one chunk c at a time for the reduce; with an explicit mask each query chunk
sees every key, so 2s tokens' worth from SDPA.

Plain torch and torch.distributed; no Megatron import.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import calls as calls_module

__all__ = ["chunks_of_rank", "split_sequence", "merge_sequence", "gather_sequence", "context_parallel_attention"]

log = logging.getLogger("megatron_peakflat")
_split_said = [False]


def chunks_of_rank(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2 x ``cp`` sequence chunks that CP rank ``rank`` holds, in its order: (r, 2CP-1-r)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {cp}")
    return rank, 2 * cp - 1 - rank


def _check_divisible(length: int, cp: int) -> int:
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x CP = {2 * cp} equal chunks")
    return length // (2 * cp)


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 0) -> torch.Tensor:
    """CP rank ``rank``'s share of the whole sequence ``x`` (sequence along ``dim``): chunks r and 2CP-1-r,
    concatenated, as Megatron's ``get_batch_on_this_cp_rank`` cuts a batch."""
    c = _check_divisible(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, j * c, c) for j in chunks_of_rank(cp, rank)], dim=dim)


def merge_sequence(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The whole sequence from every CP rank's share (``parts`` in rank order): the inverse of ``split_sequence``."""
    cp = len(parts)
    c = parts[0].shape[dim] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        lo, hi = chunks_of_rank(cp, r)
        chunks[lo], chunks[hi] = part.narrow(dim, 0, c), part.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _reduce_scatter(buffer: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``buffer`` [P, *shape] over the group and return this rank's [*shape] (gloo has no reduce-scatter:
    it all-reduces the buffer and keeps its own slice)."""
    P = buffer.shape[0]
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(buffer, group=group)
        return buffer[dist.get_rank(group)].clone()
    out = buffer.new_empty(buffer.shape[1:])
    dist.reduce_scatter_tensor(out, buffer.view(P * buffer.shape[1], *buffer.shape[2:]), group=group)
    return out


def _all_gather_in_order(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every CP rank's [2c, ...] share gathered straight into the whole [2 CP c, ...] sequence, in sequence order:
    each rank's two chunks land in their places (rank, 2CP-1-rank), so the sequence exists once, with no
    rank-major buffer to merge and free."""
    cp = dist.get_world_size(group)
    c = x.shape[0] // 2
    full = x.new_empty((2 * cp * c, *x.shape[1:]))
    for half in (0, 1):
        places = [chunks_of_rank(cp, r)[half] for r in range(cp)]
        dist.all_gather([full[p * c:(p + 1) * c] for p in places], x[half * c:(half + 1) * c].contiguous(),
                        group=group)
    return full


class _GatherSequence(torch.autograd.Function):
    """Forward: every CP rank's [2c, ...] share all-gathered into the whole [2 CP c, ...] sequence, in sequence
    order. Backward: the whole sequence's gradient reduce-scattered (summed over the group) to each share."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather_in_order(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        group = ctx.group
        cp = dist.get_world_size(group)
        shares = torch.stack([split_sequence(grad, cp, r) for r in range(cp)])  # [cp, 2c, ...], rank-major
        return _reduce_scatter(shares, group), None


class _GatherKeyValueChunks(torch.autograd.Function):
    """Forward: every CP rank's K and V ([2c, 2, b, g, d], K and V stacked) all-gathered into the whole sequence,
    returned as the keys and values each of this rank's query chunks attends to: K[:end], V[:end] for each end in
    ``ends`` (views of one gathered buffer). Backward: each sequence chunk's gradient, summed over this rank's
    query chunks, is reduced onto the rank that owns it, chunk by chunk, so that nothing larger than the gradients
    SDPA returned is built (no whole-sequence gradient buffer, no rank-major copy for a reduce-scatter)."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group: dist.ProcessGroup, ends: tuple[int, ...]  # type: ignore[override]
                ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.ends, ctx.c = group, ends, kv.shape[0] // 2
        ctx.shape, ctx.dtype, ctx.device = kv.shape[2:], kv.dtype, kv.device
        full = _all_gather_in_order(kv, group)
        return tuple(t for end in ends for t in (full[:end, 0], full[:end, 1]))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        group, ends, c = ctx.group, ctx.ends, ctx.c
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        pairs = list(zip(ends, grads[0::2], grads[1::2]))
        mine = torch.empty((2 * c, 2, *ctx.shape), dtype=ctx.dtype, device=ctx.device)
        piece = torch.empty((c, 2, *ctx.shape), dtype=ctx.dtype, device=ctx.device)  # one chunk, reused
        for m in range(2 * cp):  # sequence chunk m belongs to rank m (first half) or 2CP-1-m (second half)
            owner, half = (m, 0) if m < cp else (2 * cp - 1 - m, 1)
            piece.zero_()  # after the previous chunk's reduce: a blocking collective orders this stream after it
            for end, gk, gv in pairs:
                if end >= (m + 1) * c:  # this query chunk saw sequence chunk m
                    for slot, g in enumerate((gk, gv)):
                        if g is not None:
                            piece[:, slot] += g[m * c:(m + 1) * c]
            dist.reduce(piece, dst=dist.get_global_rank(group, owner), group=group)
            if owner == me:
                mine[half * c:(half + 1) * c] = piece
        return mine, None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence from every CP rank's share ``x`` [2c, ...] (all-gather forward, reduce-scatter
    backward); ``x`` itself in a group of one."""
    if _group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)


def grouped_heads_taken(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                        bias: torch.Tensor | None = None) -> bool:
    """Whether SDPA runs grouped K/V heads ([b, g, S, d] against [b, h, L, d] queries, ``enable_gqa``) on a fused
    kernel. On CUDA only flash takes them; where flash cannot (fp32 data, a head dim above 256, an explicit mask)
    torch hands the call to its math backend, which materialises [b, h, L, S] scores. Off CUDA (the CPU's kernels
    and math) they are taken as they are."""
    if q.device.type != "cuda":
        return True
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, bias, dropout_p, False, True), False)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dropout_p: float,
            bias: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """SDPA of queries [L, b, h, d] on keys/values [S, b, g, d] (S >= L), returning [L, b, h, d]: with ``bias``
    (additive, [b, 1 or h, L, S]) that mask alone; else causal, the mask aligned to the last key (query i sees
    keys up to S - L + i); with ``causal`` False and no bias, every query sees every key. Grouped K/V heads go to
    the kernel as they are where it takes them, one call per K/V head at long key lengths (``calls.kv_head_calls``:
    flash's backward then expands dK and dV for one group of query heads at a time, not all); elsewhere they are
    repeated to the query heads (O(S) memory) so that the memory-efficient kernel runs, never the O(L S) math
    backend."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    gqa = qb.shape[1] != kb.shape[1]
    if gqa and not grouped_heads_taken(qb, kb, vb, dropout_p, bias):
        repeats = qb.shape[1] // kb.shape[1]
        kb, vb, gqa = kb.repeat_interleave(repeats, dim=1), vb.repeat_interleave(repeats, dim=1), False
    calls = calls_module.kv_head_calls(qb.shape[1], kb.shape[1], kb.shape[0] * kb.shape[2]) if gqa else 1
    if calls == 1:
        return _sdpa(qb, kb, vb, scale, dropout_p, bias, causal, gqa).permute(2, 0, 1, 3)
    per_call = qb.shape[1] // calls
    if not _split_said[0]:  # once per process: the first call's keys are what the line can show
        _split_said[0] = True
        log.info("peakflat attention: grouped K/V heads run as %d SDPA calls of %d query heads each from %d keys on "
                 "(%d here), so flash's backward expands dK/dV for one head group at a time", calls, per_call,
                 calls_module.GROUPED_CALL_MIN_KEYS, kb.shape[0] * kb.shape[2])
    biases = [bias] * calls if bias is None or bias.shape[1] == 1 else bias.split(per_call, dim=1)
    # split, not slicing: one autograd node gathers the calls' dQ/dK/dV (a slice's backward zero-fills a whole one)
    outs = [_sdpa(qg, kg, vg, scale, dropout_p, bg, causal, True).permute(2, 0, 1, 3)
            for qg, kg, vg, bg in zip(qb.split(per_call, dim=1), kb.split(1, dim=1), vb.split(1, dim=1), biases)]
    return torch.cat(outs, dim=2)


def _sdpa(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, scale: float | None, dropout_p: float,
          bias: torch.Tensor | None, causal: bool, gqa: bool) -> torch.Tensor:
    """One SDPA call on [b, heads, len, d] operands, with ``_attend``'s mask rules."""
    L, S = qb.shape[2], kb.shape[2]
    if bias is not None or not causal:
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    if L == S:
        return F.scaled_dot_product_attention(qb, kb, vb, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=causal_lower_right(L, S), dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               group: dist.ProcessGroup | None, *, scale: float | None = None,
                               dropout_p: float = 0.0, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's share of the sequence, exact against full-sequence causal attention.

    ``query`` [2c, b, heads, d], ``key``/``value`` [2c, b, groups, d] (``groups`` divides ``heads``): this rank's
    chunks r and 2CP-1-r in Megatron's layout. Returns [2c, b, heads, d] in the same layout. In a group of one
    it is plain causal SDPA. Gradients flow to ``query``, ``key`` and ``value`` (dK, dV reduce-scattered over
    the group).
    ``attn_bias``: an additive mask in place of the causal one, [b, 1 or heads, 2c, s]: this rank's query rows
    (its layout) over every key of the sequence (in sequence order); each chunk then attends to all s keys."""
    cp = _group_size(group)
    if query.shape[0] != key.shape[0] or key.shape != value.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)}: the "
                         "three must hold the same tokens, and key and value one shape")
    if query.shape[2] % key.shape[2]:
        raise ValueError(f"{key.shape[2]} key/value heads do not divide {query.shape[2]} query heads")
    if cp == 1:
        return _attend(query, key, value, scale, dropout_p, attn_bias)
    if query.shape[0] % 2:
        raise ValueError(f"a context-parallel share holds two equal chunks; {query.shape[0]} tokens do not split")
    c = query.shape[0] // 2
    s = 2 * cp * c
    if attn_bias is not None and tuple(attn_bias.shape[-2:]) != (2 * c, s):
        raise ValueError(f"attn_bias {tuple(attn_bias.shape)} must end in [{2 * c}, {s}]: this rank's "
                         "queries over the whole sequence")
    # each query chunk sees the keys up to the end of its own chunk; with a mask, the mask decides (every key)
    ends = (s, s) if attn_bias is not None else tuple((j + 1) * c for j in chunks_of_rank(cp, dist.get_rank(group)))
    kv = _GatherKeyValueChunks.apply(torch.stack([key, value], dim=1), group, ends)
    outs = []
    for i in range(2):
        rows = slice(i * c, (i + 1) * c)
        bias = None if attn_bias is None else attn_bias[..., rows, :]
        outs.append(_attend(query[rows], kv[2 * i], kv[2 * i + 1], scale, dropout_p, bias))
    return torch.cat(outs, dim=0)
