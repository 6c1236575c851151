"""Chunked dispatch -> experts -> combine, as one autograd Function recomputed chunk by chunk.

Forward runs the K chunks one after another (dispatch all-to-all, experts, combine all-to-all,
accumulate into the output) under no_grad and keeps only the routing metadata. Backward runs the
chunks again: it re-dispatches the chunk's rows and output gradients, recomputes the experts with
grad, backpropagates, and sends the row and prob gradients home. So only one chunk's expert
activations are ever alive, in forward and in backward.

Fused recompute (``out_grad``): when the caller already knows the gradient of the output (under
full recompute the layer's backward re-runs its forward, and the MoE output feeds only the
residual add, so its gradient is the checkpoint's output gradient), forward runs each chunk's
forward and backward back to back and keeps dX, dprobs; backward then checks that the gradient it
receives is the one assumed and returns them. That check reads nothing when the gradient is the
assumed tensor's own memory, as the residual add passes it on (``_assumed_grad_differs``): the host
does not wait for the GPU there, so what follows (autograd's bookkeeping of the expert weights) may
overlap the recompute's kernels. So the layer pays one expert
forward less than a recompute of its own. If the gradients differ, backward runs the chunks on
the difference and adds it (the gradients are linear in the output gradient), so the result
stays exact. A caller that knows the recomputed output is never read (``need_output=False``) is
spared computing it: each chunk's second expert GEMM of the forward, and at EP > 1 the output
rows of every combine.

Exactness: every token-expert pair is computed by the same expert math on the same weights as an
unchunked MoE; only the summation order of a token's k expert outputs (and of each expert's weight
gradient over chunks) changes. Gradients of spilled experts' weights are computed on the helper
and added at the owner.

Transport: at EP > 1 each chunk's dispatch sends its hidden rows, their probabilities and (in backward)
their output-gradient rows as the columns of one buffer, and its combine sends dX, dprobs and the
outputs home in one (``packed.py``): one all-to-all each way per chunk, the same bytes. An overlapped
call's packed exchanges may travel on the copy engines instead of NCCL's kernels (``copy_engine.py``),
leaving every SM to the GEMMs they overlap; the bytes are the same, so the results are bit for bit.

Expert math: a bank that offers grouped GEMMs (``GroupedExperts``) runs each chunk's experts in a
few grouped GEMMs, forward and backward (``grouped.py``); otherwise each expert runs on its own.

Weight gradients go into the buffer ``_Chunks.sink`` names: the owner's Megatron DDP ``main_grad``
(in fp32, as gradient-accumulation fusion does), else an fp32 sum over chunks. A grouped backward
adds each expert's there by one GEMM with beta=1; the per-expert backward runs on detached aliases
of the expert weights, whose post-accumulate hooks add each weight's gradient there as soon as
autograd produces it, so at most one expert weight's gradient is in flight. A parameter with
``main_grad`` returns a placeholder (``main_grad.py``: main_grad's own storage, no allocation) with
``grad_added_to_main_grad`` set, so DDP's hook fires once per backward and adds nothing twice; the others return their fp32 sum through autograd, once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from . import comm
from .copy_engine import CopyEngineTransport
from .combine import add_rows
from .bound import overlap_on
from .experts import ExpertBank, exchange_weights, return_weight_grads, unflatten_weights
from .packed import RowLayout, RowSpec, row_layout
from .schedule import Schedule
from .. import stats
from ..main_grad import handed_to_main_grad, main_grad_of
from ..runtime.meter import region

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


def _compute(bank: ExpertBank, x: torch.Tensor, probs: torch.Tensor, tpe: list[int], local: list[int | None],
             weights: list[list[torch.Tensor] | None], cum: torch.Tensor | None, runs: list[Any] | None
             ) -> torch.Tensor:
    """One chunk's expert outputs without autograd: grouped GEMMs when the call has the bank's weight
    ``runs`` (``_Chunks._runs_for``), else the bank's own ``compute``."""
    if runs is not None:
        return bank.grouped_compute(x, probs, tpe, local, weights, cum, runs)  # type: ignore[attr-defined]
    return bank.compute(x, probs, tpe, local, weights)


Fill = Callable[[torch.Tensor], object]
"""Writes one piece's rows into the view it is given (its columns of a packed buffer)."""


class _InFlight:
    """One chunk's pieces on their way: exchanges each carrying one piece, or several packed as the columns
    of one buffer (``packed.py``). ``wait()`` gives all ``n`` pieces in order, None where a piece was None."""

    def __init__(self, parts: list[tuple[Any, RowLayout | None, list[int]]], n: int) -> None:
        self.parts, self.n = parts, n
        stats.add("dispatch", "all_to_alls", len(parts))

    def wait(self) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * self.n
        for ex, layout, members in self.parts:
            got = ex.wait()
            for i, v in zip(members, layout.views(got) if layout is not None else [got]):
                out[i] = v
        return out


def _pack_groups(specs: list[RowSpec], split: bool) -> list[list[int]]:
    """Which pieces share a buffer: all of them, or with ``split`` one row-wide piece per buffer (a piece of
    one value per row rides with the piece before it). Copy-engine slots are held at the size of the
    largest buffer, so split buffers need slots of one hidden row per pair instead of two."""
    if not split:
        return [list(range(len(specs)))]
    groups: list[list[int]] = []
    for i, (shape, _) in enumerate(specs):
        if groups and not shape:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _start_packed(pieces: list[tuple[int, RowSpec, Fill]], n: int, rows: int, device: torch.device,
                  splits: tuple[list[int], list[int]], matrix: list[list[int]], group: dist.ProcessGroup | None,
                  transport: CopyEngineTransport | None) -> _InFlight | None:
    """Pack ``pieces`` (position among ``n``, per-row spec, fill) into buffers of ``rows`` rows and start
    their exchanges: over NCCL with ``splits`` (sent, received per rank), or pulled by the copy engines
    with ``matrix`` (every rank's sends). None, having started nothing, when a piece cannot be packed."""
    groups = _pack_groups([spec for _, spec, _ in pieces], split=transport is not None)
    layouts = [row_layout([pieces[i][1] for i in g]) for g in groups]
    if any(layout is None for layout in layouts):
        return None
    parts: list[tuple[Any, RowLayout | None, list[int]]] = []
    for g, layout in zip(groups, layouts):
        buf = (transport.send_buffer(matrix, layout.width, layout.dtype) if transport is not None  # type: ignore[union-attr]
               else layout.empty(rows, device))  # type: ignore[union-attr]
        for i, v in zip(g, layout.views(buf)):  # type: ignore[union-attr]
            pieces[i][2](v)
        ex = (transport.start(buf, matrix) if transport is not None
              else comm.all_to_all_start(buf, splits[0], splits[1], group))
        parts.append((ex, layout, [pieces[i][0] for i in g]))
    return _InFlight(parts, n)


def _gather_into(src: torch.Tensor, idx: torch.Tensor | None) -> Fill:
    return (lambda v: v.copy_(src)) if idx is None else (lambda v: torch.index_select(src, 0, idx, out=v))


def _dispatch_finish(sched: Schedule, j: int, sent: _InFlight) -> list[torch.Tensor]:
    idx = sched.regroup[j]
    return [p.contiguous() if idx is None else p.index_select(0, idx) for p in sent.wait()]  # type: ignore[union-attr]


def _combine_start(sched: Schedule, j: int, rows: list[torch.Tensor | None], group: dist.ProcessGroup | None,
                   pack: bool, transport: CopyEngineTransport | None = None) -> _InFlight:
    idx = sched.ungroup[j]
    present = [i for i, r in enumerate(rows) if r is not None]
    splits = (sched.recv_splits[j], sched.send_splits[j])  # results go back the way their rows came
    if pack and (len(present) > 1 or transport is not None):
        r0 = rows[present[0]]
        pieces = [(i, (tuple(rows[i].shape[1:]), rows[i].dtype), _gather_into(rows[i], idx)) for i in present]
        matrix = [list(col) for col in zip(*sched.flow_splits[j])] if transport is not None else []
        sent = _start_packed(pieces, len(rows), r0.shape[0], r0.device, splits, matrix, group, transport)  # type: ignore[arg-type]
        if sent is not None:
            return sent
    parts: list[tuple[Any, RowLayout | None, list[int]]] = []
    for i in present:
        r = rows[i] if idx is None else rows[i].index_select(0, idx)  # type: ignore[union-attr]
        parts.append((comm.all_to_all_start(r, *splits, group), None, [i]))
    return _InFlight(parts, len(rows))


class _Chunks:
    """One layer call's chunks: dispatch, experts and combine, forward or backward, chunk by chunk."""

    def __init__(self, sched: Schedule, bank: ExpertBank, group: dist.ProcessGroup | None, overlap: bool = False,
                 pack: bool = True, transport: CopyEngineTransport | None = None) -> None:
        self.sched, self.bank, self.group = sched, bank, group
        self.pack = pack and comm.group_size(group) > 1
        # overlap: chunk j + 1's dispatch and chunk j's combine travel while chunk j + 1 computes. Only
        # in a group of more than one rank (in a group of one nothing travels and one chunk is kept).
        self.overlap = overlap and comm.group_size(group) > 1
        # Copy engines carry the packed exchanges (``pipelined_moe`` hands one only to calls that overlap).
        self.transport = transport
        self.foreign = exchange_weights(sched, bank, group)
        self.local, self.weights = _segments(sched, bank, self.foreign)
        self._runs: list[Any] | None = None  # a grouped bank's weight runs, the same for every chunk of the call
        self._grouped: bool | None = None  # whether this call runs grouped GEMMs, asked of the bank once
        self.acc: dict[tuple[int, int], torch.Tensor] = {}  # (compute-expert position, param) -> fp32 sum
        self._sinks: dict[tuple[int, int], torch.Tensor | None] = {}  # sink()'s answers, fixed for the call
        self._inflight: list[tuple[int, _InFlight]] = []  # combines sent, not yet added

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The MoE output, without autograd."""
        sched = self.sched
        out = torch.zeros_like(x)
        with torch.no_grad():
            nxt = self._send(0, x, probs)
            for j in range(sched.K):
                xr, pr = _dispatch_finish(sched, j, nxt)
                nxt = self._send(j + 1, x, probs) if self.overlap else None
                y = _compute(self.bank, xr, pr, sched.tokens_per_expert[j], self.local, self.weights, self._cum(j),
                             self._runs_for(xr))
                del xr, pr
                self._returned(j, [y], out=out)
                del y
                nxt = nxt or self._send(j + 1, x, probs)
            self._returned(sched.K, [], out=out)
        return out

    def backward(self, x: torch.Tensor, probs: torch.Tensor, grad_out: torch.Tensor, gx: torch.Tensor,
                 gp: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Add d(x), d(probs) of ``grad_out`` into ``gx``, ``gp`` and take the weight gradients; with
        ``out``, also add the MoE output into it (the forward of the same chunks, run alongside)."""
        sched, bank = self.sched, self.bank
        backward_chunk = getattr(bank, "backward_chunk", None)
        nxt = self._send(0, x, probs, grad_out)
        for j in range(sched.K):
            xr, pr, gr = _dispatch_finish(sched, j, nxt)
            nxt = self._send(j + 1, x, probs, grad_out) if self.overlap else None
            tpe = sched.tokens_per_expert[j]
            res = None
            if backward_chunk is not None:
                res = backward_chunk(xr, pr, gr, tpe, self.local, self.weights, self.sink, want_out=out is not None,
                                     cum=self._cum(j), runs=self._runs_for(xr))
            if res is None:
                res = self._autograd_chunk(xr, pr, gr, tpe, want_out=out is not None)
            del xr, pr, gr
            # Every rank runs every combine of every chunk, rows or not: the collectives stay matched.
            self._returned(j, list(res), out=out, gx=gx, gp=gp)
            del res
            nxt = nxt or self._send(j + 1, x, probs, grad_out)
        self._returned(sched.K, [], out=out, gx=gx, gp=gp)

    def _send(self, j: int, x: torch.Tensor, probs: torch.Tensor, grad_out: torch.Tensor | None = None
              ) -> _InFlight | None:
        """Start chunk j's dispatch of rows, probs (and output-gradient rows); None past the last chunk."""
        if j >= self.sched.K:
            return None
        sched = self.sched
        tok, entry = self._pairs(j)
        srcs = [x] if grad_out is None else [x, grad_out]
        pieces: list[tuple[int, RowSpec, Fill]] = [
            (0, (tuple(x.shape[1:]), x.dtype), _gather_into(x, tok)),
            (1, ((), probs.dtype), _gather_into(probs.view(-1), entry))]
        pieces += [(2, (tuple(grad_out.shape[1:]), grad_out.dtype), _gather_into(grad_out, tok))] if grad_out is not None else []
        splits = (sched.send_splits[j], sched.recv_splits[j])
        if self.pack:
            sent = _start_packed(pieces, len(pieces), tok.numel(), x.device, splits, sched.flow_splits[j], self.group,
                                 self.transport)
            if sent is not None:
                return sent
        rows = ([x.index_select(0, tok), probs.view(-1).index_select(0, entry)]
                + [t.index_select(0, tok) for t in srcs[1:]])
        return _InFlight([(comm.all_to_all_start(r, *splits, self.group), None, [i]) for i, r in enumerate(rows)],
                         len(rows))

    def _returned(self, j: int, results: list[torch.Tensor | None], *, out: torch.Tensor | None = None,
                  gx: torch.Tensor | None = None, gp: torch.Tensor | None = None) -> None:
        """Start sending chunk j's results home (forward: [y]; backward: [dx, dprobs, y or None]) and add
        what has arrived: with ``overlap`` the previous chunk's (so this chunk's combine travels while the
        next one computes), else this chunk's. ``j == K`` with no results drains the last one."""
        if results:
            self._inflight.append((j, _combine_start(self.sched, j, results, self.group, self.pack, self.transport)))
        while self._inflight and (len(self._inflight) > 1 or not self.overlap or not results):
            jj, ex = self._inflight.pop(0)
            got = ex.wait()
            if len(got) == 1:  # forward: [y]
                self._add(out, jj, got[0])
                continue
            dx, dp, y = got
            self._add(gx, jj, dx)
            gp.view(-1).index_add_(0, self._pairs(jj)[1], dp)  # each pair once per pass: exact, in any order
            if out is not None:
                self._add(out, jj, y)

    def _add(self, dst: torch.Tensor, j: int, rows: torch.Tensor) -> None:
        add_rows(dst, rows, self.sched.combine, j)

    def _runs_for(self, x: torch.Tensor) -> list[Any] | None:
        """The bank's weight runs of this call (``GroupedExperts.call_runs``), or None when the call does
        not run grouped GEMMs. Both are decided on the first chunk and kept: within a call the weights do
        not move, and every chunk's rows share x's dtype, device and width, all that ``use_grouped`` reads."""
        if self._grouped is None:
            use_grouped = getattr(self.bank, "use_grouped", None)
            self._grouped = use_grouped is not None and bool(use_grouped(x))
            if self._grouped:
                self._runs = self.bank.call_runs(self.local, self.weights)  # type: ignore[attr-defined]
        return self._runs

    def _cum(self, j: int) -> torch.Tensor | None:
        return None if self.sched.rows_cum is None else self.sched.rows_cum[j]

    def _pairs(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk j's pairs: (their tokens, their elements of a contiguous [T, E] tensor, ``Schedule.pair_entry``)."""
        a, b = self.sched.chunk_offsets[j], self.sched.chunk_offsets[j + 1]
        return self.sched.pair_token[a:b], self.sched.pair_entry[a:b]

    def sink(self, i: int, k: int) -> torch.Tensor | None:
        """The buffer that accumulates parameter k's gradient of compute expert i: the owner's main_grad
        when Megatron's DDP gave it one, else this call's fp32 sum; None: not wanted. The same buffer for
        every chunk of the call (looked up once: each chunk asks for every expert with rows)."""
        key = (i, k)
        if key not in self._sinks:
            self._sinks[key] = self._find_sink(i, k)
        return self._sinks[key]

    def _find_sink(self, i: int, k: int) -> torch.Tensor | None:
        li = self.local[i]
        if li is not None:
            p = self.bank.expert_params(li)[k]
            if not p.requires_grad:
                return None
            mg = main_grad_of(p)
            if mg is not None:
                return mg
        acc = self.acc.get((i, k))
        if acc is None:
            w = self.bank.expert_params(li)[k] if li is not None else self.weights[i][k]
            acc = self.acc[i, k] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        return acc

    def _hook(self, i: int, k: int) -> Callable[[torch.Tensor], None]:
        def hook(alias: torch.Tensor) -> None:
            g = alias.grad
            alias.grad = None
            self.sink(i, k).add_(g)  # type: ignore[union-attr]  # aliases exist only for wanted gradients
        return hook

    def _autograd_chunk(self, xr: torch.Tensor, pr: torch.Tensor, gr: torch.Tensor, tpe: list[int], want_out: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # Weight gradients leave autograd one tensor at a time (a hook on a per-chunk alias of each
        # weight), so no chunk ever holds every expert's gradient at once.
        xr, pr = xr.detach().requires_grad_(True), pr.detach().requires_grad_(True)
        seg_weights: list[list[torch.Tensor] | None] = []
        aliases: list[torch.Tensor] = []
        for i, n in enumerate(tpe):
            if n == 0:
                seg_weights.append(None)
                continue
            own = self.local[i] is not None
            ws = []
            for k, p in enumerate(self.bank.expert_params(self.local[i]) if own else self.weights[i]):
                if own and not p.requires_grad:
                    ws.append(p)
                    continue
                alias = p.detach().requires_grad_(True)
                alias.register_post_accumulate_grad_hook(self._hook(i, k))
                ws.append(alias)
                aliases.append(alias)
            seg_weights.append(ws)
        with torch.enable_grad():
            y = self.bank.compute(xr, pr, tpe, [None] * len(tpe), seg_weights)
        if y.requires_grad:
            torch.autograd.backward(y, gr, inputs=[xr, pr, *aliases])
        dx = xr.grad if xr.grad is not None else torch.zeros_like(xr)
        dp = pr.grad if pr.grad is not None else torch.zeros_like(pr)
        return dx, dp, (y.detach() if want_out else None)

    def weight_grads(self, needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
        """Send spilled experts' gradients home, add them up, and give autograd one gradient per parameter.

        A parameter with Megatron DDP's main_grad already holds its gradient there (as with gradient-
        accumulation fusion): it gets a placeholder and ``grad_added_to_main_grad``, so DDP's hook fires
        once without adding it again.
        """
        sched, bank, local = self.sched, self.bank, self.local
        like = bank.expert_params(0)
        m = len(like)
        base = sched.rank * sched.num_local_experts
        out_grads: list[torch.Tensor | None] = [None] * len(needs)
        for (i, k), g in list(self.acc.items()):
            if local[i] is not None:
                out_grads[local[i] * m + k] = self.acc.pop((i, k))  # fp32 until every contribution is in
        # The hosted experts' weights are dropped first (the chunks are done with them), then their gradients go
        # straight from the fp32 sums into the send buffer, each sum freed once written: a hosted expert never
        # costs more than its weights and fp32 sum (chunks), or its fp32 sum and send slice (here), at once
        # (bound.hosted_expert_bytes).
        self.release()
        W = sum(p.numel() for p in like)
        send_buf = like[0].new_empty(W * len(sched.weight_recvs)) if sched.moves_weights else None
        for j, (_, e) in enumerate(sched.weight_recvs):
            i = sched.compute_experts.index(e)
            for k, dst in enumerate(unflatten_weights(send_buf[j * W:(j + 1) * W], like)):  # type: ignore[index]
                g = self.acc.pop((i, k), None)
                if g is None:
                    dst.zero_()
                else:
                    dst.copy_(g)
                del g
        self.acc, self._sinks = {}, {}
        back = return_weight_grads(sched, send_buf, bank, self.group) if send_buf is not None else []
        del send_buf
        for e, flat in back:  # each helper's part on its own, into fp32 or main_grad: no summed copy
            li = e - base
            for k, g in enumerate(unflatten_weights(flat, like)):
                mg = main_grad_of(bank.expert_params(li)[k])
                if mg is not None:
                    mg.add_(g)
                    continue
                cur = out_grads[li * m + k]
                out_grads[li * m + k] = g.float() if cur is None else cur.add_(g)
        del back
        for idx, needed in enumerate(needs):
            p = bank.expert_params(idx // m)[idx % m]
            if not needed:
                out_grads[idx] = None
            elif main_grad_of(p) is not None:
                out_grads[idx] = handed_to_main_grad(p)
            elif out_grads[idx] is None:  # an expert without rows: zero, as Megatron's SequentialMLP gives
                out_grads[idx] = torch.zeros_like(p)
            else:
                out_grads[idx] = out_grads[idx].to(p.dtype)
        return out_grads

    def release(self) -> None:
        self.foreign, self.weights, self._runs, self._grouped = {}, [], None, None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are the same elements of one allocation, so their values are equal unread."""
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def _assumed_grad_differs(grad_out: torch.Tensor, g0: torch.Tensor, group: dist.ProcessGroup | None,
                          bank: ExpertBank) -> bool:
    """Whether the gradient that reached the fused call differs from the one its forward assumed; the same
    answer on every rank of ``group``, since a correction runs collectives.

    The common case costs no host sync: the residual add passes the checkpoint's output gradient through
    unchanged, so ``grad_out`` is ``g0``'s own memory (``g0`` is a saved tensor: autograd raises if anything
    wrote it since). Otherwise the values are compared, which syncs. In a group of one that is all.

    In a larger group, until the bank is confirmed (an all-reduced verdict, so the same on every rank), every
    rank compares and the verdicts are all-reduced. Once it is, no rank all-reduces again (ranks that share
    memory would not join): a rank whose gradient is another tensor compares alone, and if the values differ
    it raises, since its peers have moved on and it cannot correct alone.
    """
    same = _same_memory(grad_out, g0)
    multi = comm.group_size(group) > 1
    confirmed = getattr(bank, "assumed_grad_confirmed", False)
    if same and (confirmed or not multi):
        stats.add("dispatch", "dispatch_recompute_checks_unsynced", 1)
        return False
    if not multi or confirmed:
        differs = not torch.equal(grad_out, g0)
        if differs and multi:
            raise RuntimeError(
                "peakflat dispatch: a MoE layer's output gradient differs from its checkpoint's on this rank, after it "
                "had matched on every rank of the expert-parallel group; the fused recompute cannot correct one rank "
                "alone. Something between the MoE output and the checkpoint's output changed during the run; pass "
                "--no-peakflat-dispatch-fuse-recompute")
        return differs
    flag = torch.tensor([int(not same and not torch.equal(grad_out, g0))], device=grad_out.device)
    return bool(comm.all_reduce_max(flag, group).item())


class _PipelinedMoE(torch.autograd.Function):
    @staticmethod
    @region("dispatch")
    def forward(ctx: Any, x: torch.Tensor, probs: torch.Tensor, sched: Schedule, bank: ExpertBank,
                group: dist.ProcessGroup | None, out_grad: torch.Tensor | None, transport: tuple[bool, bool, CopyEngineTransport | None],
                need_output: bool, *params: torch.Tensor) -> torch.Tensor:
        chunks = _Chunks(sched, bank, group, *transport)
        ctx.sched, ctx.bank, ctx.group, ctx.transport = sched, bank, group, transport
        ctx.fused = out_grad is not None
        if out_grad is None:
            out = chunks.forward(x, probs)
            chunks.release()
            ctx.save_for_backward(x, probs)
            return out
        out = torch.zeros_like(x)
        gx, gp = torch.zeros_like(x), torch.zeros_like(probs)
        g0 = out_grad.contiguous()
        if not need_output:
            stats.add("dispatch", "dispatch_recompute_output_skipped", 1)
        chunks.backward(x, probs, g0, gx, gp, out=out if need_output else None)
        ctx.chunks = chunks  # keeps the gradients of experts without main_grad until backward
        ctx.save_for_backward(x, probs, g0, gx, gp)
        return out

    @staticmethod
    @region("dispatch")
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_out = grad_out.contiguous()
        if ctx.fused:
            x, probs, g0, gx, gp = ctx.saved_tensors
            chunks: _Chunks = ctx.chunks
            ctx.chunks = None
            stats.add("dispatch", "dispatch_recompute_calls", 1)
            if _assumed_grad_differs(grad_out, g0, ctx.group, ctx.bank):
                # Not the gradient assumed: add the chunks' backward of the difference (exact by linearity).
                stats.add("dispatch", "dispatch_recompute_corrections", 1)
                ctx.bank.assumed_grad_mismatch = True  # callers may stop assuming for this bank
                chunks.backward(x, probs, grad_out - g0, gx, gp)
            else:
                ctx.bank.assumed_grad_confirmed = True
        else:
            x, probs = ctx.saved_tensors
            chunks = _Chunks(ctx.sched, ctx.bank, ctx.group, *ctx.transport)
            gx, gp = torch.zeros_like(x), torch.zeros_like(probs)
            chunks.backward(x, probs, grad_out, gx, gp)
        out_grads = chunks.weight_grads(ctx.needs_input_grad[8:])
        chunks.release()
        return (gx if ctx.needs_input_grad[0] else None, gp if ctx.needs_input_grad[1] else None,
                None, None, None, None, None, None, *out_grads)


def pipelined_moe(x: torch.Tensor, probs: torch.Tensor, sched: Schedule, bank: ExpertBank,
                  group: dist.ProcessGroup | None, out_grad: torch.Tensor | None = None, *,
                  overlap: bool = False, overlap_min_chunks: int = 0, pack: bool = True,
                  transport: Callable[[], CopyEngineTransport | None] | None = None,
                  need_output: bool = True) -> torch.Tensor:
    """The MoE output [T, H] for rows ``x`` [T, H] with dense ``probs`` [T, E], under schedule ``sched``.

    Gradients flow to ``x``, ``probs`` (at routed entries) and every local expert parameter of ``bank``.
    ``out_grad`` [T, H]: the gradient the output is expected to receive; the chunks' backward then
    runs inside this forward (see the module docstring), and stays exact if the gradient differs.
    ``overlap``: at EP > 1, keep the next chunk's dispatch and the previous chunk's combine in flight
    while a chunk computes (two more chunks' communication buffers); ``overlap_min_chunks`` > 0: also when
    ``sched`` has two chunks or more (``bound.overlap_on``; ``plan_layer`` cut them by ``bound.split_floor``).
    ``pack``: at EP > 1, each chunk's rows, probs and output-gradient rows travel in one all-to-all, and its
    results in one (``packed.py``).
    ``transport``: called when the call overlaps (at EP > 1, packed); the copy-engine transport that then
    carries its exchanges (``copy_engine.py``), or None for NCCL.
    ``need_output=False`` (with ``out_grad``): the output's values are not computed and zeros are
    returned (gradients are unchanged); only for a caller that knows nothing reads them.
    """
    if out_grad is not None and out_grad.shape != x.shape:
        raise ValueError(f"out_grad {tuple(out_grad.shape)} must have the output's shape {tuple(x.shape)}")
    if not need_output and out_grad is None:
        raise ValueError("need_output=False needs out_grad: without it the forward must produce the output")
    probs = probs.contiguous()  # chunks read and add its entries through a 1-D view (``Schedule.pair_entry``)
    overlap = overlap_on(overlap, overlap_min_chunks, sched.K, comm.group_size(group))
    stats.add("dispatch", "overlapped_calls", int(overlap))
    ce = transport() if transport is not None and overlap and pack else None
    params: list[torch.Tensor] = []
    for i in range(bank.num_local_experts):
        params.extend(bank.expert_params(i))
    return _PipelinedMoE.apply(x, probs, sched, bank, group, out_grad, (overlap, pack, ce), need_output, *params)
