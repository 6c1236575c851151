"""The extension's ``BucketStreamer`` (csrc/stream_engine.cpp) behind Python argument checks.

Every argument is checked here, before anything native runs, and a bad one raises a RuntimeError
naming what is wrong; the native checks are a last line. (They once ended the process instead: on
the H200 image the extension carried a C++ runtime of its own, see ``_build.cxx_runtime_link_args``.)
A message the native side returns is raised the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["NativeStreamer"]


class NativeStreamer:
    """Upload / write back fp32 optimizer state buckets on the extension's own CUDA streams and events."""

    def __init__(self, ext: Any, slots: int, device: int) -> None:
        if slots < 1:
            raise RuntimeError(f"peakflat BucketStreamer: slots must be >= 1, got {slots}")
        n = torch.cuda.device_count()
        if not 0 <= device < n:
            visible = " (no CUDA device is visible)" if n == 0 else ""
            raise RuntimeError(f"peakflat BucketStreamer: device must be a CUDA device index in [0, {n}), "
                               f"got {device}{visible}")
        self._native = ext.BucketStreamer(slots, device)

    @staticmethod
    def _raise(message: str) -> None:
        if message:
            raise RuntimeError(message)

    def _check(self, what: str, slot: int, state: torch.Tensor, host: Sequence[torch.Tensor], start: int,
               numel: int) -> list[torch.Tensor]:
        p = f"peakflat BucketStreamer.{what}"
        if not 0 <= slot < self.slots:
            raise RuntimeError(f"{p}: slot must be in [0, {self.slots}), got {slot}")
        if not state.is_cuda or state.device.index != self.device:
            raise RuntimeError(f"{p}: state must be a CUDA tensor on cuda:{self.device}, got one on {state.device}")
        if state.dtype != torch.float32:
            raise RuntimeError(f"{p}: state must be float32, got {state.dtype}")
        if state.dim() != 2 or state.shape[0] != 3:
            raise RuntimeError(f"{p}: state must be [3, bucket] (master, exp_avg, exp_avg_sq), got shape "
                               f"{list(state.shape)}")
        if state.stride(1) != 1:
            raise RuntimeError(f"{p}: state rows must be contiguous (stride 1 in dim 1), got strides {state.stride()}")
        if not 0 <= numel <= state.shape[1]:
            raise RuntimeError(f"{p}: numel must be in [0, {state.shape[1]}] (the slot holds {state.shape[1]} "
                               f"elements per row), got {numel}")
        if start < 0:
            raise RuntimeError(f"{p}: start must be >= 0, got {start}")
        host = list(host)
        if len(host) != 3:
            raise RuntimeError(f"{p}: host must hold 3 tensors (master, exp_avg, exp_avg_sq), got {len(host)}")
        for k, h in enumerate(host):
            if h.device.type != "cpu":
                raise RuntimeError(f"{p}: host[{k}] must be a CPU tensor, got one on {h.device}")
            if h.dtype != torch.float32:
                raise RuntimeError(f"{p}: host[{k}] must be float32, got {h.dtype}")
            if not h.is_contiguous():
                raise RuntimeError(f"{p}: host[{k}] must be contiguous")
            if start + numel > h.numel():
                raise RuntimeError(f"{p}: host[{k}] has {h.numel()} elements, the bucket needs [{start}, "
                                   f"{start + numel})")
            if not h.is_pinned():
                raise RuntimeError(f"{p}: host[{k}] must be pinned (page-locked) memory; a pageable buffer would "
                                   "make every copy synchronous")
        return host

    def upload(self, slot: int, state: torch.Tensor, host: Sequence[torch.Tensor], start: int, numel: int) -> None:
        """Queue host[k][start:start+numel] -> state[k, :numel] after the slot's last write-back; the
        current stream waits for it."""
        host = self._check("upload", slot, state, host, start, numel)
        self._raise(self._native.upload(slot, state, host, start, numel))

    def write_back(self, slot: int, state: torch.Tensor, host: Sequence[torch.Tensor], start: int,
                   numel: int) -> None:
        """Queue state[k, :numel] -> host[k][start:start+numel] after the current stream's work; marks the slot."""
        host = self._check("write_back", slot, state, host, start, numel)
        self._raise(self._native.write_back(slot, state, host, start, numel))

    def synchronize(self, slot: int = -1) -> None:
        """Block until slot ``slot``'s last write-back (-1: every copy) has finished."""
        if not -1 <= slot < self.slots:
            raise RuntimeError(f"peakflat BucketStreamer.synchronize: slot must be -1 (all) or in [0, {self.slots}), "
                               f"got {slot}")
        self._raise(self._native.synchronize(slot))

    @property
    def slots(self) -> int:
        return self._native.slots

    @property
    def device(self) -> int:
        return self._native.device

    @property
    def upload_stream(self) -> int:
        return self._native.upload_stream

    @property
    def download_stream(self) -> int:
        return self._native.download_stream
