"""Launch the 3-rank Ring-DTP case again and again, each rank a process of its own that ends through the
interpreter's normal exit; ``test_vocab_clean_exit.py`` runs it. ``python tests/_ring_exit_runs.py LAUNCHES``
prints one JSON line: each launch's three exit statuses (negative: killed by that signal).

A rank does what a user's script does: init a gloo process group, the loss and gradients of
``ring_linear_cross_entropy`` (V=1009 split 300/400/309, fp64, n = 1, 7 and 400, label smoothing 0.1, the
activations schedule) checked against the full cross-entropy, ``dist.destroy_process_group()``, then it returns
to the interpreter with every loss still alive, so finalization and the C++ exit handlers run as they do at the
end of a training script. The ranks are forked from this process, which has imported torch once (a fresh
interpreter per rank spends most of a launch importing torch); nothing of torch.distributed exists before the fork.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_peakflat.testing.distributed import free_port, port_taken
from megatron_peakflat.vocab import reference_linear_cross_entropy, ring_linear_cross_entropy

SHARDS = (300, 400, 309)
H = 16
PORT_TAKEN = 98
"""Exit status of a rank whose rendezvous port was taken (the launch is made again on another port)."""
KEPT: list[torch.Tensor] = []  # alive until the interpreter exits


def rank_main(rank: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1, 2])
    start = sum(SHARDS[:rank])
    for n in (1, 7, 400):
        g = torch.Generator().manual_seed(n)
        w = torch.randn(sum(SHARDS), H, generator=g, dtype=torch.float64)
        g = torch.Generator().manual_seed(10 * n + rank)
        x = torch.randn(n, H, generator=g, dtype=torch.float64)
        y = torch.randint(0, sum(SHARDS), (n,), generator=g)
        y[::3] = -100
        xs, ws = x.clone().requires_grad_(), w[start:start + SHARDS[rank]].clone().requires_grad_()
        loss = ring_linear_cross_entropy(xs, ws, y, group, schedule="activations", label_smoothing=0.1)
        loss.sum().backward()
        ref = reference_linear_cross_entropy(x, w, y, label_smoothing=0.1)
        err = float((loss.detach() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        if err > 1e-5:  # the ring's online state is fp32
            print(f"rank {rank}: n={n}: loss differs from the full cross-entropy by {err:.3g}", file=sys.stderr)
            return 3
        KEPT.append(loss)
    dist.destroy_process_group()
    return 0


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def launch(timeout: float) -> list[int]:
    """One launch: three forked ranks; their exit statuses (a rank still running at ``timeout`` is killed)."""
    port = free_port()
    pids = []
    for rank in range(3):
        pid = os.fork()
        if pid == 0:  # the rank: leaves through SystemExit, so the interpreter finalizes as after a script
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", LOCAL_WORLD_SIZE="3",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            try:
                code = rank_main(rank)
            except BaseException as e:  # noqa: BLE001
                traceback.print_exc()
                code = PORT_TAKEN if port_taken(str(e)) else 1
            sys.stdout.flush()
            raise SystemExit(code)
        pids.append(pid)
    status: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(status) < 3:
        for pid in pids:
            if pid not in status:
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = _status(raw)
        if len(status) < 3 and time.monotonic() > deadline:
            for pid in pids:
                if pid not in status:
                    os.kill(pid, signal.SIGKILL)
                    status[pid] = _status(os.waitpid(pid, 0)[1])
        time.sleep(0.01)
    return [status[pid] for pid in pids]


def main(launches: int) -> None:
    out = []
    while len(out) < launches:
        codes = launch(timeout=60)
        if PORT_TAKEN in codes and all(c in (0, 1, PORT_TAKEN) for c in codes):
            continue  # not a run: the port was taken before the rendezvous
        out.append(codes)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
