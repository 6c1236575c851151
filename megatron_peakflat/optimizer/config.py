"""Knobs of OffloadStreamAdamW: ``--peakflat-optimizer`` and ``--peakflat-opt-*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ..config_base import Count, ComponentConfig, PeakflatConfigError


@dataclass(kw_only=True)
class OptimizerConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "opt"
    MODE_FIELD: ClassVar[str] = "impl"
    MODE_FLAG: ClassVar[str] = "optimizer"
    MEGATRON_FLAGS: ClassVar[tuple[str, ...]] = ("--use-distributed-optimizer", "--optimizer-cpu-offload",
                                                 "--use-precision-aware-optimizer")
    """Megatron's flags that 'offload-stream' needs: only with them does Megatron build the
    HybridDeviceOptimizer that OffloadStreamAdamW takes the place of (start-up checks them)."""

    impl: Literal["megatron", "offload-stream"] = "megatron"
    """Offloaded optimizer. 'offload-stream' keeps fp32 master weights and Adam moments in pinned
    host buckets and pipelines upload / GPU Adam / write-back, in place of HybridDeviceOptimizer.
    Pass it with Megatron's --use-distributed-optimizer --optimizer-cpu-offload
    --use-precision-aware-optimizer (the path on which Megatron builds HybridDeviceOptimizer)."""
    bucket: Count = 50_000_000
    """Parameters per bucket (e.g. 50M). The GPU holds slots x bucket x 16 bytes of staging."""
    engine: Literal["auto", "gpu", "cpu"] = "auto"
    """Where Adam runs: 'gpu' streams buckets through the GPU, 'cpu' runs the host kernel,
    'auto' splits buckets between both so that PCIe and the host cores finish together. The split
    follows measured speed and the two kernels round a few parameters' last bit differently, so
    'auto' runs do not repeat bit for bit; under Megatron's --deterministic-mode it resolves to 'gpu'."""
    slots: int = 3
    """GPU staging slots (2 or 3): upload i+1, update i, write back i-1."""
    host_threads: int | None = None
    """Threads of the host Adam kernel. Default: the cores of this rank's share of the node."""

    def validate(self) -> None:
        if self.bucket < 1:
            raise PeakflatConfigError(self.flag("bucket"), self.bucket, "a bucket holds at least one parameter",
                                      "pass a count such as --peakflat-opt-bucket 50M")
        if self.slots not in (2, 3):
            raise PeakflatConfigError(self.flag("slots"), self.slots, "the pipeline needs 2 or 3 staging slots",
                                      "pass --peakflat-opt-slots 2 or 3")
        if self.host_threads is not None and self.host_threads < 1:
            raise PeakflatConfigError(self.flag("host_threads"), self.host_threads, "at least one thread is needed",
                                      "pass a positive integer or 'auto'")
