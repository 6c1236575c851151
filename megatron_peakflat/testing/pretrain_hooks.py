"""Test-only hooks around ``megatron_peakflat.pretrain``: a per-iteration trace, a fault, a faked host.

``python -m megatron_peakflat.testing.pretrain_hooks <flags>`` runs the pretrain entry (on the GPU, one
process per rank as torchrun starts it) with the hooks that these environment variables ask for; the CPU
dry run (``testing.pretrain_dryrun``) installs the same hooks. Nothing here is imported by the runtime path.

- ``PEAKFLAT_TEST_TRACE=<dir>``: each rank appends one JSON line per training iteration to
  ``<dir>/rank<r>.jsonl``: the iteration, the loss and grad norm that Megatron's ``train_step`` returned
  (``float.hex``, so that equal means bitwise equal), ``consumed_train_samples`` before the iteration,
  a SHA-256 of the micro-batches this rank read (tokens, labels, loss mask, positions), and SHA-256s of
  the RNG states when the iteration began (Python, NumPy, torch's CPU generator, the CUDA generator where
  there is one, and each state of Megatron's CUDA RNG tracker).
- ``PEAKFLAT_TEST_KILL_AT=<iteration>``: inside that iteration's forward (a forward pre-hook on the last
  decoder layer, so the first layers' forward has run and nothing of backward or the optimizer step has),
  write ``<trace dir>/killed.rank<r>`` and send SIGKILL to this process's group when it leads one (as
  torchrun's workers do), else to this process alone (never to the caller's group).
- ``PEAKFLAT_TEST_MEM_AVAILABLE=<bytes>``: ``runtime.host.mem_available`` reports this many bytes, as if the
  node had that little free host memory (every budget and check that reads it sees the figure).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Any

__all__ = ["install", "main", "read_trace"]

TRACE, KILL_AT, MEM_AVAILABLE = "PEAKFLAT_TEST_TRACE", "PEAKFLAT_TEST_KILL_AT", "PEAKFLAT_TEST_MEM_AVAILABLE"
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()[:16]


def _tensor_bytes(t: Any) -> bytes:
    import torch

    if t is None:
        return b"none"
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous()
        return str((t.dtype, tuple(t.shape))).encode() + t.view(torch.uint8).numpy().tobytes()
    return repr(t).encode()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _rng_digests() -> dict[str, str]:
    """SHA-256s of every RNG state Megatron's checkpoint saves and restores."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    out = {"python": _sha(repr(random.getstate()).encode()),
           "numpy": _sha(repr(np.random.get_state()).encode()),
           "torch": _sha(_tensor_bytes(torch.get_rng_state())),
           "cuda": _sha(_tensor_bytes(torch.cuda.get_rng_state())) if torch.cuda.is_available() else "none"}
    for name, st in sorted(tensor_parallel.get_cuda_rng_tracker().get_states().items()):
        out[f"tracker:{name}"] = _sha(_tensor_bytes(st))
    return out


def _hexes(value: Any) -> list[str]:
    import torch

    if isinstance(value, torch.Tensor):
        return [float(x).hex() for x in value.detach().double().cpu().reshape(-1).tolist()]
    return [float(value).hex()]


class _Trace:
    """The record of the iteration in flight, written when ``train_step`` returns."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.batches: list[str] = []

    def write(self, record: dict[str, Any]) -> None:
        with open(os.path.join(self.directory, f"rank{_rank()}.jsonl"), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _kill_in_forward(model: Any, directory: str, iteration: int) -> None:
    """Arm a forward pre-hook on the last decoder layer that records the fault and SIGKILLs this process."""
    from megatron.core.utils import get_attr_wrapped_model

    chunk = model[0] if isinstance(model, list) else model
    layer = get_attr_wrapped_model(chunk, "decoder").layers[-1]

    def kill(module: Any, args: Any) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"killed.rank{_rank()}"), "w") as f:
            f.write(f"iteration {iteration}, in the forward of the last decoder layer\n")
            f.flush()
            os.fsync(f.fileno())
        sys.stdout.flush()
        sys.stderr.flush()
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    layer.register_forward_pre_hook(kill)


def install() -> None:
    """Install the hooks the environment asks for (none when none of the variables is set)."""
    mem = os.environ.get(MEM_AVAILABLE)
    if mem:
        from megatron_peakflat.runtime import host

        fake = int(mem)
        host.mem_available = lambda path="/proc/meminfo": fake  # type: ignore[assignment]
    directory, kill_at = os.environ.get(TRACE), os.environ.get(KILL_AT)
    if not directory and not kill_at:
        return
    directory = directory or os.getcwd()
    from megatron.training import get_args, training

    from megatron_peakflat.cli import pretrain

    trace = _Trace(directory)
    real_get_batch, real_train_step = pretrain.get_batch, training.train_step

    def get_batch(data_iterator: Any, vp_stage: Any) -> Any:
        batch = real_get_batch(data_iterator, vp_stage)
        if batch:
            trace.batches.append(_sha(*(_tensor_bytes(batch.get(k)) for k in _BATCH_KEYS)))
        return batch

    def train_step(forward_step_func: Any, data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        margs = get_args()
        iteration = margs.curr_iteration + 1  # the number Megatron's log gives this iteration
        record: dict[str, Any] = {"iteration": iteration, "consumed_before": int(margs.consumed_train_samples),
                                  "rng": _rng_digests()}
        if kill_at and iteration == int(kill_at):
            _kill_in_forward(model, directory, iteration)
        trace.batches = []
        out = real_train_step(forward_step_func, data_iterator, model, *args, **kwargs)
        loss_dict, grad_norm = out[0], out[5]
        record.update(batches=trace.batches, grad_norm=None if grad_norm is None else _hexes(grad_norm),
                      loss={k: _hexes(v) for k, v in sorted(loss_dict.items())}, skipped=int(out[1]))
        if directory:
            trace.write(record)
        return out

    pretrain.get_batch = get_batch
    training.train_step = train_step


def read_trace(directory: str, rank: int = 0) -> dict[int, dict[str, Any]]:
    """Rank ``rank``'s trace in ``directory``: iteration -> record (a later record of an iteration, from a
    resumed run writing into the same directory, replaces an earlier one)."""
    out: dict[int, dict[str, Any]] = {}
    path = os.path.join(directory, f"rank{rank}.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[rec["iteration"]] = rec
    return out


def main(argv: list[str]) -> None:
    """``megatron_peakflat.cli.pretrain.main(argv)`` with the hooks installed."""
    install()
    from megatron_peakflat.cli import pretrain

    pretrain.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
