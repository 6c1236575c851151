"""``python -m module argv`` on N local ranks, each forked from the rank launcher's fork server, as torchrun would
start them: the CPU dry runs of the pretrain entry without importing torch and Megatron again in every rank.

A fresh interpreter spent 6-9 s of CPU importing torch and Megatron before Megatron's start-up began, once per rank
and once more for torchrun's own process: most of a dry run's time on a 2-core machine. Here every rank is a child of
the fork server that ``testing.distributed`` starts (``testing.rank_preload`` imported, GPUs hidden).

Guarantees, as ``subprocess.run([python, (-m torch.distributed.run --nproc-per-node N), -m, module, *argv])`` gives:
- each rank runs ``module`` as ``__main__`` (``runpy``, ``sys.argv`` as ``-m`` sets it) from ``cwd``, with exactly
  ``env`` as its environment and, under the launcher, torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_*``/``MASTER_*``/
  ``TORCHELASTIC_*``; only what torch and Megatron read while being imported comes from the fork server's start;
- under the launcher the caller serves the rendezvous store, as torchrun's agent does, on a port the kernel gave
  it (``testing.distributed.served_store``): no other process can take it before the ranks join;
- under the launcher each rank leads a session of its own, as torchrun's workers do (a rank that SIGKILLs its
  process group kills itself and its own children, never the caller);
- every rank writes to one stdout and one stderr, returned as text; the exit status is the rank's own without the
  launcher, else 0 when every rank exited 0 and 1 otherwise, the other ranks stopped once one failed and each failed
  rank named on stderr with its exit code or signal (``Signal 9 (SIGKILL)``), as torchrun reports it;
- a rank exits as the interpreter would: ``SystemExit``'s code, 1 with the traceback for any other exception, the
  exit handlers run, and the multiprocessing children it left (a checkpoint writer's Manager) ended with it;
- past ``timeout`` seconds every rank's group is killed and ``subprocess.TimeoutExpired`` raised, as
  ``subprocess.run`` does.
Test use only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .distributed import _HIDDEN, _end_children, _rank_context, served_store

__all__ = ["run_forked"]

_STOP_GRACE_S = 30.0
"""How long the other ranks get between SIGTERM and SIGKILL once one failed (torchrun's default)."""


class _Streams:
    """File descriptors handed to a forked rank (duplicated through the fork server), its stdout and stderr."""

    def __init__(self, *fds: int) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _detach, tuple(reduction.DupFd(fd) for fd in self.fds)


def _detach(*dup_fds: Any) -> tuple[int, ...]:
    return tuple(d.detach() for d in dup_fds)


def _exit_code(code: object) -> int:
    """The status the interpreter exits with for ``SystemExit(code)`` (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _rank(module: str, argv: list[str], rank: int, nproc: int, launcher: bool, environ: dict[str, str], cwd: str,
          streams: tuple[int, int]) -> None:
    import atexit
    import runpy
    import traceback
    import warnings

    if launcher:
        os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    if launcher:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                          ROLE_NAME="default", MASTER_ADDR="127.0.0.1", TORCHELASTIC_RESTART_COUNT="0",
                          TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="True")
    for fd, std in zip(streams, (1, 2)):
        os.dup2(fd, std)
        os.close(fd)
    os.chdir(cwd)
    warnings.resetwarnings()
    for option in filter(None, environ.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # type: ignore[attr-defined]  # as the interpreter reads the variable
    code = 0
    try:
        sys.argv = [module, *argv]  # runpy puts the module's path first, as -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - the interpreter prints it and exits 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    _end_children()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _signal_group(proc: Any, sig: int) -> None:
    """``sig`` to the rank's process group (it leads one under the launcher), else to the rank alone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def _stop(procs: list[Any], grace_s: float) -> None:
    """SIGTERM each live rank's group, SIGKILL what is left after ``grace_s`` seconds, then reap them all."""
    from multiprocessing.connection import wait

    live = [p for p in procs if p.exitcode is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while live and time.monotonic() < end:
        wait([p.sentinel for p in live], timeout=max(0.0, end - time.monotonic()))
        live = [p for p in live if p.exitcode is None]
    for p in live:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.join()


def _describe(rank: int, pid: int | None, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"rank {rank} (pid {pid}) failed: Signal {-code} ({name})"
    return f"rank {rank} (pid {pid}) failed: exit code {code}"


def run_forked(module: str, argv: list[str], *, nproc: int, launcher: bool, env: dict[str, str], cwd: str,
               timeout: float) -> subprocess.CompletedProcess:
    """``module`` run with ``argv`` on ``nproc`` forked ranks (``launcher``: as torchrun starts them, its store
    served here; without, the one rank finds its port in ``env``, as ``python -m`` would); the module docstring says
    what matches a fresh interpreter's run."""
    if nproc > 1 and not launcher:
        raise ValueError(f"{nproc} ranks need the launcher")
    if not launcher:
        return _run(module, argv, nproc, launcher, env, cwd, timeout)
    with served_store(timeout) as port:
        return _run(module, argv, nproc, launcher, {**env, "MASTER_PORT": str(port)}, cwd, timeout)


def _run(module: str, argv: list[str], nproc: int, launcher: bool, env: dict[str, str], cwd: str,
         timeout: float) -> subprocess.CompletedProcess:
    from multiprocessing.connection import wait

    ctx, _ = _rank_context(True)
    environ = {**env, **_HIDDEN}
    command = [module, *argv] if not launcher else ["torchrun", "--nproc-per-node", str(nproc), "-m", module, *argv]
    with tempfile.TemporaryDirectory(prefix="peakflat-forked-") as tmp:
        paths = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        files = [open(p, "ab", buffering=0) for p in paths]  # append mode: the ranks' writes never overwrite
        try:
            procs = [ctx.Process(target=_rank, args=(module, list(argv), r, nproc, launcher, environ, cwd,
                                                     _Streams(*(f.fileno() for f in files))), daemon=False)
                     for r in range(nproc)]
            for p in procs:
                p.start()
        finally:
            for f in files:
                f.close()
        deadline = time.monotonic() + timeout
        timed_out = False
        while True:
            live = [p for p in procs if p.exitcode is None]
            if not live or any(p.exitcode for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            wait([p.sentinel for p in live], timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        failed = [(r, p.pid, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
        _stop(procs, 0.0 if timed_out else _STOP_GRACE_S)
        if launcher and failed:
            with open(paths[1], "a") as err:
                err.write("".join(f"[forked launcher] {_describe(*f)}\n" for f in failed))
        stdout, stderr = (open(p, encoding="utf-8", errors="replace").read() for p in paths)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    code = procs[0].exitcode if not launcher else int(any(p.exitcode for p in procs))
    return subprocess.CompletedProcess(command, code, stdout, stderr)
