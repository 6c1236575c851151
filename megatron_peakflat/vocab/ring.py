"""The two Ring-DTP schedules and the autograd function that runs them.

P ranks of a ring group each hold their own tokens and one contiguous vocabulary shard.
- ``activations``: tokens travel with their (max, sum-exp, target, sum) state; each rank folds the
  visiting tokens against its own shard. Backward sends tokens with (lse, coefficients) around again,
  the visiting tokens' dX accumulator travels with them, and each rank accumulates dW of its own shard.
- ``weights``: shards travel; each rank folds its own tokens against every shard. Backward sends the
  shards around again with their dW accumulator, which arrives back at its owner after P hops.

With ``dw_into_main_grad`` and a weight that Megatron's DDP gave an fp32 ``main_grad``, dW is added
there (by the GEMMs themselves, or on arrival home) and autograd gets a placeholder that allocates
nothing, or no gradient for a weight shared with the embedding: no fp32 dW accumulator and no dW in the
weight's dtype are built (``main_grad.py``).

Each hop of the travelling input is posted (``batch_isend_irecv``: one send to the next rank and one
receive from the previous, in the same order on every rank) before the local block work starts, so
communication overlaps compute. The state/accumulator hop that depends on the local result follows it;
the weights schedule's dW accumulator goes on block by block, each block as soon as it is final
(``_BlockHop``), so that hop overlaps the rest of the shard's compute too.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .block_torch import grad_coefficients
from .blocks import BlockOps, fold_shard, grad_shard
from .. import stats
from ..main_grad import main_grad_of, release
from ..runtime.meter import region

__all__ = ["RingPlan", "SavedPlan", "auto_ring_schedule", "RingLinearCrossEntropy", "backward_ring", "coefficients", "finish_loss", "new_state",
           "comm_device", "max_over_ring"]

_TAG_INPUT, _TAG_STATE, _TAG_BLOCK = 0, 8, 16


@dataclass(frozen=True)
class RingPlan:
    """Everything the schedules need, agreed on by every ring rank before the first hop."""

    group: object | None
    rank: int
    size: int
    tokens: tuple[int, ...]
    """Tokens held by each ring rank."""
    shard_rows: tuple[int, ...]
    """Vocabulary rows of each rank's shard; shard r starts at sum(shard_rows[:r])."""
    schedule: str
    """'activations' or 'weights' (the rings), 'gather' (the in-forward schedule, ``in_forward.py``) or 'single'
    (one rank): resolved, identical on every rank."""
    block_size: int
    ignore_index: int
    label_smoothing: float
    ops: BlockOps
    acc_dtype_fp32: bool = True
    """Accumulate dX (and a travelling or visited dW) in fp32; else in the gradients' own dtype."""
    dw_into_main_grad: bool = False
    """Add dW into the weight's Megatron DDP ``main_grad`` when it has one (``main_grad.py``)."""
    weight_shared: bool = False
    """The weight also gets gradients through autograd elsewhere (a tied embedding): with ``main_grad``,
    backward returns no weight gradient and leaves DDP's hook to add the others (``main_grad.release``)."""
    chunk_rows: int = 0
    """Own tokens per chunk of the in-forward schedule (``in_forward.py``); 0: the recompute schedules."""
    argmax: bool = False
    """Also track each token's largest logit and its vocabulary id (the recompute schedules' forward only)."""

    def acc_dtype(self, t: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.acc_dtype_fp32 else t.dtype

    def main_grad_sink(self, weight: torch.Tensor, wanted: bool) -> torch.Tensor | None:
        """The weight's DDP ``main_grad`` when dW is to go there (and is ``wanted`` at all), else None."""
        return main_grad_of(weight) if self.dw_into_main_grad and wanted else None

    def handed_over(self, weight: torch.Tensor) -> torch.Tensor | None:
        """What backward returns for a weight whose dW went into its ``main_grad`` (``main_grad.release``)."""
        stats.add("vocab", "dw_into_main_grad", 1)
        return release(weight, self.weight_shared)

    @property
    def vocab_size(self) -> int:
        return sum(self.shard_rows)

    def start(self, r: int) -> int:
        return sum(self.shard_rows[:r])

    def peer(self, offset: int) -> int:
        """Global rank of the ring rank ``rank + offset``."""
        r = (self.rank + offset) % self.size
        return r if self.group is None else dist.get_global_rank(self.group, r)


@dataclass(frozen=True)
class SavedPlan:
    """A ``RingPlan`` as an autograd context keeps it from forward to backward: its process group held weakly.

    The context lives as long as the loss does, and a script's last loss often lives until the interpreter exits.
    A context holding the group keeps it alive after ``dist.destroy_process_group()``: its gloo threads and
    connections stay up and are torn down during interpreter finalization, where gloo teardown can end in
    ``std::terminate`` (SIGABRT, exit -6). Held weakly, the group goes when the caller destroys it."""

    plan: RingPlan
    """The plan with ``group=None``."""
    group: "weakref.ReferenceType | None"

    @staticmethod
    def of(plan: RingPlan) -> "SavedPlan":
        if plan.group is None:
            return SavedPlan(plan, None)
        return SavedPlan(dataclasses.replace(plan, group=None), weakref.ref(plan.group))

    def get(self) -> RingPlan:
        """The plan again, with its group; RuntimeError if the group was destroyed before backward."""
        if self.group is None:
            return self.plan
        group = self.group()
        if group is None:
            raise RuntimeError("Ring-DTP backward: the process group of its forward no longer exists (destroyed "
                               "with dist.destroy_process_group before this backward ran); run backward first")
        return dataclasses.replace(self.plan, group=group)


def auto_ring_schedule(max_tokens: int, vocab_size: int, ring_size: int) -> str:
    """The ring that moves less: 'activations' when the tokens per rank are no more than V/P, else 'weights'."""
    return "activations" if max_tokens * ring_size <= vocab_size else "weights"


def comm_device(device: torch.device, group: object | None) -> torch.device:
    """Where small metadata tensors must live for a collective on ``group`` (NCCL needs the GPU)."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def max_over_ring(value: torch.Tensor, group: object | None, device: torch.device) -> int:
    """The max of a one-element integer ``value`` over ``group`` (None: this rank's own), on the host: one
    sync, and on a ring one all-reduce, so that every rank takes the same branch after it. ``device``:
    where the group's collectives run tensors of this call (``comm_device``)."""
    if group is not None:
        value = value.reshape(1).to(comm_device(device, group))
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.reshape(-1)[0])


def _shift(plan: RingPlan, sends: list[torch.Tensor], recvs: list[torch.Tensor], tag: int) -> list:
    """Post one ring hop: each ``sends[i]`` to the next rank, ``recvs[i]`` from the previous one."""
    nxt, prv = plan.peer(1), plan.peer(-1)
    ops = []
    for i, (s, r) in enumerate(zip(sends, recvs)):
        ops.append(dist.P2POp(dist.isend, s, nxt, plan.group, tag + i))
        ops.append(dist.P2POp(dist.irecv, r, prv, plan.group, tag + i))
    return dist.batch_isend_irecv(ops)


def _post_next(plan: RingPlan, k: int, sends: list[torch.Tensor],
               shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor] | None, list | None]:
    """Before hop ``k``'s compute, post the shift of ``sends`` into fresh buffers of ``shapes``, so the
    transfer overlaps the compute; nothing moves after the last hop."""
    if k == plan.size - 1:
        return None, None
    recvs = [t.new_empty(shape) for t, shape in zip(sends, shapes)]
    return recvs, _shift(plan, sends, recvs, _TAG_INPUT)


def _wait(works: list | None) -> None:
    for w in works or ():
        w.wait()


class _BlockHop:
    """One ring hop of an accumulator in vocabulary blocks of ``block`` rows: block i of ``send`` leaves for the
    next rank as soon as it is final (``sent``), so the hop overlaps the blocks still being computed, and block i
    of ``recv`` comes from the previous rank; ``arrived(i)`` waits for it just before it is first used. Block i
    of every rank travels in the i-th ``batch_isend_irecv`` of the hop (a send where the rank's shard has block
    i, a receive where the previous rank's has), so the ranks post matching batches in the same order."""

    def __init__(self, plan: RingPlan, send: torch.Tensor, recv: torch.Tensor, block: int) -> None:
        self.plan, self.send, self.recv, self.block = plan, send, recv, block
        self.batches = max(-(-send.shape[0] // block), -(-recv.shape[0] // block))
        self.works: dict[int, list] = {}
        self.posted = 0

    def _post(self, i: int) -> None:
        b, nxt, prv = self.block, self.plan.peer(1), self.plan.peer(-1)
        ops = []
        if i * b < self.send.shape[0]:
            ops.append(dist.P2POp(dist.isend, self.send[i * b:(i + 1) * b], nxt, self.plan.group, _TAG_BLOCK + i))
        if i * b < self.recv.shape[0]:
            ops.append(dist.P2POp(dist.irecv, self.recv[i * b:(i + 1) * b], prv, self.plan.group, _TAG_BLOCK + i))
        self.works[i] = dist.batch_isend_irecv(ops)

    def sent(self, b0: int, b1: int) -> None:
        """Rows [b0, b1) of ``send`` are final: post their batch (and any before it)."""
        while self.posted <= (b1 - 1) // self.block:
            self._post(self.posted)
            self.posted += 1

    def finish(self) -> None:
        """Post the batches left (receives of blocks this rank's shard does not have)."""
        while self.posted < self.batches:
            self._post(self.posted)
            self.posted += 1

    def arrived(self, b0: int, b1: int) -> None:
        """Wait for rows [b0, b1) of ``recv`` (one block)."""
        _wait(self.works.pop(b0 // self.block, None))

    def wait_all(self) -> None:
        for i in sorted(self.works):
            _wait(self.works.pop(i))


def new_state(n: int, device: torch.device, argmax: bool = False) -> torch.Tensor:
    """An empty [4, n] fp32 online log-sum-exp state: max -inf, sum-exp, target and logit sum 0. With
    ``argmax``, [6, n]: two more rows, the largest logit seen (-inf) and its vocabulary id (-1), which
    ``blocks.fold_shard`` keeps and the kernels, reading rows 0-3 only, leave alone."""
    st = torch.zeros(6 if argmax else 4, n, dtype=torch.float32, device=device)
    st[0].fill_(float("-inf"))
    if argmax:
        st[4].fill_(float("-inf"))
        st[5].fill_(-1.0)
    return st


def _forward_activations(plan: RingPlan, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    P, r = plan.size, plan.rank
    own_start = plan.start(r)
    cur_x, cur_l, cur_s = x, labels, new_state(x.shape[0], x.device, plan.argmax)
    for k in range(P):
        nsrc = (r - k - 1) % P
        n = plan.tokens[nsrc]
        nxt, pending = _post_next(plan, k, [cur_x, cur_l], [(n, x.shape[1]), (n,)])
        fold_shard(cur_x, w, own_start, cur_l, cur_s, plan.block_size, plan.ops)
        ns = torch.empty(cur_s.shape[0], n, dtype=torch.float32, device=x.device)
        _wait(_shift(plan, [cur_s], [ns], _TAG_STATE))
        cur_s = ns
        _wait(pending)
        if nxt:
            cur_x, cur_l = nxt
    return cur_s  # after P hops the state of this rank's own tokens is back home


def _forward_weights(plan: RingPlan, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    P, r = plan.size, plan.rank
    state = new_state(x.shape[0], x.device, plan.argmax)
    cur_w = w
    for k in range(P):
        src, nsrc = (r - k) % P, (r - k - 1) % P
        nxt, pending = _post_next(plan, k, [cur_w], [(plan.shard_rows[nsrc], w.shape[1])])
        fold_shard(x, cur_w, plan.start(src), labels, state, plan.block_size, plan.ops)
        _wait(pending)
        if nxt:
            (cur_w,) = nxt
    return state


def _backward_single(plan: RingPlan, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                     coef: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    dx = torch.zeros(x.shape, dtype=plan.acc_dtype(x), device=x.device)
    dw = torch.empty_like(w) if sink is None else sink
    grad_shard(x, w, 0, labels, coef, dx, dw, accumulate=sink is not None, block_size=plan.block_size, ops=plan.ops)
    return dx.to(x.dtype), (dw if sink is None else None)


def _backward_activations(plan: RingPlan, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                          coef: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    P, r = plan.size, plan.rank
    own_start = plan.start(r)
    dw = torch.zeros(w.shape, dtype=plan.acc_dtype(w), device=w.device) if sink is None else sink
    cur_x, cur_l, cur_c = x, labels, coef
    cur_dx = torch.zeros(x.shape, dtype=plan.acc_dtype(x), device=x.device)
    for k in range(P):
        nsrc = (r - k - 1) % P
        n = plan.tokens[nsrc]
        nxt, pending = _post_next(plan, k, [cur_x, cur_l, cur_c], [(n, x.shape[1]), (n,), (4, n)])
        grad_shard(cur_x, w, own_start, cur_l, cur_c, cur_dx, dw, accumulate=True,
                   block_size=plan.block_size, ops=plan.ops)
        ndx = torch.empty(n, x.shape[1], dtype=plan.acc_dtype(x), device=x.device)
        _wait(_shift(plan, [cur_dx], [ndx], _TAG_STATE))
        cur_dx = ndx
        _wait(pending)
        if nxt:
            cur_x, cur_l, cur_c = nxt
    return cur_dx.to(x.dtype), (dw.to(w.dtype) if sink is None else None)


def _backward_weights(plan: RingPlan, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                      coef: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The travelling dW accumulator goes on block by block as each block is final (``_BlockHop``), so its hop
    overlaps the rest of the shard's compute, and the next hop waits for each block only where it first adds
    to it: the same sums in the same order as sending the whole accumulator after the compute."""
    P, r = plan.size, plan.rank
    dx = torch.zeros(x.shape, dtype=plan.acc_dtype(x), device=x.device)
    cur_w = w
    cur_dw = torch.zeros(w.shape, dtype=plan.acc_dtype(w), device=w.device)
    arriving: _BlockHop | None = None  # the hop bringing cur_dw's blocks (none before the first)
    for k in range(P):
        src, nsrc = (r - k) % P, (r - k - 1) % P
        rows = plan.shard_rows[nsrc]
        nxt, pending = _post_next(plan, k, [cur_w], [(rows, w.shape[1])])
        ndw = torch.empty(rows, w.shape[1], dtype=plan.acc_dtype(w), device=w.device)
        hop = _BlockHop(plan, cur_dw, ndw, plan.block_size)
        grad_shard(x, cur_w, plan.start(src), labels, coef, dx, cur_dw, accumulate=True,
                   block_size=plan.block_size, ops=plan.ops,
                   before_dw=None if arriving is None else arriving.arrived, dw_done=hop.sent)
        hop.finish()
        if arriving is not None:
            arriving.wait_all()
        arriving, cur_dw = hop, ndw
        _wait(pending)
        if nxt:
            (cur_w,) = nxt
    arriving.wait_all()
    if sink is not None:  # the shard's dW is home after P hops
        sink.add_(cur_dw)
        return dx.to(x.dtype), None
    return dx.to(x.dtype), cur_dw.to(w.dtype)


def backward_ring(plan: RingPlan, x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor,
                  sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dX (x's dtype) and dW (None when added into ``sink``) of the recompute schedule of ``plan``."""
    if plan.size == 1:
        return _backward_single(plan, x, w, labels, coef, sink)
    if plan.schedule == "activations":
        return _backward_activations(plan, x, w, labels, coef, sink)
    return _backward_weights(plan, x, w, labels, coef, sink)


def coefficients(plan: RingPlan, lse: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The [4, n] (lse, a, b, c) of ``grad_logits_*`` for per-token upstream gradient ``g`` (0 where ignored)."""
    return grad_coefficients(lse, g, plan.label_smoothing, plan.vocab_size)


def finish_loss(plan: RingPlan, state: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) per token from the completed (max, sum-exp, target, sum) ``state``; 0 loss where ignored."""
    eps = plan.label_smoothing
    lse = state[0] + torch.log(state[1])
    loss = lse - (1.0 - eps) * state[2] - (eps / plan.vocab_size) * state[3]
    return torch.where(valid, loss, torch.zeros((), dtype=loss.dtype, device=loss.device)), lse


class RingLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [n] (fp32) of ``hidden @ W.T`` against ``labels``, W sharded over ``plan``'s ring;
    with ``plan.argmax`` also each token's argmax vocabulary id [n] (int64, no gradient).

    ``labels`` must already have ``ignore_index`` replaced by -1 (``valid`` marks the others).
    """

    @staticmethod
    @region("vocab")
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                plan: RingPlan) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if plan.size == 1:
            state = new_state(hidden.shape[0], hidden.device, plan.argmax)
            fold_shard(hidden, weight, 0, labels, state, plan.block_size, plan.ops)
        elif plan.schedule == "activations":
            state = _forward_activations(plan, hidden, weight, labels)
        else:
            state = _forward_weights(plan, hidden, weight, labels)
        loss, lse = finish_loss(plan, state, valid)
        ctx.save_for_backward(hidden, weight, labels, valid, lse)
        ctx.plan = SavedPlan.of(plan)  # the group held weakly: the graph may outlive it
        if not plan.argmax:
            return loss
        pred = state[5].long()
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    @region("vocab")
    def backward(ctx, grad_loss: torch.Tensor, *_: torch.Tensor):
        hidden, weight, labels, valid, lse = ctx.saved_tensors
        plan = ctx.plan.get()
        g = torch.where(valid, grad_loss.float(), torch.zeros((), device=grad_loss.device))
        # a saved leaf unpacks as the parameter object itself, with its main_grad
        sink = plan.main_grad_sink(weight, ctx.needs_input_grad[1])
        dx, dw = backward_ring(plan, hidden, weight, labels, coefficients(plan, lse, g), sink)
        if sink is not None:
            dw = plan.handed_over(weight)
        return dx, dw, None, None, None
