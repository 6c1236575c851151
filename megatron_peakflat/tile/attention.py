"""The tiled self-attention sublayer: y = x + proj(attn(rope(qkv(norm(x))))) over query tiles of T tokens.

Untiled, the sublayer holds tensors of size sequence x (heads x head dim) and sequence x hidden for the whole
sequence at once (Q, the attention output, the projections, the norm and their gradients). Here only K and V
(and, in backward, their fp32 gradient sums) are whole; everything else lives for one tile of T tokens.

- forward, no graph kept: tiles in order; each tile's q, k, v; k, v written into whole-sequence buffers K, V;
  the tile's queries attend to K[:end], V[:end] (causal, aligned bottom right: query i of the tile starting at
  ``start`` sees keys 0 .. start + i); projection and residual; written into the output. Saves x alone.
- backward: (a) K, V recomputed for the whole sequence, tile by tile, without a graph; (b) tiles in reverse
  order: the tile's q, k_t, v_t recomputed with a graph from a leaf x_t; the keys are K[:start] (a
  gradient sink) joined to the graph-connected k_t (same for V); attention, projection; one
  ``torch.autograd.grad`` of (y, k_t, v_t) against (dy_t, dK[start:end], dV[start:end]). Later tiles (run
  before, in reverse order) have already added their share to dK/dV of this tile's rows, so one pass suffices.

The parameters are explicit inputs of the Function, and backward returns their gradients summed over the
tiles in fp32 (cast once to the parameter dtype): each parameter's gradient arrives once per step, as DDP's
gradient hooks require (with overlapped gradient reduction a second arrival fails). A parameter whose gradient
the op wrote straight into ``main_grad`` (fused weight-gradient accumulation: ``grad_added_to_main_grad``)
gets the op's own placeholder back, as Megatron's linear layers return it.

Cost: under full recompute the sublayer's forward runs three times per step instead of twice (the first
forward, the checkpoint's recompute, the recompute of (b)), plus one QKV projection of the whole sequence in
(a); its backward runs once. With one tile covering the sequence the numbers are the untiled sublayer's.

Under context parallelism ``context_parallel.TiledSelfAttentionCP`` runs instead (``api.tiled_self_attention``
picks it). With ``--peakflat-report-peaks`` forward and backward are measured as the region ``tile``
(``runtime.meter``). No Megatron import: the integration binds ``TileOps`` to a Megatron layer.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..runtime.meter import region
from .ops import TileOps, add_param_grads, param_grads, tile_starts

__all__ = ["TiledSelfAttention"]


class _JoinKV(torch.autograd.Function):
    """``buf[:end]`` with rows start..end taken from the graph-connected ``k_t``, without copying the prefix.

    Forward writes k_t into ``buf[start:end]`` and returns the view ``buf[:end]``; backward hands
    ``grad[start:end]`` to k_t and adds ``grad[:start]`` into the fp32 sink ``acc[:start]``. A concatenation of
    a leaf prefix with k_t would copy the prefix and return a prefix-sized gradient: two more K-sized tensors
    per tile and per K and V.
    """

    @staticmethod
    def forward(ctx: Any, k_t: torch.Tensor, buf: torch.Tensor, acc: torch.Tensor, start: int) -> torch.Tensor:
        end = start + k_t.shape[0]
        buf[start:end].copy_(k_t)
        ctx.acc, ctx.start = acc, start
        return buf[:end]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        start = ctx.start
        if start:
            ctx.acc[:start].add_(grad[:start])
        return grad[start:], None, None, None


class TiledSelfAttention(torch.autograd.Function):
    """``apply(x, ops, tile, *params)``: the sublayer's output [s, b, h] for input x [s, b, h], over tiles of
    ``tile`` tokens. ``params``: every parameter that ``ops`` reads, so that backward returns their gradients."""

    @staticmethod
    @region("tile")
    def forward(ctx: Any, x: torch.Tensor, ops: TileOps, tile: int, *params: torch.Tensor) -> torch.Tensor:
        s = x.shape[0]
        out = kv = None
        for start in tile_starts(s, tile):
            end = min(s, start + tile)
            q, k, v = ops.qkv(x[start:end], start)
            kv = _store_kv(kv, k, v, start, s)
            del k, v
            o = ops.attend(q, kv[0][:end], kv[1][:end])
            del q
            y = ops.project(o, x[start:end])
            del o
            if out is None:
                out = _seq_buffer(y, s)
            out[start:end].copy_(y)
            del y
        ctx.save_for_backward(x)
        ctx.ops, ctx.tile, ctx.params = ops, tile, params
        return out

    @staticmethod
    @region("tile")
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        ops, tile, params = ctx.ops, ctx.tile, ctx.params
        s = x.shape[0]
        starts = tile_starts(s, tile)
        kv = None
        with torch.no_grad():  # (a) the whole sequence's K and V; q is dropped tile by tile
            for start in starts:
                end = min(s, start + tile)
                _, k, v = ops.qkv(x[start:end], start)
                kv = _store_kv(kv, k, v, start, s)
                del _, k, v
        K, V = kv
        dK = torch.zeros(K.shape, dtype=torch.float32, device=K.device)
        dV = torch.zeros(V.shape, dtype=torch.float32, device=V.device)
        want_x = ctx.needs_input_grad[0]
        dx = torch.empty_like(x) if want_x else None
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        sums: list[torch.Tensor | None] = [None] * len(params)
        placeholder: list[torch.Tensor | None] = [None] * len(params)
        for start in reversed(starts):  # (b) later tiles first: dK/dV of this tile's rows are complete here
            end = min(s, start + tile)
            x_t = x[start:end].detach().requires_grad_(want_x)
            with torch.enable_grad():
                q, k_t, v_t = ops.qkv(x_t, start)
                keys = _JoinKV.apply(k_t, K, dK, start)
                values = _JoinKV.apply(v_t, V, dV, start)
                o = ops.attend(q, keys, values)
                y = ops.project(o, x_t)
            del q, keys, values, o
            inputs = ([x_t] if want_x else []) + [params[i] for i in want]
            outputs, grads_out = [y], [dy[start:end]]
            for t_, acc in ((k_t, dK), (v_t, dV)):
                if t_.requires_grad:
                    outputs.append(t_)
                    grads_out.append(acc[start:end].to(t_.dtype))
            got = torch.autograd.grad(outputs, inputs, grads_out, allow_unused=True) if inputs else ()
            del outputs, grads_out, y, k_t, v_t
            got = list(got)
            if want_x:
                g = got.pop(0)
                if g is None:
                    dx[start:end].zero_()
                else:
                    dx[start:end].copy_(g)
            add_param_grads(params, want, got, sums, placeholder)
            del got
        return (dx, None, None, *param_grads(params, sums, placeholder))


def _store_kv(kv: tuple[torch.Tensor, torch.Tensor] | None, k: torch.Tensor, v: torch.Tensor, start: int,
              s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile's k and v written into the whole-sequence buffers (K, V), which the first tile allocates."""
    if kv is None:
        kv = (_seq_buffer(k, s), _seq_buffer(v, s))
    kv[0][start:start + k.shape[0]].copy_(k)
    kv[1][start:start + v.shape[0]].copy_(v)
    return kv


def _seq_buffer(like: torch.Tensor, s: int) -> torch.Tensor:
    """An uninitialised whole-sequence buffer [s, *like.shape[1:]] of like's dtype and device."""
    return like.new_empty((s, *like.shape[1:]))
