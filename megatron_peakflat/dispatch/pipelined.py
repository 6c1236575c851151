"""Chunked dispatch -> experts -> combine, as one autograd Function recomputed chunk by chunk.

Forward runs the K chunks one after another (dispatch all-to-all, experts, combine all-to-all,
accumulate into the output) under no_grad and keeps only the routing metadata. Backward runs the
chunks again: it re-dispatches the chunk's rows and output gradients, recomputes the experts with
grad, backpropagates, and sends the row and prob gradients home. So only one chunk's expert
activations are ever alive, in forward and in backward.

Exactness: every token-expert pair is computed by the same expert math on the same weights as an
unchunked MoE; only the summation order of a token's k expert outputs (and of each expert's weight
gradient over chunks) changes. Gradients of spilled experts' weights are computed on the helper
and added at the owner.

Weight gradients: each chunk's backward runs on detached aliases of the expert weights, whose
post-accumulate hooks take each weight's gradient as soon as autograd produces it, so at most one
expert weight's gradient is in flight. A parameter with Megatron DDP's ``main_grad`` gets it added
there in fp32 (as gradient-accumulation fusion does) and returns a zero dummy with
``grad_added_to_main_grad`` set, so DDP's hook fires once per backward and adds nothing twice.
Other parameters get their gradient summed over chunks in fp32 and returned through autograd, once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from . import comm
from .experts import ExpertBank, exchange_weights, flatten_weights, return_weight_grads, unflatten_weights
from .schedule import Schedule
from ..memory.meter import region

__all__ = ["pipelined_moe"]


def _segments(sched: Schedule, bank: ExpertBank, foreign: dict[int, torch.Tensor]
              ) -> tuple[list[int | None], list[list[torch.Tensor] | None]]:
    like = bank.expert_params(0)
    base = sched.rank * sched.num_local_experts
    local: list[int | None] = []
    weights: list[list[torch.Tensor] | None] = []
    for e in sched.compute_experts:
        if base <= e < base + sched.num_local_experts:
            local.append(e - base)
            weights.append(None)
        else:
            local.append(None)
            weights.append(unflatten_weights(foreign[e], like))
    return local, weights


def _main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """Megatron DDP's fp32 gradient buffer of ``p``, when it has one and its hook honours grad_added_to_main_grad."""
    if hasattr(p, "grad_added_to_main_grad"):
        return getattr(p, "main_grad", None)
    return None


def _dispatch(sched: Schedule, j: int, rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = comm.all_to_all(rows, sched.send_splits[j], sched.recv_splits[j], group)
    idx = sched.regroup[j]
    return out if idx is None else out.index_select(0, idx)


def _combine(sched: Schedule, j: int, rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    idx = sched.regroup[j]
    if idx is not None:
        rows = torch.empty_like(rows).index_copy_(0, idx, rows)
    return comm.all_to_all(rows, sched.recv_splits[j], sched.send_splits[j], group)


class _PipelinedMoE(torch.autograd.Function):
    @staticmethod
    @region("dispatch")
    def forward(ctx: Any, x: torch.Tensor, probs: torch.Tensor, sched: Schedule, bank: ExpertBank,
                group: dist.ProcessGroup | None, *params: torch.Tensor) -> torch.Tensor:
        foreign = exchange_weights(sched, bank, group)
        local, weights = _segments(sched, bank, foreign)
        out = torch.zeros_like(x)
        with torch.no_grad():
            for j in range(sched.K):
                a, b = sched.chunk_offsets[j], sched.chunk_offsets[j + 1]
                tok, exp = sched.pair_token[a:b], sched.pair_expert[a:b]
                xr = _dispatch(sched, j, x.index_select(0, tok), group)
                pr = _dispatch(sched, j, probs[tok, exp], group)
                y = bank.compute(xr, pr, sched.tokens_per_expert[j], local, weights)
                del xr, pr
                out.index_add_(0, tok, _combine(sched, j, y, group))
                del y
        del foreign, weights
        ctx.sched, ctx.bank, ctx.group, ctx.n_params = sched, bank, group, len(params)
        ctx.save_for_backward(x, probs)
        return out

    @staticmethod
    @region("dispatch")
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sched: Schedule = ctx.sched
        bank: ExpertBank = ctx.bank
        group = ctx.group
        x, probs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        foreign = exchange_weights(sched, bank, group)
        local, weights = _segments(sched, bank, foreign)
        like = bank.expert_params(0)
        m = len(like)
        gx = torch.zeros_like(x)
        gp = torch.zeros_like(probs)
        # Weight gradients leave autograd one tensor at a time (a hook on a per-chunk alias of each
        # weight), so no chunk ever holds every expert's gradient at once.
        acc: dict[tuple[int, int], torch.Tensor] = {}  # (compute-expert position, param) -> fp32 sum

        def sink(i: int, k: int, main_grad: torch.Tensor | None) -> Callable[[torch.Tensor], None]:
            def hook(alias: torch.Tensor) -> None:
                g = alias.grad
                alias.grad = None
                if main_grad is not None:
                    main_grad.add_(g)
                elif (i, k) in acc:
                    acc[i, k].add_(g)
                else:
                    acc[i, k] = g.float()
            return hook

        for j in range(sched.K):
            a, b = sched.chunk_offsets[j], sched.chunk_offsets[j + 1]
            tok, exp = sched.pair_token[a:b], sched.pair_expert[a:b]
            xr = _dispatch(sched, j, x.index_select(0, tok), group).detach().requires_grad_(True)
            gr = _dispatch(sched, j, grad_out.index_select(0, tok), group)
            pr = _dispatch(sched, j, probs[tok, exp], group).detach().requires_grad_(True)
            tpe = sched.tokens_per_expert[j]
            seg_weights: list[list[torch.Tensor] | None] = []
            aliases: list[torch.Tensor] = []
            for i, n in enumerate(tpe):
                if n == 0:
                    seg_weights.append(None)
                    continue
                own = local[i] is not None
                ws = []
                for k, p in enumerate(bank.expert_params(local[i]) if own else weights[i]):
                    if own and not p.requires_grad:
                        ws.append(p)
                        continue
                    alias = p.detach().requires_grad_(True)
                    alias.register_post_accumulate_grad_hook(sink(i, k, _main_grad(p) if own else None))
                    ws.append(alias)
                    aliases.append(alias)
                seg_weights.append(ws)
            with torch.enable_grad():
                y = bank.compute(xr, pr, tpe, [None] * len(tpe), seg_weights)
            if y.requires_grad:
                torch.autograd.backward(y, gr, inputs=[xr, pr, *aliases])
            del y, gr, aliases, seg_weights
            dx = xr.grad if xr.grad is not None else torch.zeros_like(xr)
            dp = pr.grad if pr.grad is not None else torch.zeros_like(pr)
            del xr, pr
            # Every rank runs both combines for every chunk, rows or not: the collectives stay matched.
            gx.index_add_(0, tok, _combine(sched, j, dx, group))
            gp.index_put_((tok, exp), _combine(sched, j, dp, group), accumulate=True)
            del dx, dp
        base = sched.rank * sched.num_local_experts
        out_grads: list[torch.Tensor | None] = [None] * ctx.n_params
        foreign_parts: dict[int, list[torch.Tensor | None]] = {}
        for (i, k), g in acc.items():
            if local[i] is not None:
                out_grads[local[i] * m + k] = g  # fp32 until every contribution is in
            else:
                foreign_parts.setdefault(sched.compute_experts[i], [None] * m)[k] = g
        foreign_grads: dict[int, torch.Tensor] = {}
        for i, e in enumerate(sched.compute_experts):
            if e in foreign_parts:
                foreign_grads[e] = flatten_weights([g.to(w.dtype) if g is not None else torch.zeros_like(w)
                                                    for g, w in zip(foreign_parts[e], weights[i])])
        del acc, foreign_parts
        del foreign, weights
        back = return_weight_grads(sched, foreign_grads, bank, group)
        for e, flat in back.items():
            li = e - base
            for k, g in enumerate(unflatten_weights(flat, like)):
                mg = _main_grad(bank.expert_params(li)[k])
                if mg is not None:
                    mg.add_(g)
                    continue
                cur = out_grads[li * m + k]
                out_grads[li * m + k] = g.float() if cur is None else cur.add_(g)
        for idx, needed in enumerate(ctx.needs_input_grad[5:]):
            p = bank.expert_params(idx // m)[idx % m]
            if not needed:
                out_grads[idx] = None
            elif _main_grad(p) is not None:
                # Megatron DDP: the gradient is already in main_grad (as with gradient-accumulation
                # fusion); a one-element dummy lets the DDP hook fire once without adding it again.
                p.grad_added_to_main_grad = True
                out_grads[idx] = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            elif out_grads[idx] is None:  # an expert without rows: zero, as Megatron's SequentialMLP gives
                out_grads[idx] = torch.zeros_like(p)
            else:
                out_grads[idx] = out_grads[idx].to(p.dtype)
        return (gx if ctx.needs_input_grad[0] else None, gp if ctx.needs_input_grad[1] else None,
                None, None, None, *out_grads)


def pipelined_moe(x: torch.Tensor, probs: torch.Tensor, sched: Schedule, bank: ExpertBank,
                  group: dist.ProcessGroup | None) -> torch.Tensor:
    """The MoE output [T, H] for rows ``x`` [T, H] with dense ``probs`` [T, E], under schedule ``sched``.

    Gradients flow to ``x``, ``probs`` (at routed entries) and every local expert parameter of ``bank``.
    """
    params: list[torch.Tensor] = []
    for i in range(bank.num_local_experts):
        params.extend(bank.expert_params(i))
    return _PipelinedMoE.apply(x, probs, sched, bank, group, *params)

