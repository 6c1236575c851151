"""The two ways a bucket is updated, and the streams and events that pipeline them.

- GPU engine: upload bucket i+1's fp32 state (master, exp_avg, exp_avg_sq) into a staging slot,
  run torch's fused AdamW on bucket i in its slot, write bucket i-1's state back to the host. The
  GPU holds ``slots`` staging slots and nothing else. The uploads and write-backs are issued either by
  the extension's ``BucketStreamer`` (csrc/stream_engine.cpp: one call per bucket and direction, its
  own streams and events, GIL released) or by ``Streams`` from Python; both queue the same copies in
  the same order, so the two are bitwise equal.
- CPU engine: copy bucket i+1's gradients down, run the host AdamW kernel on bucket i, copy bucket
  i-1's new parameters up. Only gradients and parameters cross PCIe.

On a machine without CUDA the same code runs on CPU tensors: streams and events become no-ops and
copies are synchronous, so the math and the order of operations are those of the GPU run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import stats
from .host_adam import host_adamw_
from .layout import Bucket

__all__ = ["Streams", "Slot", "HostSlot", "GroupHyper", "run_gpu_engine", "CpuEngineWorker"]


@dataclass(frozen=True)
class GroupHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


class Streams:
    """CUDA side streams when the device is CUDA; on CPU every stream is None and every method a no-op."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        make = (lambda: torch.cuda.Stream(device)) if self.cuda else (lambda: None)
        self.up, self.down = make(), make()  # GPU engine: state upload, state write-back
        self.host_down, self.host_up = make(), make()  # CPU engine: gradients down, new params up

    def on(self, stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` current (nothing on CPU)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def event(self, stream=None):
        """Record an event on ``stream`` (the current stream when None); None on CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream())
        return ev

    def wait(self, stream, event) -> None:
        """``stream`` waits for ``event`` (nothing on CPU or when ``event`` is None)."""
        if self.cuda and event is not None:
            stream.wait_event(event)

    @staticmethod
    def sync(event) -> None:
        if event is not None:
            event.synchronize()


class Slot:
    """One GPU staging slot: fp32 state [3, bucket] and an fp32 gradient [bucket]."""

    def __init__(self, bucket: int, device: torch.device):
        self.state = torch.empty(3, bucket, dtype=torch.float32, device=device)
        self.grad = torch.empty(bucket, dtype=torch.float32, device=device)
        self.free = None  # event: the slot's last write-back has finished


class HostSlot:
    """One host staging slot of the CPU engine: gradients down, new parameters up (pinned when possible).

    The gradient buffer is fp32-sized; bf16 gradients travel as bf16 (half the PCIe bytes) in its front half.
    """

    def __init__(self, grad: torch.Tensor, out: torch.Tensor):
        self._grad32, self.out = grad, out
        self.free = None  # event: the slot's last upload has finished

    def grad(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bfloat16:
            return self._grad32.view(torch.bfloat16)[: self._grad32.numel()]
        return self._grad32


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    g = getattr(p, "decoupled_grad", None)
    return p.grad if g is None else g


def _calls(bucket: Bucket, steps: Sequence[int], has_grad: Sequence[bool]):
    """Pieces of ``bucket`` grouped by (param group, step): one fused call each."""
    out: dict[tuple[int, int], list] = {}
    for pc in bucket.pieces:
        if has_grad[pc.param]:
            out.setdefault((pc.group, steps[pc.param]), []).append(pc)
    return out


class _SlotWriteBack:
    """A bucket's write-back queued by the native ``BucketStreamer``: ``synchronize()`` waits for its
    slot's latest write-back, which is this bucket's or a later one queued behind it on the same stream."""

    __slots__ = ("slot", "streamer")

    def __init__(self, streamer, slot: int):
        self.streamer, self.slot = streamer, slot

    def synchronize(self) -> None:
        self.streamer.synchronize(self.slot)


def run_gpu_engine(buckets: Sequence[Bucket], *, params: Sequence[torch.Tensor], steps: Sequence[int],
                   has_grad: Sequence[bool], hyper: Sequence[GroupHyper], master: torch.Tensor,
                   exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, slots: Sequence[Slot], streams: Streams,
                   step_tensor: Callable[[int], torch.Tensor], native=None) -> list:
    """Issue the GPU engine's pipeline for ``buckets``; return one write-back handle per bucket, whose
    ``synchronize()`` returns once that bucket's state is back on the host (None on CPU).

    ``native`` (the extension's ``BucketStreamer``) issues each upload and write-back in one call;
    without it ``streams`` does. Either way: an upload waits for its slot's previous write-back, the
    update waits for the upload on the current stream (where the gradients were produced), a write-back
    waits for the current stream. Nothing here waits on the host.
    """
    host = (master, exp_avg, exp_avg_sq)
    stats.record("optimizer", "stream_engine", "native" if native is not None else "torch")
    done = []
    for i, b in enumerate(buckets):
        si = i % len(slots)
        slot = slots[si]
        n, lo = b.numel, b.start
        # upload: after the slot's previous write-back
        if native is not None:
            native.upload(si, slot.state, host, lo, n)
        else:
            streams.wait(streams.up, slot.free)
            with streams.on(streams.up):
                for k in range(3):
                    slot.state[k, :n].copy_(host[k][lo:lo + n], non_blocking=True)
            uploaded = streams.event(streams.up)
            if streams.cuda:
                torch.cuda.current_stream().wait_event(uploaded)
        # update, on the current stream (where the gradients were produced)
        groups = _calls(b, steps, has_grad)
        for (gi, step), pieces in groups.items():
            ps, gs, ms, vs = [], [], [], []
            for pc in pieces:
                g = _grad_of(params[pc.param])
                dst = slot.grad[pc.at:pc.at + pc.numel]
                dst.copy_(g.reshape(-1)[pc.lo:pc.hi])
                ps.append(slot.state[0, pc.at:pc.at + pc.numel])
                gs.append(dst)
                ms.append(slot.state[1, pc.at:pc.at + pc.numel])
                vs.append(slot.state[2, pc.at:pc.at + pc.numel])
            h = hyper[gi]
            st = step_tensor(step)
            torch._fused_adamw_(ps, gs, ms, vs, [], [st] * len(ps), lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                                weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)
            for pc, pm in zip(pieces, ps):
                params[pc.param].data.view(-1)[pc.lo:pc.hi].copy_(pm)
        # write back, after the update
        if native is not None:
            native.write_back(si, slot.state, host, lo, n)
            done.append(_SlotWriteBack(native, si))
            continue
        computed = streams.event()
        streams.wait(streams.down, computed)
        with streams.on(streams.down):
            for k in range(3):
                host[k][lo:lo + n].copy_(slot.state[k, :n], non_blocking=True)
        slot.free = streams.event(streams.down)
        done.append(slot.free)
    return done


class CpuEngineWorker:
    """Runs the CPU engine's pipeline for some buckets, on a host thread beside the GPU engine."""

    def __init__(self, buckets: Sequence[Bucket], *, params: Sequence[torch.Tensor], steps: Sequence[int],
                 has_grad: Sequence[bool], hyper: Sequence[GroupHyper], master: torch.Tensor,
                 exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, slots: Sequence[HostSlot], streams: Streams,
                 start_event, threads: int | None, ext, impl: str):
        self.buckets, self.params, self.steps, self.has_grad = buckets, params, steps, has_grad
        self.hyper, self.master, self.exp_avg, self.exp_avg_sq = hyper, master, exp_avg, exp_avg_sq
        self.slots, self.streams, self.start_event = slots, streams, start_event
        self.threads, self.ext, self.impl = threads, ext, impl
        self.done: list = []
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread: threading.Thread | None = None

    def _grad_dtype(self, b: Bucket) -> torch.dtype:
        dts = {_grad_of(self.params[pc.param]).dtype for pc in b.pieces if self.has_grad[pc.param]}
        return torch.bfloat16 if dts == {torch.bfloat16} else torch.float32

    def _download(self, i: int):
        b, slot, s = self.buckets[i], self.slots[i % len(self.slots)], self.streams
        dst = slot.grad(self.grad_dtypes[i])
        s.wait(s.host_down, self.start_event)
        with s.on(s.host_down):
            for pc in b.pieces:
                if self.has_grad[pc.param]:
                    g = _grad_of(self.params[pc.param])
                    dst[pc.at:pc.at + pc.numel].copy_(g.reshape(-1)[pc.lo:pc.hi], non_blocking=True)
        return s.event(s.host_down)

    def _run(self) -> None:
        t0 = time.perf_counter()
        s, nb, R = self.streams, len(self.buckets), len(self.slots)
        self.grad_dtypes = [self._grad_dtype(b) for b in self.buckets]
        down = [None] * nb
        for j in range(min(R, nb)):
            down[j] = self._download(j)
        for i, b in enumerate(self.buckets):
            slot = self.slots[i % R]
            Streams.sync(down[i])
            Streams.sync(slot.free)  # the previous upload from slot.out has left
            for (gi, step), pieces in _calls(b, self.steps, self.has_grad).items():
                h = self.hyper[gi]
                for a, z in _runs(pieces):
                    host_adamw_(self.master[b.start + a:b.start + z], slot.grad(self.grad_dtypes[i])[a:z],
                                self.exp_avg[b.start + a:b.start + z], self.exp_avg_sq[b.start + a:b.start + z],
                                slot.out[a:z], lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                                weight_decay=h.weight_decay, step=step, threads=self.threads, ext=self.ext,
                                impl=self.impl)
            if i == 0:
                s.wait(s.host_up, self.start_event)  # nothing overwrites a param the step's caller still reads
            with s.on(s.host_up):
                for pc in b.pieces:
                    if self.has_grad[pc.param]:
                        self.params[pc.param].data.view(-1)[pc.lo:pc.hi].copy_(
                            slot.out[pc.at:pc.at + pc.numel], non_blocking=True)
            slot.free = s.event(s.host_up)
            self.done.append(slot.free)
            if i + R < nb:
                down[i + R] = self._download(i + R)  # the kernel has consumed slot.grad
        self.seconds = time.perf_counter() - t0

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - re-raised on join, in the caller's thread
            self.error = e

    def start(self, background: bool) -> None:
        if background:
            self._thread = threading.Thread(target=self._guarded, name="peakflat-cpu-adam", daemon=True)
            self._thread.start()
        else:
            self._guarded()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error


def _runs(pieces) -> list[tuple[int, int]]:
    """Merge pieces that are adjacent inside the bucket into contiguous runs (one kernel call each)."""
    runs: list[tuple[int, int]] = []
    for pc in sorted(pieces, key=lambda p: p.at):
        if runs and runs[-1][1] == pc.at:
            runs[-1] = (runs[-1][0], pc.at + pc.numel)
        else:
            runs.append((pc.at, pc.at + pc.numel))
    return runs
