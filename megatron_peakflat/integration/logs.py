"""The integration layer's logger and its once-per-process lines (hand-backs, chosen paths)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("megatron_peakflat")
_said: set[str] = set()


def info_once(msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log ``msg % args`` the first time this exact line comes up in the process, never again."""
    line = msg % args if args else msg
    if line not in _said:
        _said.add(line)
        log.log(level, line)
