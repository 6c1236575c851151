"""Knobs of Ring-DTP: ``--peakflat-vocab`` and ``--peakflat-vocab-*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ..config_base import ComponentConfig, PeakflatConfigError


@dataclass(kw_only=True)
class VocabConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "vocab"
    MODE_FIELD: ClassVar[str] = "impl"
    MODE_FLAG: ClassVar[str] = "vocab"

    impl: Literal["megatron", "ring-dtp"] = "megatron"
    """Output layer and loss. 'ring-dtp' computes the loss with a ring-sharded vocabulary projection
    and an online log-sum-exp, so the [tokens, vocab] logits never exist."""
    schedule: Literal["auto", "activations", "weights"] = "auto"
    """What travels around the ring: activations when tokens <= vocab/P, weights otherwise ('auto')."""
    block_size: int = 0
    """Vocabulary rows folded per block (0: automatic, one block of logits is about 128 MiB); the
    working set is one tokens x block_size block of logits."""
    kernel: Literal["auto", "triton", "torch"] = "auto"
    """Block kernel: Triton on CUDA, the plain-PyTorch blockwise path elsewhere ('auto')."""
    accumulate: Literal["fp32", "input"] = "fp32"
    """Dtype that dX (and, on a ring, dW) is summed in across vocabulary blocks: 'fp32' (exact, one fp32
    copy of dX) or 'input' (the gradients' own dtype, one rounding per block: bf16 stays at the gradient floor)."""
    check_labels: bool = False
    """Check every step that labels lie in [0, vocab) or equal ignore_index (costs one host sync)."""

    def validate(self) -> None:
        if self.block_size and self.block_size < 16:
            raise PeakflatConfigError(self.flag("block_size"), self.block_size, "blocks under 16 rows waste the GPU",
                                      "pass 0 (automatic) or a block of 1024-16384 rows, e.g. --peakflat-vocab-block-size 4096")
