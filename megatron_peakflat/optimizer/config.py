"""Knobs of OffloadStreamAdamW: ``--peakflat-optimizer`` and ``--peakflat-optimizer-*``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..config_base import Count, ComponentConfig, PeakflatConfigError, megatron_arg as _get

log = logging.getLogger("megatron_peakflat")


FP32_GRADS_FLAG = "--accumulate-allreduce-grads-in-fp32"
"""The Megatron flag OffloadStreamAdamW needs under --fp16 with clipping on (``fp16_grads_clipped``)."""


@dataclass(kw_only=True)
class OptimizerConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "optimizer"
    FORMER_PREFIXES: ClassVar[tuple[str, ...]] = ("opt",)
    """``--peakflat-opt-*``, the knobs' spelling before they took the component's name: still read, with a
    warning."""
    MODE_FIELD: ClassVar[str] = "impl"
    MODE_FLAG: ClassVar[str] = "optimizer"
    MEGATRON_FLAGS: ClassVar[tuple[str, ...]] = ("--use-distributed-optimizer", "--optimizer-cpu-offload",
                                                 "--use-precision-aware-optimizer")
    """Megatron's flags that 'offload-stream' needs: only with them does Megatron build the
    HybridDeviceOptimizer that OffloadStreamAdamW takes the place of (start-up checks them)."""
    MEGATRON_FLAGS_WHERE_NEEDED: ClassVar[tuple[str, ...]] = (FP32_GRADS_FLAG,)
    """Megatron's flags that 'offload-stream' needs on some lines (fp32 gradients under --fp16): a recommendation
    adds them there, and like ``MEGATRON_FLAGS`` they belong to the component."""

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
                                      f"pass a count such as {self.flag('bucket')} 50M")
        if self.slots not in (2, 3):
            raise PeakflatConfigError(self.flag("slots"), self.slots, "the pipeline needs 2 or 3 staging slots",
                                      f"pass {self.flag('slots')} 2 or 3")
        if self.host_threads is not None and self.host_threads < 1:
            raise PeakflatConfigError(self.flag("host_threads"), self.host_threads, "at least one thread is needed",
                                      "pass a positive integer or 'auto'")

    def check_against_megatron(self, args: Any) -> None:
        """Refuse, at start-up, the Megatron flags beside which OffloadStreamAdamW cannot run (Megatron's parsed
        args); under --deterministic-mode, resolve engine 'auto' to 'gpu'."""
        if self.impl == "megatron":
            return
        flag = self.flag("impl")
        if _get(args, "optimizer", "adam") != "adam":
            raise PeakflatConfigError(flag, self.impl,
                                      f"OffloadStreamAdamW implements Adam(W), not --optimizer {_get(args, 'optimizer')}",
                                      "pass --optimizer adam")
        # Megatron builds HybridDeviceOptimizer, the class OffloadStreamAdamW takes the place of, only inside
        # its DistributedOptimizer under --optimizer-cpu-offload, which it ties to
        # --use-precision-aware-optimizer. The user passes all three.
        needed = self.MEGATRON_FLAGS
        missing = [f for f in needed if not _get(args, f.lstrip("-").replace("-", "_"), False)]
        if missing:
            raise PeakflatConfigError(flag, self.impl,
                                      "it takes the place of the offloaded optimizer that Megatron builds only with "
                                      f"{' '.join(needed)}", "add " + " ".join(missing))
        if _get(args, "deterministic_mode", False) and self.engine == "auto":
            self.engine = "gpu"
            log.info(f"peakflat optimizer: --deterministic-mode: {self.flag('engine')} auto -> gpu (auto splits buckets "
                     "between the GPU and host kernels by measured speed, and the two round a few parameters' last "
                     "bit differently, so runs would not repeat bit for bit)")
        if not _get(args, "decoupled_weight_decay", True):
            raise PeakflatConfigError(flag, self.impl, "it implements AdamW (decoupled weight decay)",
                                      "drop --no-decoupled-weight-decay")
        _check_offload_stream_megatron_knobs(flag, self.impl, args)


def _is_fp32(dtype: Any) -> bool:
    """Megatron's dtype flags hold 'fp32' before its validation and torch.float32 after it."""
    return dtype is None or str(dtype) in ("fp32", "torch.float32")


def _check_offload_stream_megatron_knobs(flag: str, impl: str, args: Any) -> None:
    """Megatron flags of the offloaded optimizer that OffloadStreamAdamW would otherwise ignore or fail on."""
    if _get(args, "optimizer_cuda_graph", False):
        raise PeakflatConfigError(flag, impl,
                                  "--optimizer-cuda-graph records the optimizer step as a CUDA graph, and "
                                  "OffloadStreamAdamW's step streams buckets through the host (host work and "
                                  "host-to-device copies a graph cannot replay)", f"drop --optimizer-cuda-graph, or drop {flag}")
    fraction = _get(args, "optimizer_offload_fraction", 1.0)
    if fraction is not None and fraction != 1.0:
        raise PeakflatConfigError(flag, impl,
                                  f"it keeps the whole optimizer shard on the host (--optimizer-offload-fraction is "
                                  f"{fraction}); where Adam's math runs is --peakflat-optimizer-engine's choice",
                                  "drop --optimizer-offload-fraction (or set it to 1.0)")
    for dest in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if not _is_fp32(_get(args, dest, None)):
            name = "--" + dest.replace("_", "-")
            raise PeakflatConfigError(flag, impl,
                                      f"it keeps fp32 master weights and moments ({name} is {_get(args, dest)})",
                                      f"drop {name}, or drop {flag}")
    clip = _get(args, "clip_grad", 1.0)
    if fp16_grads_clipped(bool(_get(args, "fp16")), bool(_get(args, "accumulate_allreduce_grads_in_fp32")), clip):
        raise PeakflatConfigError(flag, impl,
                                  f"with --fp16 Megatron keeps fp16 gradients, and its gradient clipping (--clip-grad "
                                  f"{clip}) refuses fp16 gradients of an offloaded optimizer at the first step",
                                  "add --accumulate-allreduce-grads-in-fp32, or train with --bf16 (or --clip-grad 0)")


def fp16_grads_clipped(fp16: bool, grads_fp32: bool, clip_grad: float | None) -> bool:
    """Whether an offloaded optimizer would meet fp16 gradients in Megatron's gradient clipping, which refuses them
    at the first step: --fp16 without ``FP32_GRADS_FLAG`` and with clipping on. The start-up check refuses such a
    line, and the planner's recommendation adds the flag (and plans fp32 gradients) instead."""
    return fp16 and not grads_fp32 and bool(clip_grad)
