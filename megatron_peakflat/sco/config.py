"""Knobs of SCO, selective checkpoint offload: ``--peakflat-sco`` and ``--peakflat-sco-*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..config_base import Bytes, ComponentConfig, PeakflatConfigError, cuda_graph_flag, megatron_arg as _get


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

    def check_against_megatron(self, args: Any) -> None:
        """Refuse, at start-up, the Megatron flags beside which SCO cannot run (Megatron's parsed args)."""
        if not self.enabled:
            return
        flag = self.flag("enabled")
        if _get(args, "recompute_granularity") != "full":
            raise PeakflatConfigError(flag, True,
                                      "SCO offloads the boundaries of full-recompute checkpoints, but "
                                      f"--recompute-granularity is {_get(args, 'recompute_granularity')!r}",
                                      ("pass --recompute-granularity full in place of "
                                       f"{_get(args, 'recompute_granularity')!r}, with" if _get(args, "recompute_granularity")
                                       else "add --recompute-granularity full")
                                      + " --recompute-method uniform --recompute-num-layers 1")
        if _get(args, "distribute_saved_activations"):
            raise PeakflatConfigError(flag, True,
                                      "--distribute-saved-activations splits boundaries across TP ranks, which SCO does not handle",
                                      "drop --distribute-saved-activations")
        if _get(args, "cpu_offloading"):
            raise PeakflatConfigError(flag, True, "legacy --cpu-offloading cannot run beside SCO",
                                      "drop --cpu-offloading")
        if _get(args, "fp8") or _get(args, "fp4"):
            raise PeakflatConfigError(flag, True,
                                      "fp8/fp4 layers checkpoint through Transformer Engine's te_checkpoint, which SCO "
                                      "does not wrap, so every boundary would stay on the GPU",
                                      "drop --fp8-format / --fp4-format, or drop " + flag)
        graphs = cuda_graph_flag(args)
        if graphs:
            raise PeakflatConfigError(flag, True,
                                      f"{graphs} captures the layers, and a captured layer records no checkpoint "
                                      "boundary for SCO to offload (SCO would hand every captured layer back to "
                                      "Megatron's recompute)", f"drop {graphs.split()[0]}, or drop {flag}")
        self._check_budget(args)

    def _check_budget(self, args: Any) -> None:
        """An explicit budget smaller than one checkpoint boundary would offload nothing, silently."""
        budget = self.budget
        seq, hidden = _get(args, "seq_length"), _get(args, "hidden_size")
        if budget is None or not seq or not hidden:
            return
        tp = (_get(args, "tensor_model_parallel_size", 1) or 1) if _get(args, "sequence_parallel", False) else 1
        cp = _get(args, "context_parallel_size", 1) or 1
        elem = 2 if (_get(args, "bf16") or _get(args, "fp16")) else 4
        boundary = seq // (tp * cp) * (_get(args, "micro_batch_size", 1) or 1) * hidden * elem
        if budget < boundary:
            raise PeakflatConfigError(self.flag("budget"), budget,
                                      f"it is smaller than one checkpoint boundary ({boundary} bytes at --seq-length {seq}, "
                                      f"--hidden-size {hidden}), so SCO would offload nothing (a bare number counts bytes)",
                                      "give a size with its unit, e.g. --peakflat-sco-budget 64GiB, or 'auto'; or drop "
                                      + self.flag("enabled"))
