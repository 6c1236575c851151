"""Ring-DTP with its gradients computed in the forward pass (``grad='in-forward'``): the 'gather' schedule.

The recompute schedules (``ring.py``) cost 8NHV: the forward folds every block of logits into an
online log-sum-exp, and the backward recomputes each block before its two gradient matmuls. Megatron's
vocab-parallel cross-entropy costs 6NHV because it keeps all [N, V/P] logits (and an fp32 softmax).
This schedule costs 6NHV and keeps one chunk of them: the tokens go through in chunks, each chunk's
logits against this rank's shard exist once, their log-sum-exp is completed across the ranks (one
small all-gather of the per-rank (max, sum-exp, target, sum) state), and the same block is turned into
its gradient at once: dX (a reduce-scatter of the chunk's partial dX to the tokens' owners) and dW
(added into the weight's ``main_grad`` or an fp32 accumulator). The working set is one
[chunk, V/P] block of logits and the chunk's hidden states, whatever N and V.

A gradient computed in the forward pass needs the gradient of each token's loss before backward
gives it. The caller passes it as ``grad_hint`` (for Megatron: ``loss_mask`` times the loss scale over
the token count and the number of microbatches, ``integration/vocab.py``). Backward checks the hint
against the real gradient (one host sync). When they differ, the difference is added by the
recompute schedule with the real-minus-hinted gradient as its upstream gradient, so dX and dW are
always those of the real gradient (the loss is linear in its upstream gradient); only the time of
the recompute is lost, and a warning says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist

from .. import stats
from ..main_grad import main_grad_of
from ..matmul import accumulate_mm
from ..runtime.meter import region
from .ring import RingPlan, SavedPlan, auto_ring_schedule, backward_ring, coefficients, finish_loss, max_over_ring, new_state

__all__ = ["InForwardLinearCrossEntropy", "forward_with_grads", "HINT_RTOL", "hint_matches", "chunk_rows"]

log = logging.getLogger("megatron_peakflat")

HINT_RTOL = 2.0 ** -20
"""A real gradient within this relative distance of the hint counts as the hint (float noise of the
same scale computed in a different order); a larger difference is added by the recompute path."""


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12+
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_rows(chunk_tokens: int, ring_size: int) -> int:
    """Rows of its own tokens that each of the ``ring_size`` ranks contributes to one chunk."""
    return max(1, math.ceil(chunk_tokens / ring_size))


def _merge_states(states: torch.Tensor) -> torch.Tensor:
    """Merge the [P, 4, c] per-shard (max, sum-exp, target, sum) states into one [4, c] state."""
    m = states[:, 0].amax(dim=0)
    finite = torch.isfinite(m)
    safe = torch.where(finite, m, torch.zeros_like(m))
    scale = torch.where(torch.isfinite(states[:, 0]), torch.exp(states[:, 0] - safe), torch.zeros_like(states[:, 0]))
    s = (states[:, 1] * scale).sum(dim=0)
    return torch.stack([m, s, states[:, 2].sum(dim=0), states[:, 3].sum(dim=0)])


def _pad_rows(t: torch.Tensor, rows: int, value: float | int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_full((rows, *t.shape[1:]), value)
    out[: t.shape[0]] = t
    return out


class _Chunk:
    """One chunk's tokens from every ring rank: hidden states, labels and hinted gradients, in flight
    (all-gathers posted asynchronously, so the next chunk's arrive while this one computes)."""

    def __init__(self, plan: RingPlan, x: torch.Tensor, labels: torch.Tensor, ws: torch.Tensor, lo: int, rows: int):
        P = plan.size
        self._works: list = []
        if P == 1:  # views, no padding
            self.x, self.labels, self.ws = x[lo:lo + rows], labels[lo:lo + rows], ws[lo:lo + rows]
            return
        own = [_pad_rows(x[lo:lo + rows], rows, 0), _pad_rows(labels[lo:lo + rows], rows, -1),
               _pad_rows(ws[lo:lo + rows], rows, 0.0)]
        self.x, self.labels, self.ws = (t.new_empty((P * rows, *t.shape[1:])) for t in own)
        self._works = [_all_gather(out, t, group=plan.group, async_op=True)
                       for out, t in zip((self.x, self.labels, self.ws), own)]

    def wait(self) -> "_Chunk":
        for w in self._works:
            w.wait()
        self._works = []
        return self


def _state_across_ring(plan: RingPlan, st: torch.Tensor) -> torch.Tensor:
    if plan.size == 1:
        return st
    every = st.new_empty((plan.size * st.shape[0], st.shape[1]))
    _all_gather(every, st.contiguous(), group=plan.group)
    return _merge_states(every.view(plan.size, *st.shape))


def forward_with_grads(plan: RingPlan, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ws: torch.Tensor,
                       dw_sink: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss [n] and lse [n] (fp32) of this rank's tokens, their dX [n, h] (x's dtype) for the
    upstream gradient ``ws`` [n], and this shard's dW for it added into ``dw_sink`` [v_p, h].

    ``labels`` have ignored tokens as -1 (``ws`` is 0 there). ``rows``: own tokens per chunk (the same
    on every rank). Collective over ``plan.group``: every rank runs ``ceil(max(tokens) / rows)`` chunks.
    """
    P, r = plan.size, plan.rank
    n, h = x.shape
    own_start = plan.start(r)
    n_chunks = math.ceil(max(plan.tokens) / rows) if max(plan.tokens) else 0
    loss = torch.zeros(n, dtype=torch.float32, device=x.device)
    lse_out = torch.zeros(n, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    acc = plan.acc_dtype(x)
    pending: tuple | None = None  # the previous chunk's dX reduce-scatter, finished one chunk later

    def land(p: tuple | None) -> None:
        if p is None:
            return
        work, part, lo, m = p
        work.wait()
        dx[lo:lo + m] = part[:m]

    nxt = _Chunk(plan, x, labels, ws, 0, rows) if n_chunks else None
    for j in range(n_chunks):
        cur = nxt.wait()
        lo = j * rows
        m = max(0, min(rows, n - lo))
        nxt = _Chunk(plan, x, labels, ws, lo + rows, rows) if j + 1 < n_chunks else None
        z = cur.x @ w.t()
        local = cur.labels - own_start
        if P == 1:  # the block holds whole rows: one pass folds it and turns it into its gradient
            st = torch.empty(4, z.shape[0], dtype=torch.float32, device=x.device)  # fold_grad writes it whole
            d = plan.ops.fold_grad(z, local, st, cur.ws, plan.label_smoothing, plan.vocab_size)
            chunk_loss, lse = finish_loss(plan, st, cur.labels >= 0)
        else:
            st = new_state(z.shape[0], x.device)
            plan.ops.fold(z, local, st)
            chunk_loss, lse = finish_loss(plan, _state_across_ring(plan, st), cur.labels >= 0)
            d = plan.ops.grad(z, local, coefficients(plan, lse, cur.ws))
        del z
        mine = slice(r * rows, r * rows + m) if P > 1 else slice(0, m)
        loss[lo:lo + m] = chunk_loss[mine]
        lse_out[lo:lo + m] = lse[mine]
        if P == 1:
            torch.mm(d, w, out=dx[lo:lo + m])
        else:
            part = torch.zeros(d.shape[0], h, dtype=acc, device=x.device)
            accumulate_mm(part, d, w)
            mine_part = part.new_empty(rows, h)
            work = _reduce_scatter(mine_part, part, group=plan.group, async_op=True)
            land(pending)
            pending = (work, mine_part, lo, m)
        accumulate_mm(dw_sink, d.t(), cur.x)
        del d
    land(pending)
    stats.add("vocab", "in_forward_chunks", n_chunks)
    return loss, lse_out, dx


def hint_matches(plan: RingPlan, g: torch.Tensor, ws: torch.Tensor) -> bool:
    """Whether the real per-token gradient ``g`` is the hint ``ws`` (within ``HINT_RTOL``) on every
    ring rank. One host sync (and a one-element all-reduce on a ring): every rank must take the same
    branch, since the recompute is collective."""
    bad = ((g - ws).abs() > HINT_RTOL * ws.abs()).any().to(torch.int32)
    return not max_over_ring(bad, plan.group if plan.size > 1 else None, g.device)


class InForwardLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [n] (fp32), with dX and dW computed in the forward pass for the upstream gradient
    ``grad_hint`` [n] (fp32, 0 where ignored). Same contract as ``ring.RingLinearCrossEntropy``; the
    gradients are those of the real upstream gradient whatever the hint (see the module docstring)."""

    @staticmethod
    @region("vocab")
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                grad_hint: torch.Tensor, plan: RingPlan) -> torch.Tensor:
        sink = plan.main_grad_sink(weight, weight.requires_grad)
        if sink is None:
            sink = torch.zeros(weight.shape, dtype=plan.acc_dtype(weight), device=weight.device)
            ctx.dw = sink
        else:
            ctx.dw = None
        ws = torch.where(valid, grad_hint, torch.zeros((), dtype=grad_hint.dtype, device=grad_hint.device))
        loss, lse, dx = forward_with_grads(plan, hidden, weight, labels, ws, sink, plan.chunk_rows)
        ctx.dx = dx
        ctx.save_for_backward(hidden, weight, labels, valid, lse, ws)
        ctx.plan = SavedPlan.of(plan)  # the group held weakly: the graph may outlive it
        return loss

    @staticmethod
    @region("vocab")
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, labels, valid, lse, ws = ctx.saved_tensors
        plan = ctx.plan.get()
        dx, dw = ctx.dx, ctx.dw
        ctx.dx = ctx.dw = None
        g = torch.where(valid, grad_loss.float(), torch.zeros((), device=grad_loss.device))
        if not hint_matches(plan, g, ws):
            stats.add("vocab", "hint_corrections", 1)
            log.warning("peakflat vocab: the in-forward gradient's hint was not the loss's real gradient (largest "
                        "difference %.3g); the difference was added by recomputing the logits. If this repeats, "
                        "use --peakflat-vocab-grad recompute", float((g - ws).abs().max()), extra={"per_rank": True})
            sink = main_grad_of(weight) if dw is None else dw
            ring = plan if plan.schedule != "gather" else dataclasses.replace(
                plan, schedule=auto_ring_schedule(max(plan.tokens), plan.vocab_size, plan.size))
            dx_fix, _ = backward_ring(ring, hidden, weight, labels, coefficients(plan, lse, g - ws), sink)
            dx = dx + dx_fix
        if dw is None:
            return dx, plan.handed_over(weight), None, None, None, None
        return dx, dw.to(weight.dtype), None, None, None, None
