"""Grouped-GEMM expert MLPs: one chunk's experts in a few ``torch._grouped_mm`` calls instead of a loop.

A chunk gives each expert few rows (c x P / E on average), so a per-expert loop of small GEMMs is
bound by launches and Python, and K chunks multiply that cost by K. Here every run of experts
whose weights sit at a constant stride in one storage (Megatron's DDP buffer lays experts out that
way; so does the buffer of received weights) becomes one strided view and one grouped GEMM, with no
weight copy. Experts that share no stride fall back to runs of one: the same math, more launches.

The math is the bias-free expert MLP: ``y = fc2(act(fc1 x, p))``, where ``elementwise(h, p)`` is
the bank's activation with its probability scale (the same ops as the per-expert path, so results
agree with it up to GEMM blocking). Backward is explicit: dX and every expert's weight gradient
from grouped GEMMs; the activation's backward through autograd on the elementwise ops only.

Weight gradients are accumulated expert by expert into the buffer ``sink(i, k)`` names (Megatron's
fp32 ``main_grad``, or the caller's own fp32 sum), one GEMM with beta=1 each (``matmul.accumulate_mm``):
no stacked gradient block is ever materialised, and the accumulator is read and written once per
chunk, inside the GEMM, not by a separate add.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..matmul import accumulate_mm
from .upload import to_device

__all__ = ["Offsets", "Run", "weight_runs", "stacked_view", "pack_expert_weights", "GroupedExperts", "grouped_supported", "grouped_mlp_forward", "grouped_mlp_backward"]

Elementwise = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Sink = Callable[[int, int], "torch.Tensor | None"]
"""``sink(i, k)``: the buffer that accumulates the gradient of parameter k (0: fc1, 1: fc2) of the
chunk's expert i (its position in segment order), or None when that gradient is not wanted."""


def grouped_supported(x: torch.Tensor) -> bool:
    """True when ``torch._grouped_mm`` runs ``x``'s dtype on its device (CPU: any float; CUDA: bf16, sm80+)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float64)
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return _cuda_major(x.device.index) >= 8 and x.shape[-1] % 8 == 0


@functools.cache
def _cuda_major(index: int | None) -> int:
    """The compute capability's major number (asked once per device: every chunk asks)."""
    return torch.cuda.get_device_capability(index)[0]


def _stackable(t: torch.Tensor, like: torch.Tensor) -> bool:
    return t.shape == like.shape and t.dtype == like.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0


def _run_end(ts: Sequence[torch.Tensor], i: int) -> int:
    """The largest j such that ``ts[i:j]`` sits at one constant stride in one storage (at least i + 1).

    The stride must be 16-byte aligned and at least one tensor long; every tensor must match ``ts[i]``
    in shape and dtype, be contiguous and start 16-byte aligned.
    """
    t0, j = ts[i], i + 1
    if j == len(ts) or not _stackable(t0, t0):
        return j
    step = ts[j].data_ptr() - t0.data_ptr()
    if step < t0.numel() * t0.element_size() or step % 16:
        return j
    base = t0.untyped_storage().data_ptr()
    while (j < len(ts) and ts[j].data_ptr() - ts[j - 1].data_ptr() == step and _stackable(ts[j], t0)
           and ts[j].untyped_storage().data_ptr() == base):
        j += 1
    return j


def _view(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(ts)`` as a view of ``ts[0]``'s storage; ``ts`` must pass ``_run_end`` whole."""
    t0 = ts[0]
    if len(ts) == 1:
        return t0.unsqueeze(0)
    es = t0.element_size()
    step = (ts[1].data_ptr() - t0.data_ptr()) // es
    return t0.as_strided((len(ts), *t0.shape), (step, *t0.stride()), t0.storage_offset())


def stacked_view(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.stack(ts)`` as a view (no copy), when the tensors sit at one constant stride in one storage.

    Requires same shape, dtype and contiguity, 16-byte aligned starts and stride, and a constant
    distance between consecutive starts of at least one tensor; otherwise None.
    """
    if not _stackable(ts[0], ts[0]) or _run_end(ts, 0) != len(ts):
        return None
    return _view(ts)


@dataclass
class Run:
    """Experts ``first .. first + n - 1`` of a chunk (positions in its segment order), weights stacked."""

    first: int
    n: int
    fc1: torch.Tensor
    """[n, N1, H] view."""
    fc2: torch.Tensor
    """[n, H, F] view."""


def weight_runs(fc1: Sequence[torch.Tensor], fc2: Sequence[torch.Tensor]) -> list[Run]:
    """Maximal runs of consecutive experts whose fc1 and fc2 weights each form a ``stacked_view``.

    Linear in the expert count: a run grows while the next expert keeps both strides and storages.
    An expert that stacks with nothing is a run of one.
    """
    runs: list[Run] = []
    i = 0
    while i < len(fc1):
        j = min(_run_end(fc1, i), _run_end(fc2, i))
        runs.append(Run(i, j - i, _view(fc1[i:j]), _view(fc2[i:j])))
        i = j
    return runs


class Offsets:
    """A chunk's rows per expert: host counts for slicing, device cumulative ends for the GEMMs.

    ``cum`` [C] int32 on the device (PipelinedLLEP's schedule uploads every chunk's at once); when
    None it is uploaded here, once. Group offsets of experts i..j are then a device subtraction:
    an upload from pageable memory per GEMM would synchronise the stream every time.
    """

    def __init__(self, counts: Sequence[int], device: torch.device, cum: torch.Tensor | None = None) -> None:
        self.starts = [0]
        for c in counts:
            self.starts.append(self.starts[-1] + int(c))
        self.cum = cum if cum is not None else to_device(self.starts[1:], device, torch.int32)

    def rows(self, i: int, j: int) -> tuple[int, int]:
        """Row range of experts i..j-1."""
        return self.starts[i], self.starts[j]

    def ends(self, i: int, j: int) -> torch.Tensor:
        """Group ends of experts i..j-1, counted from the first row of expert i (``offs`` of a grouped GEMM)."""
        return self.cum[i:j] - self.starts[i] if self.starts[i] else self.cum[i:j]


def _with_rows(runs: Sequence[Run], offs: Offsets) -> list[Run]:
    """Each run narrowed to its first through last expert with rows in this chunk (views, no copy);
    runs without rows dropped. A chunk of an expert-major schedule holds a few experts of a long
    run: the grouped GEMMs then see only those few groups."""
    out = []
    for r in runs:
        has = [i for i in range(r.first, r.first + r.n) if offs.starts[i + 1] > offs.starts[i]]
        if not has:
            continue
        a, b = has[0] - r.first, has[-1] + 1 - r.first
        out.append(r if (a, b) == (0, r.n) else Run(r.first + a, b - a, r.fc1[a:b], r.fc2[a:b]))
    return out


def _put(buf: torch.Tensor | None, like: torch.Tensor, a: int, b: int, res: torch.Tensor) -> torch.Tensor:
    """``buf[a:b] = res`` into a buffer shaped like ``like``; a result covering every row is the buffer (no copy)."""
    if buf is None:
        if a == 0 and b == like.shape[0]:
            return res
        buf = like.new_empty(like.shape)
    buf[a:b] = res
    return buf


def grouped_mlp_forward(x: torch.Tensor, probs: torch.Tensor, offs: Offsets, runs: Sequence[Run],
                        elementwise: Elementwise) -> torch.Tensor:
    """Rows of ``x`` [M, H] grouped by expert (``offs``, run order) -> expert outputs [M, H]."""
    out = None
    for r in _with_rows(runs, offs):
        a, b = offs.rows(r.first, r.first + r.n)
        ends = offs.ends(r.first, r.first + r.n)
        h = torch._grouped_mm(x[a:b], r.fc1.transpose(-1, -2), offs=ends)
        z = elementwise(h, probs[a:b])
        del h
        out = _put(out, x, a, b, torch._grouped_mm(z, r.fc2.transpose(-1, -2), offs=ends))
    return out if out is not None else x.new_empty(x.shape)


def grouped_mlp_backward(x: torch.Tensor, probs: torch.Tensor, dy: torch.Tensor, offs: Offsets,
                         runs: Sequence[Run], elementwise: Elementwise, sink: Sink,
                         want_out: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx [M, H], dprobs [M], y) for ``dy`` [M, H]; each weight gradient is added into ``sink(i, k)``.

    ``want_out``: y is also the forward output [M, H] (one more GEMM per run, on the activation the
    backward recomputes anyway); otherwise None.

    Experts without rows in this chunk get no call (their gradient contribution is zero). An expert's
    gradient is one GEMM over its rows, accumulated in the sink's precision: what autograd gives a
    per-expert MLP, with gradient-accumulation fusion's rounding.
    """
    dx = y = dp = None
    for r in _with_rows(runs, offs):  # experts without rows: no gradient to give (callers take it as zero)
        a, b = offs.rows(r.first, r.first + r.n)
        ends = offs.ends(r.first, r.first + r.n)
        xs, dys = x[a:b], dy[a:b]
        h = torch._grouped_mm(xs, r.fc1.transpose(-1, -2), offs=ends).requires_grad_(True)
        ps = probs[a:b].detach().requires_grad_(True)
        with torch.enable_grad():
            z = elementwise(h, ps)
        if want_out:
            y = _put(y, x, a, b, torch._grouped_mm(z.detach(), r.fc2.transpose(-1, -2), offs=ends))
        dz = torch._grouped_mm(dys, r.fc2, offs=ends)
        _weight_grads(r, 1, offs, dys, z.detach(), sink)
        torch.autograd.backward(z, dz, inputs=[h, ps])
        del z, dz
        dh = h.grad
        h.grad = None
        del h
        dp = _put(dp, probs, a, b, ps.grad if ps.grad is not None else torch.zeros_like(ps))
        dx = _put(dx, x, a, b, torch._grouped_mm(dh, r.fc1, offs=ends))
        _weight_grads(r, 0, offs, dh, xs, sink)
        del dh
    if dx is None:
        dx = torch.empty_like(x)
    if dp is None:
        dp = torch.zeros_like(probs)
    if want_out and y is None:
        y = torch.empty_like(x)
    return dx, dp, y


def _weight_grads(r: Run, k: int, offs: Offsets, left: torch.Tensor, right: torch.Tensor, sink: Sink) -> None:
    """sink(e, k) += left_e^T right_e for each expert e of the run with rows (``left``, ``right``: the run's rows)."""
    row0 = offs.starts[r.first]
    for i in range(r.first, r.first + r.n):
        a, b = offs.rows(i, i + 1)
        if a == b:
            continue
        dst = sink(i, k)
        if dst is not None:
            accumulate_mm(dst, left[a - row0:b - row0].t(), right[a - row0:b - row0])


def pack_expert_weights(experts: Sequence[Sequence[torch.Tensor]]) -> int:
    """Move experts' separately allocated weights into one new buffer, expert-major; returns the bytes moved.

    Each tensor's ``.data`` becomes a view of the buffer (the tensor objects, their values, their
    optimizer state and their gradients stay as they were), so that every weight position forms one
    ``stacked_view`` run. Only tensors that own their whole storage are moved (views into Megatron's
    DDP or FSDP buffers are laid out by their owner and already stack, or are left alone): otherwise 0.
    """
    flat = [t for ws in experts for t in ws]
    if len(experts) < 2 or not flat:
        return 0
    shapes = [tuple(t.shape) for t in experts[0]]
    for ws in experts:
        if [tuple(t.shape) for t in ws] != shapes:
            return 0
    for t in flat:
        if (not t.is_contiguous() or t.dtype != flat[0].dtype or t.device != flat[0].device
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            return 0
    align = max(1, 16 // flat[0].element_size())
    sizes = [-(-t.numel() // align) * align for t in experts[0]]
    buf = torch.empty(len(experts) * sum(sizes), dtype=flat[0].dtype, device=flat[0].device)
    o = 0
    with torch.no_grad():
        for ws in experts:
            for t, n in zip(ws, sizes):
                view = buf[o:o + t.numel()].view(t.shape)
                view.copy_(t)
                t.data = view
                o += n
    return buf.numel() * buf.element_size()


class GroupedExperts:
    """ExpertBank mix-in for banks of bias-free two-weight MLP experts: grouped-GEMM compute and backward.

    The bank provides ``expert_params(local) -> [fc1, fc2]``, ``elementwise(h, p)`` (its activation
    with the probability scale) and ``grouped`` (False forces the per-expert path). PipelinedLLEP
    then calls ``layout_order`` (row order of the local experts), ``compute`` without grad via
    ``grouped_compute``, and ``backward_chunk`` in the chunk backward.
    """

    grouped: bool = True

    def elementwise(self, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def use_grouped(self, x: torch.Tensor) -> bool:
        """True when this call runs grouped GEMMs: enabled, supported for ``x``, and every row of x, fc1's
        output and fc2's input is a multiple of 16 bytes (what the grouped GEMM kernels address)."""
        if not (self.grouped and grouped_supported(x)):
            return False
        fc1, fc2 = self.expert_params(0)[:2]  # type: ignore[attr-defined]
        return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], fc1.shape[0], fc2.shape[-1]))

    def layout_order(self) -> list[int]:
        """Local experts by the address of their fc1 weight, so that experts laid out at one stride form one run."""
        return list(self._bank_layout()[0])

    def _bank_layout(self) -> tuple[list[int], list[tuple[Run, int]]]:
        """(layout order, each local expert's (run, index in it)) of the bank's own weights: ``weight_runs``
        over the experts in layout order. Cached while every weight stays at its address (one
        ``data_ptr`` per weight and call): a chunk's runs of own experts are then slices of these,
        with no per-expert tensor call, which at a few rows per expert is host time the GPU waits for.
        A weight whose storage changed has another address (the cached views keep the old storage alive)."""
        n = self.num_local_experts  # type: ignore[attr-defined]
        params = [self.expert_params(i) for i in range(n)]  # type: ignore[attr-defined]
        key = tuple(t.data_ptr() for w in params for t in w[:2])
        cached = self.__dict__.get("_layout_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        order = sorted(range(n), key=lambda i: key[2 * i])
        runs = weight_runs([params[i][0].detach() for i in order], [params[i][1].detach() for i in order])
        where: list[tuple[Run, int]] = [None] * n  # type: ignore[list-item]
        for r in runs:
            for k in range(r.n):
                where[order[r.first + k]] = (r, k)
        self.__dict__["_layout_cache"] = (key, (order, where))
        return order, where

    def call_runs(self, local: Sequence[int | None], weights: Sequence[Sequence[torch.Tensor] | None]) -> list[Run]:
        """The call's compute experts as runs (``local``: bank index, or None for received ``weights``). Own
        experts consecutive in a run of the bank's layout take a slice of its stacked view; received
        weights go through ``weight_runs``. The same for every chunk of a layer call, whose weights do not
        move: PipelinedLLEP computes it once per call and hands it to each chunk (``runs``)."""
        runs: list[Run] = []
        where = self._bank_layout()[1] if any(li is not None for li in local) else []
        i, n = 0, len(local)
        while i < n:
            j = i + 1
            if local[i] is None:
                while j < n and local[j] is None:
                    j += 1
                got = weight_runs([w[0].detach() for w in weights[i:j]], [w[1].detach() for w in weights[i:j]])  # type: ignore[index]
                runs += [Run(i + r.first, r.n, r.fc1, r.fc2) for r in got]
                i = j
                continue
            r, k = where[local[i]]
            while j < n and local[j] is not None and where[local[j]][0] is r and where[local[j]][1] == k + j - i:  # type: ignore[index]
                j += 1
            runs.append(Run(i, j - i, r.fc1[k:k + j - i], r.fc2[k:k + j - i]))
            i = j
        return runs

    def grouped_compute(self, x: torch.Tensor, probs: torch.Tensor, tokens_per_expert: Sequence[int],
                        local: Sequence[int | None], weights: Sequence[Sequence[torch.Tensor] | None],
                        cum: torch.Tensor | None = None, runs: list[Run] | None = None) -> torch.Tensor:
        """ExpertBank.compute without autograd, in grouped GEMMs (``cum``: the rows' device ``Offsets.cum``;
        ``runs``: ``call_runs(local, weights)`` when the caller has it)."""
        with torch.no_grad():
            return grouped_mlp_forward(x, probs, Offsets(tokens_per_expert, x.device, cum),
                                       runs if runs is not None else self.call_runs(local, weights), self.elementwise)

    def backward_chunk(self, x: torch.Tensor, probs: torch.Tensor, dy: torch.Tensor,
                       tokens_per_expert: Sequence[int], local: Sequence[int | None],
                       weights: Sequence[Sequence[torch.Tensor] | None], sink: Sink, want_out: bool = False,
                       cum: torch.Tensor | None = None, runs: list[Run] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(dx, dprobs, output or None) of one chunk, weight gradients into ``sink``; None: use autograd."""
        if not self.use_grouped(x):
            return None
        return grouped_mlp_backward(x, probs, dy, Offsets(tokens_per_expert, x.device, cum),
                                    runs if runs is not None else self.call_runs(local, weights), self.elementwise,
                                    sink, want_out)
