"""The config that patched Megatron code reads at call time (set by ``apply``, cleared by ``remove``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import PeakflatConfig

_current: "PeakflatConfig | None" = None


def current() -> "PeakflatConfig":
    """The active config. Patched code only runs after ``apply``, so a missing one is a bug."""
    if _current is None:
        raise RuntimeError("megatron-peakflat patch called without an active config: call megatron_peakflat.apply() first")
    return _current


def get() -> "PeakflatConfig | None":
    return _current


def set_current(cfg: "PeakflatConfig | None") -> None:
    global _current
    _current = cfg
