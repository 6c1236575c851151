"""The [b, 1, s, s] attention mask Megatron's dataloader builds by default: when it is worth a warning, when it
stops a run. Torch-free, so that the planner, ``--peakflat auto`` and peakflat-check judge a line as start-up does
(``integration.attention`` re-exports it for start-up)."""

from __future__ import annotations

from typing import Any

from ..config_base import PeakflatConfigError

__all__ = ["MASK_WARN_BYTES", "MASK_FAIL_BYTES", "NO_MASK_FLAG", "mask_bytes", "check_dataloader_mask"]

NO_MASK_FLAG = "--no-create-attention-mask-in-dataloader"

MASK_WARN_BYTES = 256 * 2**20
"""A dataloader attention mask per micro-batch from this size on (s >= 16384 at micro-batch 1) is worth a warning."""
MASK_FAIL_BYTES = 4 * 2**30
"""... and from this size on (s >= 65536 at micro-batch 1) a start-up error: the loader's workers each hold
several such masks in host memory and are killed for it, minutes into the run."""


def mask_bytes(seq_len: int, micro_batch: int) -> int:
    """Bytes of the dataloader's bool [b, 1, s, s] mask for one micro-batch."""
    return micro_batch * seq_len * seq_len


def check_dataloader_mask(args: Any) -> str | None:
    """Reject, or warn about, the [b, 1, s, s] attention mask Megatron's dataloader builds by default.

    Megatron's loader creates it unless ``--no-create-attention-mask-in-dataloader``: s * s bytes per
    sample, prefetched by every worker, then copied to the GPU, where it also keeps SDPA off its causal
    flash kernel (an explicit mask). A causal model needs none. At 128K tokens on the H200 node the workers
    were killed for host memory before the first step. Raises PeakflatConfigError (naming
    the flag, the value and the fix) at MASK_FAIL_BYTES per micro-batch; returns a warning line from
    MASK_WARN_BYTES; else None.
    """
    s = int(getattr(args, "seq_length", 0) or 0)
    b = int(getattr(args, "micro_batch_size", 1) or 1)
    size = mask_bytes(s, b)
    if not getattr(args, "create_attention_mask_in_dataloader", False) or size < MASK_WARN_BYTES:
        return None
    problem = (f"at --seq-length {s} the dataloader builds a [{b}, 1, {s}, {s}] attention mask per micro-batch "
               f"({size / 2**30:.2f} GiB of host memory for each one its workers prefetch, then copied to the GPU)")
    fix = f"pass {NO_MASK_FLAG} (a causal model needs no mask)"
    if size >= MASK_FAIL_BYTES:
        raise PeakflatConfigError("--create-attention-mask-in-dataloader", True, problem, fix)
    return f"peakflat: --create-attention-mask-in-dataloader=True: {problem}. Fix: {fix}"
