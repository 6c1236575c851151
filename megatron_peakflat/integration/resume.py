"""Start-up checks against the checkpoint a run resumes from (``--load``), before the model is built.

Megatron saves its args in every checkpoint. A peakflat flag that changes the shapes Megatron's loader
expects fails only inside ``load_checkpoint``, after the model and optimizer are built; reading the saved
args first turns that into a start-up error naming the flag and the fix. Only the distributed
checkpoint's common state (``common.pt`` or its ``common_state`` object, a few KB) is read; a legacy
``--ckpt-format torch`` file holds the whole rank's model, so it is not read here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import PeakflatConfig, PeakflatConfigError

log = logging.getLogger("megatron_peakflat")

__all__ = ["check_resume", "saved_args"]


def saved_args(args: Any) -> Any | None:
    """The args stored in the distributed checkpoint that ``args.load`` resumes from; None when there is
    none to read (no ``--load``, no tracker file, another format, or an unreadable checkpoint)."""
    load = getattr(args, "load", None)
    if not load or getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        return None
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    try:
        from megatron.core import dist_checkpointing
        from megatron.training.checkpointing import get_checkpoint_name

        with open(tracker) as f:
            text = f.read().strip()
        release = text == "release"
        iteration = getattr(args, "ckpt_step", None) or (0 if release else int(text))
        state = dist_checkpointing.load_common_state_dict(
            get_checkpoint_name(load, iteration, release, return_base_dir=True))
        return state.get("args")
    except Exception as e:  # the real load reports its own errors; this check only helps where it can read
        log.info("peakflat: the saved args in --load %s were not read at start-up (%s: %s)", load,
                 type(e).__name__, e)
        return None


def check_resume(args: Any, cfg: PeakflatConfig) -> None:
    """Raise PeakflatConfigError when resuming ``args.load`` with ``cfg`` would fail inside Megatron's load.

    ``--peakflat-vocab-shard-over-ep`` changes the output layer's local shape and so the distributed
    optimizer's gradient buckets: the model's weights load across it (the distributed checkpoint holds the
    shard as rows of the whole), the optimizer's state only from a checkpoint saved fully reshardable.
    """
    if getattr(args, "no_load_optim", False) or getattr(args, "finetune", False) \
            or not getattr(args, "use_distributed_optimizer", False):
        return
    saved = saved_args(args)
    if saved is None:
        return
    flag = cfg.vocab.flag("shard_over_ep")
    before = bool(getattr(saved, "peakflat_vocab_shard_over_ep", False)) \
        and getattr(saved, "peakflat_vocab_impl", "megatron") != "megatron"
    now = bool(cfg.vocab.shard_over_ep) and cfg.vocab.impl != "megatron"
    if before == now or getattr(saved, "dist_ckpt_optim_fully_reshardable", False):
        return
    raise PeakflatConfigError(
        flag, now,
        f"the checkpoint in --load {args.load} was saved with it {'on' if before else 'off'}, and its distributed "
        "optimizer state (saved without --dist-ckpt-optim-fully-reshardable) fixes each gradient bucket's size, "
        "which this flag changes: the load would fail after the model is built",
        f"resume with the flag as it was saved ({'add' if before else 'drop'} {flag}), or with --no-load-optim; "
        "to turn it on or off at a resume, save with --dist-ckpt-optim-fully-reshardable")
