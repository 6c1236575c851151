"""Start-up checks against the checkpoint a run resumes from (``--load``), before the model is built.

Megatron saves its args in every checkpoint. A peakflat flag that changes the shapes Megatron's loader
expects fails only inside ``load_checkpoint``, after the model and optimizer are built; reading the saved
args first turns that into a start-up error naming the flag and the fix. The checkpoint's format is
told from what is on disk, as Megatron's load tells it. Of a distributed checkpoint only the common state
is read (``common.pt``, or its ``common_state`` object, which reads the checkpoint's ``.metadata`` too, as
Megatron's own load does on every rank); of a legacy ``--ckpt-format torch`` checkpoint, rank 0's file
memory-mapped, so that its tensors are not read.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import PeakflatConfig, PeakflatConfigError

log = logging.getLogger("megatron_peakflat")

__all__ = ["check_resume", "saved_state"]


def saved_state(args: Any) -> tuple[dict, bool, str] | None:
    """(the saved state, whether it is a release checkpoint, its format: ``"torch_dist"`` or ``"torch"``) of
    the checkpoint that Megatron will load for ``args``; None when there is none to read: no ``--load``, no
    tracker file, another format, non-persistent checkpoints configured (Megatron may load one of those
    instead), a path that is not a local file system, or an unreadable checkpoint."""
    load = getattr(args, "load", None)
    if not load or getattr(args, "non_persistent_ckpt_type", None):
        return None
    try:
        import torch
        from megatron.core import dist_checkpointing
        from megatron.training.checkpointing import (find_checkpoint_rank_0, get_checkpoint_name,
                                                     get_checkpoint_tracker_filename)

        tracker = get_checkpoint_tracker_filename(load)
        if not os.path.isfile(tracker):
            return None
        with open(tracker) as f:
            text = f.read().strip()
        release = text == "release"
        iteration = getattr(args, "ckpt_step", None) or (0 if release else int(text))
        base = get_checkpoint_name(load, iteration, release, return_base_dir=True)
        if dist_checkpointing.check_is_distributed_checkpoint(base):
            return dist_checkpointing.load_common_state_dict(base), release, "torch_dist"
        rank0 = find_checkpoint_rank_0(load, iteration, release)
        if rank0 is None or not os.path.isfile(rank0):
            return None
        # torch.load's default weights_only, as Megatron's own load of this file uses
        return torch.load(rank0, map_location="cpu", mmap=True), release, "torch"
    except Exception as e:  # the real load reports its own errors; this check only helps where it can read
        log.info("peakflat: the saved args in --load %s were not read at start-up (%s: %s)", load,
                 type(e).__name__, e)
        return None


def _optimizer_state_reshardable(state: dict, saved: Any) -> bool:
    """Whether the checkpoint's distributed-optimizer state follows a change of the model's local shapes,
    decided as Megatron's load decides it: from the content metadata, or for checkpoints without one
    (megatron-core < 0.13) from the saved args."""
    try:
        from megatron.core import dist_checkpointing
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=state)
        if meta and meta.get("distrib_optim_sharding_type"):
            return meta["distrib_optim_sharding_type"] in DistributedOptimizer.checkpoint_fully_reshardable_formats
    except Exception:  # no content metadata to read: decided from the saved args below
        pass
    if getattr(saved, "dist_ckpt_optim_fully_reshardable", False):
        return True
    return bool(getattr(saved, "ckpt_fully_parallel_save", False))  # 'fully_sharded_model_space'


def check_resume(args: Any, cfg: PeakflatConfig) -> None:
    """Raise PeakflatConfigError when resuming ``args.load`` with ``cfg`` would fail inside Megatron's load.

    ``--peakflat-vocab-shard-over-ep`` changes the output layer's local shape and so the distributed
    optimizer's gradient buckets. A distributed checkpoint holds the shard as rows of the whole, so the
    model's weights load across the flag, and the optimizer's state only from a checkpoint saved fully
    reshardable; that is refused only where Megatron would load that state: not for a release checkpoint,
    ``--finetune``, ``--no-load-optim``, no distributed optimizer, or a checkpoint saved with
    ``--no-save-optim``. A ``--ckpt-format torch`` checkpoint holds each rank's local tensors, so not even
    the weights load across it: every such toggle is refused.
    """
    found = saved_state(args)
    if found is None:
        return
    state, release, fmt = found
    saved = state.get("args") if isinstance(state, dict) else None
    if saved is None:
        return
    flag = cfg.vocab.flag("shard_over_ep")
    before = bool(getattr(saved, "peakflat_vocab_shard_over_ep", False)) \
        and getattr(saved, "peakflat_vocab_impl", "megatron") != "megatron"
    now = bool(cfg.vocab.shard_over_ep) and cfg.vocab.impl != "megatron"
    if before == now:
        return
    as_saved = f"resume with the flag as it was saved ({'add' if before else 'drop'} {flag})"
    if fmt == "torch":
        raise PeakflatConfigError(
            flag, now,
            f"the --ckpt-format torch checkpoint in --load {args.load} was saved with it {'on' if before else 'off'}, "
            "and that format keeps each rank's local tensors, whose shapes this flag changes: the model's weights "
            "would not load, after the model is built",
            f"{as_saved}; to turn it on or off at a resume, save in --ckpt-format torch_dist")
    if getattr(args, "no_load_optim", False) or getattr(args, "finetune", False) \
            or not getattr(args, "use_distributed_optimizer", False):
        return
    if release or getattr(saved, "no_save_optim", False) or _optimizer_state_reshardable(state, saved):
        return
    raise PeakflatConfigError(
        flag, now,
        f"the checkpoint in --load {args.load} was saved with it {'on' if before else 'off'}, and its distributed "
        "optimizer state (saved without --dist-ckpt-optim-fully-reshardable) fixes each gradient bucket's size, "
        "which this flag changes: the load would fail after the model is built",
        f"{as_saved}, or with --no-load-optim; "
        "to turn it on or off at a resume, save with --dist-ckpt-optim-fully-reshardable")
