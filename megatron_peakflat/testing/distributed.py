"""Run a function in N processes (gloo on CPU, or nccl) and surface any rank's failure.

Guarantees:
- every rank runs ``fn(rank, world_size, *args)`` inside an initialised default process group
  (gloo on CPU), with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set as torchrun would set them;
- a failure on any rank is re-raised in the caller with that rank's traceback, and the other ranks
  are torn down instead of hanging in a collective;
- a rank's own child processes (a checkpoint writer's multiprocessing Manager, say) end with it;
- the whole run is bounded by ``timeout`` seconds; a rank still running then prints every thread's Python
  stack to stderr before it is terminated, so a hang says where it hung;
- the rendezvous store is served by the caller on a port the kernel gives it, listening before any rank starts,
  and every rank joins it as a client (``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's agent serves its workers):
  no other process can take the port, and no other launch's ranks can join this one's rendezvous (a drawn port
  could be taken between its choice and rank 0's bind, and two launches drawing one port joined each other's);
- ranks that are not meant to use CUDA (gloo, the default) start with ``CUDA_VISIBLE_DEVICES=""``: on a
  machine with GPUs the CPU tests' ranks see none, as on a CPU machine (the CPU shim maps Megatron's CUDA
  calls to the CPU, and a visible GPU lets what it does not cover, such as torch.compile's device checks,
  reach CUDA with CPU devices);
- those hidden ranks are forked from a fork server that has imported torch and Megatron once
  (``testing.rank_preload``), not spawned: each spawned rank spent 3-9 s of CPU importing them, most of the
  CPU suite's time on a 2-core machine. A forked rank gets the caller's environment as it is at the call, as a
  spawned one would; only what torch and Megatron read while being imported comes from the server's start.
  ``PEAKFLAT_TEST_RANKS=spawn`` spawns every rank instead. Ranks that may use CUDA are always spawned.

``fn`` must be importable by name (a module-level function), since ranks are spawned processes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp

from .._environ import environment

__all__ = ["run_distributed", "DistributedTestError", "free_port", "port_taken", "PORT_ATTEMPTS", "served_store"]

PORT_ATTEMPTS = 3
"""Starts a launcher that draws its port (``free_port``: torchrun's) makes when each one finds it taken
(``port_taken``)."""


class DistributedTestError(AssertionError):
    """Raised in the parent when one or more ranks failed; carries each rank's traceback."""


_draw = random.Random()  # a stream of its own: tests seed the global one


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """Return a TCP port that was free when asked, outside the kernel's ephemeral range where it can.

    Between this answer and the bind of whoever uses it (a launcher's store, seconds later, once Megatron is
    imported), no outgoing connection can take the port: those take their local ports from the ephemeral
    range, and parallel tests make many (gloo connects every pair of ranks), so a port drawn from that range,
    as ``bind(0)`` draws, can be taken in the meantime. Two callers may still draw the same port (about 1 in
    10^4), which is why launchers here start again on a new port (``port_taken``). Falls back to ``bind(0)``
    where the range is unknown or leaves no room.
    """
    eph = _ephemeral_range()
    room = [*range(20000, eph[0]), *range(eph[1] + 1, 65536)] if eph else []
    for _ in range(64 if len(room) >= 1000 else 0):
        port = _draw.choice(room)
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_taken(text: str) -> bool:
    """Whether a failed start's output says its rendezvous port was in use (then start again elsewhere)."""
    return "EADDRINUSE" in text or "ddress already in use" in text


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    errors: Any,
    results: Any,
    timeout_s: float,
    backend: str,
    environ: dict[str, str] | None = None,
    streams: tuple[int, int] | None = None,
) -> None:
    if environ is not None:  # forked from the server: take on the caller's environment, as a spawn would
        os.environ.clear()
        os.environ.update(environ)
    if streams is not None:  # and write where the caller's stdout and stderr go, not where the server's did
        for fd, std in zip(streams, (1, 2)):
            os.dup2(fd, std)
            os.close(fd)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the caller serves the store at MASTER_ADDR:MASTER_PORT
    )
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    import torch

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors' bytes; torch's queue pickling would share them through a file
        # descriptor that dies with this process, before the parent may have read it.
        results.put((rank, pickle.dumps(out)))
        dist.barrier()  # no rank tears its connections down while a peer may still be using them
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        errors.put((rank, traceback.format_exc()))
        _end_children()
        os._exit(1)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    # The result is delivered and every rank passed the barrier. Skipping interpreter finalization avoids
    # a known gloo teardown abort: a process group still referenced from Python (a captured group
    # handle) is destroyed during finalization, and its worker threads call std::terminate (SIGABRT).
    _end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end_children(timeout_s: float = 10.0) -> None:
    """Stop the processes this rank started and left running. ``os._exit`` skips the exit handlers that would
    stop them (the multiprocessing Manager behind the results queue of Megatron's checkpoint writer lives as
    long as its process), and they would outlive the test, holding their memory."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout_s)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, backend: str = "gloo",
    cuda: bool | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    ``backend`` is gloo (CPU, the default) or nccl (one GPU per rank, for the demo on GPU machines).
    ``cuda``: whether the ranks may see the machine's GPUs; None: only with nccl. A gloo run that builds
    its own NCCL groups passes True.

    Raises DistributedTestError naming every failed rank with its traceback. Results must be
    picklable; they are returned ordered by rank.
    """
    with served_store(timeout) as port:
        return _run_once(fn, world_size, args, timeout, backend, cuda, port)


@contextlib.contextmanager
def served_store(timeout: float) -> Iterator[int]:
    """A TCPStore server on 127.0.0.1, on a port the kernel gives it, for the block: the port, listening already.
    Ranks with ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT=<port>`` and ``TORCHELASTIC_USE_AGENT_STORE=True`` join it
    as clients, as torchrun's workers join its agent's."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


_HIDDEN = {"CUDA_VISIBLE_DEVICES": ""}


class _CallerStreams:
    """The caller's stdout and stderr (fds 1 and 2 as they are at the start), handed to a forked rank: its own
    are the fork server's, which may be another test's captured output by then."""

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return _detach_fds, (reduction.DupFd(1), reduction.DupFd(2))


def _detach_fds(*dup_fds: Any) -> tuple[int, ...]:
    return tuple(d.detach() for d in dup_fds)


def _rank_context(hidden: bool) -> tuple[Any, dict[str, str] | None]:
    """The multiprocessing context ranks start from, and the environment a forked rank must take on (None for
    spawned ranks, which inherit the caller's at their start).

    Hidden ranks fork from the fork server, started hidden (it must never see a GPU: a forked child cannot
    use CUDA once its parent has initialised it, nor unhide a device) and preloading ``rank_preload``.
    """
    if not hidden or os.environ.get("PEAKFLAT_TEST_RANKS", "forkserver") == "spawn":
        return mp.get_context("spawn"), None
    import multiprocessing.forkserver as forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron_peakflat.testing.rank_preload"])
    with environment(_HIDDEN):
        forkserver.ensure_running()  # a no-op once it runs; it starts with os.environ as it is here
    return ctx, {**os.environ, **_HIDDEN}


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, backend: str,
              cuda: bool | None, port: int) -> list[Any]:
    hidden = not (backend == "nccl" if cuda is None else cuda)
    ctx, environ = _rank_context(hidden)
    errors = ctx.SimpleQueue()
    results = ctx.SimpleQueue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, errors, results, timeout, backend, environ,
                  None if environ is None else _CallerStreams()),
            daemon=False,
        )
        for r in range(world_size)
    ]
    with environment(_HIDDEN if hidden else {}):
        for p in procs:
            p.start()
    import time

    deadline = time.monotonic() + timeout
    failed: list[tuple[int, str]] = []
    out: dict[int, Any] = {}

    def drain_results() -> None:  # a result larger than the pipe's buffer blocks its rank until read
        while not results.empty():
            r, v = results.get()
            out[r] = pickle.loads(v)

    while any(p.is_alive() for p in procs):
        while not errors.empty():
            failed.append(errors.get())
        drain_results()
        if failed or time.monotonic() > deadline:
            break
        for p in procs:
            p.join(timeout=0.05)
    timed_out = any(p.is_alive() for p in procs) and not failed
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join()
    while not errors.empty():
        failed.append(errors.get())
    if failed:
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed))
        raise DistributedTestError(f"{len(failed)} of {world_size} ranks failed:\n{body}")
    if timed_out:
        raise DistributedTestError(f"run_distributed timed out after {timeout:.0f}s (world {world_size})")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise DistributedTestError(f"ranks exited abnormally without a traceback: {bad}")
    drain_results()
    return [out.get(r) for r in range(world_size)]
