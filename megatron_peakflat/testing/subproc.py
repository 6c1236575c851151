"""Run the package's entry points in a fresh interpreter, as a user would, and read Megatron's log.

Tests of ``megatron_peakflat.pretrain`` (through ``testing.pretrain_dryrun`` on CPU) need a process of
their own: Megatron's initialisation is global and one-shot; so do the Triton kernels' tests under
``TRITON_INTERPRET=1``, which must be set before triton is imported. Every child gets the repository
root in front of the caller's PYTHONPATH (which may be where Megatron itself lives). Test use only.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from typing import Callable

from .distributed import PORT_ATTEMPTS, free_port, port_taken

__all__ = ["ROOT", "DRY_RUN", "TINY_GPT_ARGS", "MODEL_BUILT", "child_env", "run_module", "run_on_free_port", "run_interpreted",
           "interpreter_gap", "probe_interpreter", "INTERPRETER_PROBE",
           "logged", "memory_report", "second_resumed_log"]

MODEL_BUILT = "> number of parameters on"
"""What Megatron's ``get_model`` prints once the model is built: a run refused at start-up must not print it."""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root (put on PYTHONPATH and used as the working directory)."""

TINY_GPT_ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --num-experts 4 "
                 "--moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-token-dispatcher-type alltoall "
                 "--disable-bias-linear --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 "
                 "--global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 256 "
                 "--log-interval 1 --eval-iters 0 --eval-interval 1000 --position-embedding-type rope").split()
"""Megatron flags of a tiny MoE GPT on mock data (add --train-iters), small enough for a CPU dry run."""


DRY_RUN = "megatron_peakflat.testing.pretrain_dryrun"
"""The module ``run_module`` runs on ranks forked from the preloaded server (``testing.forked_module``): it hides
the GPUs and installs the CPU shim itself, as the server's ranks expect."""


def run_module(module: str, *argv: str, nproc: int = 1, timeout: int = 400,
               launcher: bool | None = None) -> subprocess.CompletedProcess:
    """``python -m module argv`` from the repository root (on PYTHONPATH, warnings off); with ``nproc`` > 1
    (or ``launcher=True``) under ``torch.distributed.run`` on that many local ranks, on a free port
    (``run_on_free_port``). The CPU dry run (``DRY_RUN``) runs so on ranks forked from the server that imported
    torch and Megatron once (``testing.forked_module``, which says what matches a fresh interpreter); with
    ``PEAKFLAT_TEST_RANKS=spawn`` it too starts fresh interpreters under torchrun."""
    if launcher is None:
        launcher = nproc > 1
    if module == DRY_RUN and os.environ.get("PEAKFLAT_TEST_RANKS", "forkserver") != "spawn":
        from .forked_module import run_forked

        env = child_env()
        if launcher:  # the launcher serves the store on a port it holds: nothing to start again
            return run_forked(module, list(argv), nproc=nproc, launcher=True, env=env, cwd=ROOT, timeout=timeout)
        return _on_free_port(lambda port: run_forked(module, list(argv), nproc=nproc, launcher=False,
                                                     env={**env, "MASTER_PORT": str(port)}, cwd=ROOT,
                                                     timeout=timeout))

    def command(port: int) -> list[str]:
        launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port)]
        return [sys.executable, *(launch if launcher else []), "-m", module, *argv]

    return run_on_free_port(command, child_env(), timeout=timeout)


def run_on_free_port(command: Callable[[int], list[str]], env: dict[str, str], *,
                     timeout: int) -> subprocess.CompletedProcess:
    """Run ``command(port)`` from the repository root with ``env`` and ``MASTER_PORT=port``, on a port from
    ``free_port``; a run whose output says the port was taken by then runs again on another (up to
    ``PORT_ATTEMPTS`` runs), so that parallel test processes do not fail each other."""
    return _on_free_port(lambda port: subprocess.run(command(port), capture_output=True, text=True, timeout=timeout,
                                                     env={**env, "MASTER_PORT": str(port)}, cwd=ROOT))


def _on_free_port(start: Callable[[int], subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
    """``start(port)`` on a port from ``free_port``, again on another while its output says the port was taken."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        res = start(free_port())
        if res.returncode == 0 or attempt == PORT_ATTEMPTS or not port_taken(res.stdout + res.stderr):
            return res
    raise AssertionError("unreachable")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: the repository root first on PYTHONPATH, warnings off, ``extra``."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore", **extra)


INTERPRETER_PROBE = r"""
import torch, triton, triton.language as tl

@triton.jit
def _loop(n_ptr, out_ptr):
    acc = 0
    for _ in range(tl.load(n_ptr + tl.program_id(0))):
        acc += 1
    tl.store(out_ptr + tl.program_id(0), acc)

out = torch.zeros(2, dtype=torch.int32)
try:
    _loop[(2,)](torch.tensor([3, 0], dtype=torch.int32), out)
except Exception as e:  # only the known gap is a reason to skip; anything else fails the probe
    if "0-dimensional arrays can be converted to Python scalars" not in str(e):
        raise
    print(f"triton {triton.__version__}'s interpreter: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    raise SystemExit(0)
assert out.tolist() == [3, 0], out
"""


@functools.cache
def interpreter_gap() -> str | None:
    """Why the installed Triton's interpreter cannot run the package's kernels, or None when it can.

    The kernels loop over a count loaded from memory (``for _ in range(tl.load(p))``). Triton 3.6's
    interpreter converts that count with ``int()`` of a one-element array, which NumPy 2.x refuses (3.8
    squeezes it first); the compiled kernels are unaffected (tests/gpu). A probe kernel finds out, once; any
    other failure of the probe raises, so that the kernels' tests never skip for an unknown reason."""
    return probe_interpreter(INTERPRETER_PROBE)


def probe_interpreter(probe: str) -> str | None:
    """Run ``probe`` under ``TRITON_INTERPRET=1``: what it printed (the gap it found), or None when it printed
    nothing. Raises RuntimeError when the probe itself failed."""
    res = run_interpreted(probe)
    if res.returncode != 0:
        raise RuntimeError(f"the Triton interpreter probe failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return res.stdout.strip() or None


def run_interpreted(script: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -c script`` with ``TRITON_INTERPRET=1`` (the Triton kernels on CPU) from the repository root."""
    return subprocess.run([sys.executable, "-c", script], env=child_env(TRITON_INTERPRET="1"), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def logged(text: str, key: str) -> list[float]:
    """Every number Megatron's training log prints after ``key: `` (e.g. 'lm loss', 'grad norm'), in order."""
    return [float(x) for x in re.findall(re.escape(key) + r": ([0-9.E+-]+)", text)]


_ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.E+-]+)")


def iteration_ms(text: str) -> list[float]:
    """Each logged iteration's own time in ms, in order. Megatron 0.19's ``training_log`` does not reset its
    interval timer at a run's first report (``should_reset = not is_first_iteration``), so with
    ``--log-interval 1`` the figure it logs at iteration 2 is the mean of iterations 1 and 2, the warm-up
    included; that one is undone here (2 x logged2 - logged1). Other figures are returned as logged."""
    found = [(int(i), float(ms)) for i, ms in _ITERATION_MS.findall(text)]
    times = [ms for _, ms in found]
    if len(found) >= 2 and found[0][0] == 1 and found[1][0] == 2:
        times[1] = 2 * times[1] - times[0]
    return times


def second_resumed_log(straight: list[float], saved_at: int) -> float:
    """The 'lm loss' Megatron 0.19 logs at the second iteration after resuming from a checkpoint saved
    after ``saved_at`` iterations, for a resume that trains exactly as the uninterrupted run ``straight``
    (losses by iteration): the mean of the first two resumed iterations' losses. ``training_log`` does
    not reset its loss sums after a run's first report (``should_reset = not is_first_iteration``)."""
    return (straight[saved_at] + straight[saved_at + 1]) / 2


_MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)"
                     r"(?: \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+))?")


def memory_reports(text: str) -> dict[int, dict[str, float]]:
    """Megatron's memory reports in a log, by the iteration they follow (the last one printed after it, rank 0 of
    the data-parallel group): MiB ``allocated``, ``max_allocated``, and ``reserved``, ``max_reserved`` where the
    line has them."""
    out: dict[int, dict[str, float]] = {}
    for m in _MEMORY.finditer(text):
        names = ("allocated", "max_allocated", "reserved", "max_reserved")
        out[int(m.group(1))] = {k: float(v) for k, v in zip(names, m.groups()[1:]) if v is not None}
    return out


def memory_report(text: str, iteration: int = 2) -> tuple[float, float] | None:
    """(allocated, max allocated) MiB of the last memory report Megatron's log prints after ``iteration``
    iterations (rank 0 of the data-parallel group), or None when it printed none."""
    found = memory_reports(text).get(iteration)
    return (found["allocated"], found["max_allocated"]) if found else None
