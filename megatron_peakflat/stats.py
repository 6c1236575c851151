"""What each component did, for the logs, the demo's table and the runtime peak report.

Components record counters here (e.g. SCO's offloaded bytes, the dispatch chunk count); nothing
here imports Megatron. Thread-safe enough for one training process: plain dict updates.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

_stats: dict[str, dict[str, Any]] = defaultdict(dict)


def record(component: str, key: str, value: Any) -> None:
    """Set ``component.key`` to ``value``."""
    _stats[component][key] = value


def add(component: str, key: str, value: float) -> None:
    """Add ``value`` to the counter ``component.key``."""
    _stats[component][key] = _stats[component].get(key, 0) + value


def peak(component: str, key: str, value: float) -> None:
    """Keep the maximum seen for ``component.key``."""
    _stats[component][key] = max(_stats[component].get(key, value), value)


def snapshot() -> dict[str, dict[str, Any]]:
    """A copy of everything recorded so far."""
    return {k: dict(v) for k, v in _stats.items()}


def reset() -> None:
    _stats.clear()
