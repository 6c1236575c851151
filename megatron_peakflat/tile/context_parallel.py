"""The tiled self-attention sublayer under context parallelism (CP): tiles within each of the rank's two chunks.

Layout (Megatron's load-balanced one, ``attention.context_parallel``): a sequence of s tokens is cut into 2 x CP
chunks of c tokens, and CP rank r holds chunks r and 2CP-1-r, in that order; its x is [2c, b, h]. ``TileOps.qkv``
takes a tile's first row in x, as at CP 1: Megatron's rotary table under CP is already cut to the rank's rows
(``get_pos_emb_on_this_cp_rank``), so row i carries its token's position in the sequence. A tile never spans the
two chunks (at most c tokens), so its queries are consecutive positions of the sequence.

- K/V pass (no graph): each tile's k, v written into buffers K, V of the whole sequence [s, b, g, d]; then both
  all-gathered over the CP group in place (``gather_kv``). Afterwards K, V hold the sequence in order.
- forward: the K/V pass; then each tile's q (its projection recomputed: q is not kept over the K/V pass), its
  queries attending to K[:end], V[:end] (end: the tile's global end; causal, aligned bottom right), projection and
  residual written into the output. Saves x alone.
- backward: (a) the K/V pass again; (b) each tile recomputed with a graph and differentiated against its output
  gradient, every key's gradient (the tile's own rows included) added into fp32 sums dK, dV of the whole
  sequence: a key's gradient is complete only once every rank's queries have added theirs; (c) K, V freed, dK, dV
  reduce-scattered to their owners' rows [2c] (``scatter_kv_grads``) and freed; (d) each tile's k, v recomputed
  with a graph and differentiated against its rows of the reduced sums. dx and the parameters' fp32 gradient sums
  collect (b) and (d).

Per layer and step: K and V all-gathered once per K/V pass (forward; the recompute's forward under full recompute;
backward's (a)), dK and dV reduce-scattered once. Compute beyond the CP 1 schedule: the QKV projection (norm, QKV,
RoPE) of the rank's tokens once more in forward (the K/V pass before the tiles) and once more with its backward
in (d); the attention and the output projection run as often as at CP 1.

No Megatron import; plain torch.distributed (the collectives run in place: no staging copy of the sequence).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..attention.context_parallel import chunks_of_rank
from ..runtime.meter import region
from .ops import TileOps, add_param_grads, param_grads, tile_starts

__all__ = ["TiledSelfAttentionCP", "cp_tile_spans", "gather_kv", "scatter_kv_grads", "group_size"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12+
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Any) -> int:
    """Ranks in ``group``; 1 for None or without torch.distributed."""
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def cp_tile_spans(cp: int, rank: int, c: int, tile: int) -> list[tuple[int, int, int]]:
    """``(row, rows, position)`` of each tile of CP rank ``rank``: its first row in the rank's x [2c, ...], its
    token count and its first position in the sequence; chunk r's tiles, then chunk 2CP-1-r's, each chunk cut
    into tiles of ``min(tile, c)`` tokens (the last one of a chunk may be shorter)."""
    t = min(tile, c)
    return [(half * c + off, min(t, c - off), chunk * c + off)
            for half, chunk in enumerate(chunks_of_rank(cp, rank)) for off in tile_starts(c, t)]


def _staging_row(cp: int, rank: int, c: int, row: int, position: int) -> int:
    """Where the K/V pass writes x's ``row`` (at ``position``) in the whole-sequence buffer before the gather:
    chunk r at its place; chunk 2CP-1-r at slot r of the second half, where an all-gather in rank order puts it
    (``gather_kv`` then reverses the second half's chunks)."""
    return position if row < c else cp * c + rank * c + (row - c)


def _reverse_chunks(buf: torch.Tensor, cp: int, c: int) -> None:
    """Reverse the order of ``buf``'s ``cp`` chunks of c rows in place, one chunk swap at a time (one chunk copied)."""
    for i in range(cp // 2):
        a, b = buf[i * c:(i + 1) * c], buf[(cp - 1 - i) * c:(cp - i) * c]
        held = a.clone()
        a.copy_(b)
        b.copy_(held)
        del held


def gather_kv(bufs: Sequence[torch.Tensor], group: Any, c: int) -> None:
    """All-gather, in place, each whole-sequence buffer [2 CP c, ...] whose rank-own rows the K/V pass wrote at
    their ``_staging_row``: afterwards every buffer holds the sequence in order on every rank.

    The first half of the layout (chunks 0..CP-1) belongs to ranks 0..CP-1 in rank order, so it is one in-place
    all-gather; the second half (chunks CP..2CP-1) belongs to ranks CP-1..0, so it is gathered in rank order from
    slot r and its chunks reversed."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    for buf in bufs:
        for half in (buf[:cp * c], buf[cp * c:]):
            _all_gather(half, half[me * c:(me + 1) * c], group=group)
        _reverse_chunks(buf[cp * c:], cp, c)


def scatter_kv_grads(full: torch.Tensor, group: Any, c: int) -> torch.Tensor:
    """The rank's rows [2c, ...] (chunks r, 2CP-1-r) of ``full`` [2 CP c, ...] (sequence order) summed over the
    group: one reduce-scatter per half of the layout, the second half's chunks reversed in place first (``full``
    is consumed)."""
    cp = dist.get_world_size(group)
    mine = full.new_empty((2 * c, *full.shape[1:]))
    _reduce_scatter(mine[:c], full[:cp * c], group=group)
    _reverse_chunks(full[cp * c:], cp, c)
    _reduce_scatter(mine[c:], full[cp * c:], group=group)
    return mine


def _kv_pass(x: torch.Tensor, ops: TileOps, spans: Sequence[tuple[int, int, int]], group: Any, c: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole sequence: the rank's tiles computed without a graph (q dropped tile by tile), then
    gathered over the group."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    K = V = None
    with torch.no_grad():
        for row, n, pos in spans:
            _, k, v = ops.qkv(x[row:row + n], row)
            del _
            if K is None:
                K = k.new_empty((2 * cp * c, *k.shape[1:]))
                V = v.new_empty((2 * cp * c, *v.shape[1:]))
            at = _staging_row(cp, me, c, row, pos)
            K[at:at + n].copy_(k)
            V[at:at + n].copy_(v)
            del k, v
        gather_kv((K, V), group, c)
    return K, V


class _PrefixSink(torch.autograd.Function):
    """``buf[:end]`` (end = start + the tile's rows), the keys (or values) a tile attends to, whose rows
    start..end already hold the tile's own k_t; backward adds the whole gradient into the fp32 sum ``acc[:end]``
    and hands k_t none (k_t is the anchor into the graph). Under CP a key's gradient is complete only after the
    reduce-scatter, so the tile's own k, v are differentiated later, against the reduced sums."""

    @staticmethod
    def forward(ctx: Any, k_t: torch.Tensor, buf: torch.Tensor, acc: torch.Tensor, start: int) -> torch.Tensor:
        ctx.acc, ctx.end = acc, start + k_t.shape[0]
        return buf[:ctx.end]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.acc[:ctx.end].add_(grad)
        return None, None, None, None


class TiledSelfAttentionCP(torch.autograd.Function):
    """``apply(x, ops, tile, group, *params)``: the sublayer's output [2c, b, h] for this CP rank's share x
    [2c, b, h] (chunks r and 2CP-1-r), over tiles of at most ``tile`` tokens within each chunk, exact against the
    whole sequence's sublayer. ``group``: the CP group (more than one rank); ``params``: every parameter ``ops``
    reads."""

    @staticmethod
    @region("tile")
    def forward(ctx: Any, x: torch.Tensor, ops: TileOps, tile: int, group: Any, *params: torch.Tensor
                ) -> torch.Tensor:
        if x.shape[0] % 2:
            raise ValueError(f"a context-parallel share holds two equal chunks; {x.shape[0]} tokens do not split")
        c = x.shape[0] // 2
        spans = cp_tile_spans(dist.get_world_size(group), dist.get_rank(group), c, tile)
        K, V = _kv_pass(x, ops, spans, group, c)
        out = None
        for row, n, pos in spans:
            q, _, _ = ops.qkv(x[row:row + n], row)
            del _
            o = ops.attend(q, K[:pos + n], V[:pos + n])
            del q
            y = ops.project(o, x[row:row + n])
            del o
            if out is None:
                out = y.new_empty((x.shape[0], *y.shape[1:]))
            out[row:row + n].copy_(y)
            del y
        del K, V
        ctx.save_for_backward(x)
        ctx.ops, ctx.tile, ctx.group, ctx.params = ops, tile, group, params
        return out

    @staticmethod
    @region("tile")
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        ops, group, params = ctx.ops, ctx.group, ctx.params
        c = x.shape[0] // 2
        spans = cp_tile_spans(dist.get_world_size(group), dist.get_rank(group), c, ctx.tile)
        K, V = _kv_pass(x, ops, spans, group, c)  # (a)
        dK = torch.zeros(K.shape, dtype=torch.float32, device=K.device)
        dV = torch.zeros(V.shape, dtype=torch.float32, device=V.device)
        want_x = ctx.needs_input_grad[0]
        dx = torch.zeros_like(x) if want_x else None
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[4 + i]]
        sums: list[torch.Tensor | None] = [None] * len(params)
        placeholder: list[torch.Tensor | None] = [None] * len(params)
        def inputs_of(x_t: torch.Tensor) -> list[torch.Tensor]:
            return ([x_t] if want_x else []) + [params[i] for i in want]

        def collect(rows: slice, got: Sequence[torch.Tensor | None]) -> None:
            got = list(got)
            if want_x:
                g = got.pop(0)
                if g is not None:
                    dx[rows].add_(g)
            add_param_grads(params, want, got, sums, placeholder)

        for row, n, pos in spans:  # (b) the queries' share: every key's gradient into dK, dV
            x_t = x[row:row + n].detach().requires_grad_(want_x)
            with torch.enable_grad():
                q, k_t, v_t = ops.qkv(x_t, row)
                keys = _PrefixSink.apply(k_t, K, dK, pos) if k_t.requires_grad else K[:pos + n]
                values = _PrefixSink.apply(v_t, V, dV, pos) if v_t.requires_grad else V[:pos + n]
                y = ops.project(ops.attend(q, keys, values), x_t)
            del q, k_t, v_t, keys, values
            inputs = inputs_of(x_t)
            if inputs and y.requires_grad:
                collect(slice(row, row + n), torch.autograd.grad([y], inputs, [dy[row:row + n]], allow_unused=True))
            del y, x_t
        del K, V
        dK_mine = scatter_kv_grads(dK, group, c)  # (c)
        del dK
        dV_mine = scatter_kv_grads(dV, group, c)
        del dV
        for row, n, _pos in spans:  # (d) the keys' and values' share, against their reduced gradients
            x_t = x[row:row + n].detach().requires_grad_(want_x)
            with torch.enable_grad():
                _, k_t, v_t = ops.qkv(x_t, row)
            del _
            outputs, grads_out = [], []
            for t_, acc in ((k_t, dK_mine), (v_t, dV_mine)):
                if t_.requires_grad:
                    outputs.append(t_)
                    grads_out.append(acc[row:row + n].to(t_.dtype))
            inputs = inputs_of(x_t)
            if inputs and outputs:
                collect(slice(row, row + n), torch.autograd.grad(outputs, inputs, grads_out, allow_unused=True))
            del outputs, grads_out, k_t, v_t, x_t
        return (dx, None, None, None, *param_grads(params, sums, placeholder))
