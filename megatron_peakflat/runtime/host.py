"""Host memory that the components pin: SCO's boundary pool and OffloadStreamAdamW's state.

Each sizes itself from this rank's share of ``MemAvailable`` (the node's, divided among its local ranks).
Memory that a component will pin but has not pinned yet is not missing from ``MemAvailable``, so a budget
chosen in between would count it twice. OffloadStreamAdamW allocates its state at its first step, after
SCO has sized its pool in the first forward. So a component with a fixed need ``promise``s it when it is
built and ``settle``s once it has allocated, and ``share`` subtracts what is promised. On the H200 node
(126 GiB) SCO's default budget of the 128K run was 61.5 GiB beside the optimizer's 57.4 GiB before this.

No torch import. ``mem_available`` is ``runtime.machine``'s, named here because tests and the dry-run hooks
fake it here, for ``share`` and every component that sizes itself from it.
"""

from __future__ import annotations

import threading

from .machine import local_world_size, mem_available

__all__ = ["mem_available", "local_ranks", "promise", "settle", "promised", "promised_by", "share", "reset"]

_lock = threading.Lock()
_promised: dict[str, int] = {}


def local_ranks() -> int:
    """The ranks sharing this node (torchrun's LOCAL_WORLD_SIZE; 1 when it does not say): host memory is sized
    for one rank per node where torchrun did not start several."""
    return local_world_size(default=1)


def promise(owner: str, nbytes: int) -> None:
    """Note that ``owner`` will pin ``nbytes`` of host memory (replacing its earlier promise)."""
    with _lock:
        _promised[owner] = max(0, int(nbytes))


def settle(owner: str) -> None:
    """``owner`` has allocated what it promised (``MemAvailable`` now shows it), or never will."""
    with _lock:
        _promised.pop(owner, None)


def promised(exclude: str | None = None) -> int:
    """Bytes promised in this process and not yet allocated, but for ``exclude``'s own promise."""
    with _lock:
        return sum(n for owner, n in _promised.items() if owner != exclude)


def promised_by(owner: str) -> int:
    """Bytes ``owner`` has promised and not yet allocated."""
    with _lock:
        return _promised.get(owner, 0)


def share(available: int | None = None, ranks: int | None = None, exclude: str | None = None) -> int | None:
    """This rank's share of the host's available memory, less what this process has promised (but for
    ``exclude``'s own promise); None when ``MemAvailable`` cannot be read. Every local rank is assumed to
    promise alike (they hold equal shards)."""
    available = mem_available() if available is None else available
    if available is None:
        return None
    return max(0, available // (local_ranks() if ranks is None else max(1, ranks)) - promised(exclude))


def reset() -> None:
    """Forget every promise (tests)."""
    with _lock:
        _promised.clear()
