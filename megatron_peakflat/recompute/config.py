"""Knobs of SCO, selective checkpoint offload: ``--peakflat-sco`` and ``--peakflat-sco-*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ..config_base import Bytes, ComponentConfig, PeakflatConfigError


@dataclass(kw_only=True)
class SCOConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "sco"
    MODE_FIELD: ClassVar[str] = "enabled"
    MODE_FLAG: ClassVar[str] = "sco"

    enabled: bool = False
    """Keep each full-recompute checkpoint boundary's input in pinned host memory until backward."""
    budget: Bytes | None = None
    """Pinned host bytes per rank for boundaries (e.g. 64GiB). Default: half of this rank's share of the
    free host RAM (divided among the local ranks), less the state --peakflat-optimizer offload-stream will
    pin at its first step; boundaries past the budget stay on the GPU."""
    prefetch: int = 1
    """How many boundaries backward brings back ahead of use."""
    pool: Literal["torch", "native"] = "torch"
    """Host pool: 'torch' pins slots lazily as boundaries arrive (torch rounds each up to a power of
    two); 'native' maps and pins the whole budget once at start-up in the compiled extension, at
    exact sizes (falls back to 'torch', logged, when the extension is not built)."""

    def validate(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise PeakflatConfigError(self.flag("budget"), self.budget, "a byte budget cannot be negative",
                                      "pass a size such as --peakflat-sco-budget 32GiB, or 'auto'")
        if self.pool not in ("torch", "native"):
            raise PeakflatConfigError(self.flag("pool"), self.pool, "unknown host pool",
                                      "pass --peakflat-sco-pool torch (default) or native")
        if self.prefetch < 0:
            raise PeakflatConfigError(self.flag("prefetch"), self.prefetch, "prefetch depth cannot be negative",
                                      "pass 0 (no prefetch) or more, e.g. --peakflat-sco-prefetch 1")
