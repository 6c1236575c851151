"""All-to-alls on the GPUs' copy engines, through symmetric memory: no SM is taken from the experts.

Why: an overlapped chunk's all-to-all runs beside the previous chunk's expert GEMMs. NCCL moves data
with kernels, which hold SMs (and L2) the GEMMs want: profiled on 2 H200s at EP=2, the grouped GEMMs
beside NCCL's send/recv kernels took 36 ms per step instead of 28 ms. A copy engine moves the same
bytes over NVLink with no SM at all (``cudaMemcpyAsync`` between peer-mapped buffers), which is what
PyTorch's own low-contention all-gather does for async tensor parallelism.

Protocol (pull). Exchange n uses slot ``n mod S`` of this rank's symmetric buffer:
1. the sender packs its rows into its slot on the compute stream (``send_buffer``: the packed
   buffer *is* the slot, so this costs no copy over the NCCL path);
2. on a side stream (high priority, after the compute stream's work so far): the rows a rank sends
   itself are copied from its own slot first, as they need no peer; then one barrier over the group,
   so every rank's slot n is filled; then each rank copies, from every peer's slot, the rows meant
   for it. The result is an ordinary tensor laid out by source rank as ``all_to_all_single`` lays it;
3. the compute stream waits for those copies when it reads the rows (``wait``).
A slot may be refilled once every peer has pulled from it. A rank reaches exchange n+1's barrier
only after its own pulls of exchange n ran (one stream, in order), so once this rank's barrier of
n+1 has completed, every peer is done with its slot of n: filling slot ``n mod S`` for exchange
n+S waits for the barrier of exchange n+1 (S >= 2). One barrier per exchange, issued before the
peers' copies: the only kernel of the protocol is that barrier, which runs as the pack finishes, before
the next GEMM holds every SM.

With S = 2 (the default) and the pipeline's buffers split to one hidden row per pair
(``pipelined._pack_groups``: the backward's dispatch sends rows and output gradients, its combine dX
and outputs, each as two exchanges), the two slots hold half of what the two send buffers an
overlapped call over NCCL keeps in flight do (the next chunk's dispatch, the last chunk's combine),
whose size follows the chunk rather than staying at its largest. They grow when an
exchange needs more room: every rank computes the need from the same global split matrix, so all
grow at the same exchange (a collective rendezvous; rare, since a source sends about n / K pairs per
chunk whatever the routing, and a growth leaves 1/16 of headroom). They are counted in ``held_bytes``
(symmetric memory is not in PyTorch's allocator statistics) and in ``stats``.

Needs CUDA, every rank of the group on this host, and ``torch.distributed._symmetric_memory``;
``for_group`` answers None with the reason otherwise, and the caller keeps NCCL.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections import deque
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from .. import stats

__all__ = ["pull_plan", "CopyEngineTransport", "for_group", "held_bytes"]

log = logging.getLogger("megatron_peakflat")

_GROWTH = 1.0625
_ROUND = 2 << 20


def pull_plan(matrix: Sequence[Sequence[int]], me: int) -> list[tuple[int, int, int, int]]:
    """What rank ``me`` pulls in an all-to-all where rank s sends ``matrix[s][d]`` rows to rank d, each
    sender's rows laid out by destination: (source, first row in the source's buffer, first row here,
    rows), one entry per source with rows, ordered by source, as ``all_to_all_single`` lays them out."""
    out, here = [], 0
    for s, row in enumerate(matrix):
        n = int(row[me])
        if n:
            out.append((s, int(sum(row[:me])), here, n))
        here += n
    return out


class _Pulled:
    """One copy-engine exchange in flight; ``wait()`` orders the current stream after its copies."""

    def __init__(self, out: torch.Tensor, done: torch.cuda.Event) -> None:
        self._out, self._done = out, done

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._done)
            self._done = None
        return self._out


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
    """``torch.cuda.stream(stream)`` for a stream of ``device``. That context manager looks the current
    device up twice through ``torch.cuda``'s Python layers on every entry, which at a few exchanges per
    chunk is host time the GPU waits for; the explicit device makes each lookup one call."""
    prev = torch.cuda.current_stream(device)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(prev)


class CopyEngineTransport:
    """Copy-engine all-to-alls among the ranks of ``group`` (one host), through S symmetric slots."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, slots: int = 2) -> None:
        if slots < 2:
            raise ValueError(f"slots={slots}: the pull protocol needs at least 2")
        self.group, self.device, self.S = group, device, slots
        self.rank, self.P = dist.get_rank(group), dist.get_world_size(group)
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.slot_bytes = 0
        self.uncounted_bytes = 0  # of held_bytes, what PyTorch's allocator statistics do not show
        self._buf: torch.Tensor | None = None
        self._handle = None
        self._n = 0  # exchanges started
        self._barrier_done: deque[torch.cuda.Event] = deque(maxlen=slots)  # of the last S exchanges
        self._pending: tuple[torch.Tensor, int] | None = None  # (slot view handed out, its byte offset)

    @property
    def held_bytes(self) -> int:
        """Bytes of symmetric memory this transport holds on this GPU (S slots)."""
        return self.S * self.slot_bytes

    def _grow(self, need: int) -> None:
        """Reallocate the slots with room for ``need`` bytes each: a collective of the group."""
        if self._handle is not None:
            with _on(self.stream, self.device):  # every peer is past its pulls from the old slots
                self._handle.barrier()
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        import torch.distributed._symmetric_memory as symm_mem

        size = -(-max(need, int(self.slot_bytes * _GROWTH)) // _ROUND) * _ROUND
        self._buf = self._handle = None
        before = torch.cuda.memory_allocated(self.device)
        buf = symm_mem.empty(self.S * size, dtype=torch.uint8, device=self.device)
        counted = torch.cuda.memory_allocated(self.device) - before
        self._handle = symm_mem.rendezvous(buf, self.group)
        self._buf, self.slot_bytes = buf, size
        self.uncounted_bytes = max(0, self.held_bytes - counted)
        self._barrier_done.clear()
        stats.peak("dispatch", "symmetric_bytes", self.held_bytes)
        log.info("peakflat dispatch: copy-engine all-to-all slots grown to %d x %.1f MiB of symmetric memory",
                 self.S, size / 2**20, extra={"per_rank": True})

    def send_buffer(self, matrix: Sequence[Sequence[int]], width: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows this rank sends, width] of ``dtype``: the next exchange's slot, free to be written on the
        current stream. ``matrix[s][d]``: rows rank s sends rank d (the same on every rank)."""
        row_bytes = width * dtype.itemsize
        need = max(int(sum(r)) for r in matrix) * row_bytes
        if need > self.slot_bytes:
            self._grow(need)
        if len(self._barrier_done) == self.S:  # slot n mod S is free after the barrier of exchange n - S + 1
            torch.cuda.current_stream(self.device).wait_event(self._barrier_done[1])
        rows = int(sum(matrix[self.rank]))
        start = (self._n % self.S) * self.slot_bytes
        view = self._buf[start:start + rows * row_bytes].view(dtype).view(rows, width)  # type: ignore[index]
        self._pending = (view, start)
        return view

    def start(self, buf: torch.Tensor, matrix: Sequence[Sequence[int]]) -> _Pulled:
        """Start the exchange of ``buf`` (the tensor ``send_buffer`` returned, now filled)."""
        if self._pending is None or self._pending[0] is not buf:
            raise RuntimeError("CopyEngineTransport.start takes the buffer of the last send_buffer call")
        start = self._pending[1]
        self._pending = None
        width, dtype = buf.shape[1], buf.dtype
        row_bytes = width * dtype.itemsize
        plan = pull_plan(matrix, self.rank)
        out = torch.empty((sum(n for *_, n in plan), width), dtype=dtype, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        handle = self._handle

        def pull(s: int, src_row: int, dst_row: int, n: int) -> None:
            src = handle.get_buffer(s, (n * row_bytes,), torch.uint8, start + src_row * row_bytes)  # type: ignore
            out[dst_row:dst_row + n].view(torch.uint8).view(-1).copy_(src)

        with _on(self.stream, self.device):
            # The rows this rank sends itself are in its own slot already: copied before the barrier, while
            # the peers are still on their way to it.
            for piece in plan:
                if piece[0] == self.rank:
                    pull(*piece)
            handle.barrier()  # type: ignore[union-attr]
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._barrier_done.append(ev)
            for piece in plan:
                if piece[0] != self.rank:
                    pull(*piece)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._n += 1
        stats.add("dispatch", "copy_engine_exchanges", 1)
        return _Pulled(out, done)


_transports: dict[tuple[int, int], CopyEngineTransport | str] = {}


def for_group(group: dist.ProcessGroup | None, device: torch.device) -> tuple[CopyEngineTransport | None, str]:
    """The transport of ``group`` on ``device`` (built once, a collective on first use), or None and why not.

    Every rank of the group gets the same answer: the host check is all-gathered, and symmetric memory
    is only tried when every rank is on one host.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return None, "a group of one rank sends nothing"
    if device.type != "cuda":
        return None, f"copy engines need CUDA tensors ({device.type} here)"
    key = (id(group), device.index or 0)
    got = _transports.get(key)
    if got is None:
        hosts: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as e:
            got = f"torch.distributed._symmetric_memory is missing ({e})"
        else:
            got = (CopyEngineTransport(group, device) if len(set(hosts)) == 1
                   else f"the EP group spans {len(set(hosts))} hosts")
        _transports[key] = got
    return (got, "") if isinstance(got, CopyEngineTransport) else (None, got)


def held_bytes(uncounted: bool = False) -> int:
    """Symmetric memory held by every copy-engine transport of this process; ``uncounted``: only what
    ``torch.cuda.max_memory_allocated`` does not include (a benchmark adds that to its peaks)."""
    return sum(t.uncounted_bytes if uncounted else t.held_bytes
               for t in _transports.values() if isinstance(t, CopyEngineTransport))
