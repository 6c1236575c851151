"""What this process can learn about its node without torch: host memory (/proc/meminfo), the ranks torchrun
started on the node (LOCAL_WORLD_SIZE) and the cores this process may run on.

Every reader of these in the package comes here, so that an unreadable file or a malformed variable means the
same thing everywhere: ``None`` for memory, the caller's ``default`` for the ranks. The default is an argument
and not a constant because the readers assume different things where torchrun said nothing: start-up sizes
host memory for one rank per node (``runtime.host.local_ranks``), the planner plans a full node of 8 GPUs.

Stdlib only: the planner and the start-up checks import it as well as the components.
"""

from __future__ import annotations

import os
from typing import overload

__all__ = ["MEMINFO", "meminfo_bytes", "mem_available", "mem_total", "local_world_size", "usable_cores"]

MEMINFO = "/proc/meminfo"


def meminfo_bytes(field: str, path: str = MEMINFO) -> int | None:
    """``field`` of /proc/meminfo (a ``kB`` line such as ``MemTotal``) in bytes; None where the file cannot be
    read, lacks the field or does not parse."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available(path: str = MEMINFO) -> int | None:
    """``MemAvailable`` in bytes (what can still be allocated without swapping); None where unreadable."""
    return meminfo_bytes("MemAvailable", path)


def mem_total(path: str = MEMINFO) -> int | None:
    """``MemTotal`` in bytes (the node's RAM, identical on every node of a homogeneous job); None where
    unreadable."""
    return meminfo_bytes("MemTotal", path)


@overload
def local_world_size(default: int) -> int: ...
@overload
def local_world_size(default: None) -> int | None: ...
def local_world_size(default: int | None) -> int | None:
    """The ranks sharing this node: torchrun's LOCAL_WORLD_SIZE where it is a positive integer, else
    ``default`` (unset, empty, malformed, zero or negative all mean that torchrun did not say)."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return default
    return n if n >= 1 else default


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one, else every core; at
    least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1
