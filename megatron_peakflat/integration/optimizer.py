"""Builds OffloadStreamAdamW where Megatron builds ``HybridDeviceOptimizer``.

Megatron constructs ``HybridDeviceOptimizer`` in ``megatron.core.optimizer`` (over the whole model)
and rebuilds it in ``DistributedOptimizer.__init__`` over this DP rank's shard, as
``HybridDeviceOptimizer(params=shard_groups, **old.defaults)``; ``DistributedOptimizer`` then tests
``isinstance(self.optimizer, HybridDeviceOptimizer)`` to take its checkpoint paths. The replacement is
therefore a subclass of the original whose ``__new__`` picks, per instance, either:

- ``OffloadStreamHybridOptimizer`` (``--peakflat-optimizer offload-stream``): OffloadStreamAdamW first in the
  MRO, so every method Megatron calls is ours, yet ``isinstance(x, HybridDeviceOptimizer)`` holds; or
- ``MegatronHybridOptimizer``: the original, unchanged (config set to 'megatron' after patching).

Megatron only reaches this class with ``--optimizer-cpu-offload --use-precision-aware-optimizer
--use-distributed-optimizer``; the user passes those flags (``PeakflatConfig`` checks them at start-up).
All of the shard's state is on the host: ``--optimizer-offload-fraction`` below 1 and non-fp32
``--main-params-dtype`` / ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` are refused at start-up.
"""

from __future__ import annotations

import logging
from typing import Any

from . import state
from .logs import info_once

__all__ = ["replace_hybrid_device_optimizer"]

log = logging.getLogger("megatron_peakflat")

_classes: dict[type, type] = {}


def replace_hybrid_device_optimizer(original_cls: type) -> type:
    """Return the class bound in place of ``HybridDeviceOptimizer`` (one per original class)."""
    if original_cls in _classes:
        return _classes[original_cls]
    from ..optimizer import OffloadStreamAdamW

    class PeakflatHybridDeviceOptimizer(original_cls):  # type: ignore[misc, valid-type]
        """Megatron's HybridDeviceOptimizer, or OffloadStreamAdamW under --peakflat-optimizer offload-stream."""

        def __new__(cls, *args: Any, **kwargs: Any):
            if cls is PeakflatHybridDeviceOptimizer:
                cfg = state.get()
                if cfg is not None and cfg.optimizer.impl == "offload-stream":
                    cls = OffloadStreamHybridOptimizer
                else:
                    log.info("peakflat optimizer: --peakflat-optimizer is %r; Megatron's HybridDeviceOptimizer runs",
                             None if cfg is None else cfg.optimizer.impl)
                    cls = MegatronHybridOptimizer
            return object.__new__(cls)

    class MegatronHybridOptimizer(PeakflatHybridDeviceOptimizer):
        """The original HybridDeviceOptimizer, unchanged."""

    class OffloadStreamHybridOptimizer(OffloadStreamAdamW, PeakflatHybridDeviceOptimizer):
        """OffloadStreamAdamW with HybridDeviceOptimizer's constructor signature."""

        def __init__(self, params: Any, offload_fraction: float = 1.0, cpu_optimizer_cls: Any = None,
                     gpu_optimizer_cls: Any = None, param_update_in_fp32: bool = True, pin_cpu_grads: bool = True,
                     pin_cpu_params: bool = True, overlap_cpu_optimizer_d2h_h2d: bool = True, **kwargs: Any):
            opt = state.current().optimizer
            if not kwargs.pop("bias_correction", True):
                raise ValueError("OffloadStreamAdamW implements AdamW with bias correction; got bias_correction=False")
            kwargs.pop("fused", None)
            if "momentum" in kwargs:
                raise ValueError("--peakflat-optimizer offload-stream implements Adam(W); Megatron asked for SGD")
            # HybridDeviceOptimizer's knobs, unused here, are kept in ``defaults`` so that DistributedOptimizer's
            # rebuild (``cls(params=..., **defaults)``) and its checkpoints see them; the optimizer classes as
            # None: a class in the param groups makes --ckpt-format torch checkpoints unloadable
            # (torch.load with weights_only=True refuses it).
            knobs = dict(offload_fraction=offload_fraction, cpu_optimizer_cls=None,
                         gpu_optimizer_cls=None, param_update_in_fp32=param_update_in_fp32,
                         pin_cpu_grads=pin_cpu_grads, pin_cpu_params=pin_cpu_params,
                         overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d, bias_correction=True)
            hyper = {k: kwargs.pop(k) for k in ("lr", "betas", "eps", "weight_decay") if k in kwargs}
            OffloadStreamAdamW.__init__(self, params, **hyper, bucket=int(opt.bucket), engine=opt.engine,
                                        slots=opt.slots, host_threads=opt.host_threads,
                                        pin=pin_cpu_params, **knobs, **kwargs)
            # DistributedOptimizer builds each of its optimizers twice, first over every parameter of its group and
            # then over this rank's shard: one line, without a count; each optimizer's own line at its first step
            # (``holds ... parameters``) gives what it keeps.
            info_once("peakflat optimizer: OffloadStreamAdamW replaces HybridDeviceOptimizer (bucket %s, engine %s, "
                      "%d slots)", f"{int(opt.bucket):,}", opt.engine, opt.slots)

    for c in (PeakflatHybridDeviceOptimizer, MegatronHybridOptimizer, OffloadStreamHybridOptimizer):
        c.__module__ = __name__
    _classes[original_cls] = PeakflatHybridDeviceOptimizer
    return PeakflatHybridDeviceOptimizer
