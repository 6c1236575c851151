"""Start-up checks against the checkpoint a run resumes from (``--load``), before the model is built.

Megatron saves its args in every checkpoint. A peakflat flag that changes the shapes Megatron's loader
expects fails only inside ``load_checkpoint``, after the model and optimizer are built; reading the saved
args first turns that into a start-up error naming the flag and the fix: a ``--peakflat-vocab-shard-over-ep``
toggle the checkpoint cannot follow, and (Megatron's own limit, met when a run moves to another expert
layout to fit) optimizer state saved by another chain of optimizers than this run builds. The checkpoint's format is
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
from ..planner.model import experts_have_own_optimizer as own_optimizer_rule

log = logging.getLogger("megatron_peakflat")

__all__ = ["check_optimizer_chain", "check_resume", "check_vocab_shard_toggle", "optimizer_count",
           "saved_optimizer_count", "saved_state"]


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


def _loads_optimizer_state(args: Any, saved: Any, release: bool) -> bool:
    """Whether Megatron's load will restore optimizer state from the checkpoint: not for a release checkpoint,
    ``--finetune``, ``--no-load-optim``, or a checkpoint saved with ``--no-save-optim``."""
    return not (release or getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)
                or getattr(saved, "no_save_optim", False))


def saved_optimizer_count(state: dict) -> int | None:
    """How many optimizers Megatron's ChainedOptimizer held when it saved ``state``: one optimizer's state is a
    dict of its own (``optimizer``, ``param_groups``, ...), a chain of several a dict keyed 0..n-1 (torch_dist)
    or a list (``--ckpt-format torch``). None where the checkpoint holds no optimizer state."""
    saved = state.get("optimizer") if isinstance(state, dict) else None
    if isinstance(saved, list):
        return len(saved)
    if isinstance(saved, dict) and saved:
        return len(saved) if all(isinstance(k, int) for k in saved) else 1
    return None


def _expert_layout(a: Any) -> tuple[int, int, int]:
    """(EP, ETP, TP) of Megatron args, ETP defaulting to TP as Megatron's validation sets it."""
    tp = getattr(a, "tensor_model_parallel_size", 1) or 1
    return getattr(a, "expert_model_parallel_size", 1) or 1, getattr(a, "expert_tensor_parallel_size", None) or tp, tp


def experts_have_own_optimizer(args: Any) -> bool:
    """Whether Megatron gives the expert parameters of ``args`` an optimizer of their own (the model has MoE
    layers, and ``planner.model.experts_have_own_optimizer`` holds for its layout)."""
    freq = getattr(args, "moe_layer_freq", 1)
    if not getattr(args, "num_experts", None) or (isinstance(freq, list) and not any(freq)):
        return False
    return own_optimizer_rule(*_expert_layout(args))


def optimizer_count(args: Any) -> int | None:
    """How many optimizers ``get_megatron_optimizer`` chains on every rank for ``args``: one for the dense
    parameters (two with ``--overlap-param-gather-with-optimizer-step``), and one more where the experts have
    their own. None under pipeline parallelism, where a stage may hold no MoE layer (a layer frequency or
    pattern, a custom pipeline layout, an embedding-only stage) and so build one optimizer fewer, and under
    Megatron FSDP, which chains its own way."""
    if getattr(args, "use_megatron_fsdp", False) or (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        return None
    dense = 2 if getattr(args, "overlap_param_gather_with_optimizer_step", False) else 1
    return dense + int(experts_have_own_optimizer(args))


def _layout(a: Any) -> str:
    ep, etp, tp = _expert_layout(a)
    return f"--expert-model-parallel-size {ep}, --expert-tensor-parallel-size {etp}, --tensor-model-parallel-size {tp}"


def _whose(own: bool) -> str:
    return "the experts in an optimizer of their own" if own else "one optimizer for experts and dense alike"


def check_optimizer_chain(args: Any, state: dict, saved: Any, release: bool) -> None:
    """Raise PeakflatConfigError when the checkpoint's optimizer state was saved by another number of chained
    optimizers than this run builds: Megatron's ``ChainedOptimizer.load_state_dict`` cannot map one onto the
    other and fails after the model is built (a KeyError, "Expected 2 entries", or a missing parameter group,
    with the distributed optimizer or without). That happens when a resume moves the experts into or out of
    an optimizer of their own, e.g. EP 2 -> 1. Raised only where Megatron would load that state and this
    run's count is the same on every rank."""
    if not _loads_optimizer_state(args, saved, release):
        return
    before, now = saved_optimizer_count(state), optimizer_count(args)
    if before is None or now is None or before == now:
        return
    flag, value = "--expert-model-parallel-size", _expert_layout(args)[0]
    own_before, own_now = experts_have_own_optimizer(saved), experts_have_own_optimizer(args)
    if own_before == own_now:
        flag, value = "--overlap-param-gather-with-optimizer-step", \
            bool(getattr(args, "overlap_param_gather_with_optimizer_step", False))
        layout = f"{flag} {'on' if getattr(saved, 'overlap_param_gather_with_optimizer_step', False) else 'off'}"
    else:
        layout = _layout(saved)
    raise PeakflatConfigError(
        flag, value,
        f"the checkpoint in --load {args.load} holds the state of {before} chained optimizer(s), saved with "
        f"{_layout(saved)} ({_whose(own_before)}), and this run builds {now} ({_layout(args)}: {_whose(own_now)}); "
        "Megatron's ChainedOptimizer.load_state_dict cannot map one onto the other and would fail after the "
        "model is built",
        f"resume with {layout} (the experts have an optimizer of their own whenever EP > 1 or ETP != TP), "
        "or add --no-load-optim to load the weights and start the optimizer state afresh")


def check_resume(args: Any, cfg: PeakflatConfig) -> None:
    """Raise PeakflatConfigError when resuming ``args.load`` with ``cfg`` would fail inside Megatron's load:
    a ``--peakflat-vocab-shard-over-ep`` toggle the checkpoint cannot follow (``check_vocab_shard_toggle``),
    or optimizer state saved by another chain of optimizers (``check_optimizer_chain``). Nothing is raised
    where the checkpoint cannot be read here; Megatron's load then reports what it finds."""
    found = saved_state(args)
    if found is None:
        return
    state, release, fmt = found
    saved = state.get("args") if isinstance(state, dict) else None
    if saved is None:
        return
    check_vocab_shard_toggle(args, cfg, state, saved, release, fmt)
    check_optimizer_chain(args, state, saved, release)


def check_vocab_shard_toggle(args: Any, cfg: PeakflatConfig, state: dict, saved: Any, release: bool,
                             fmt: str) -> None:
    """Raise PeakflatConfigError when ``--peakflat-vocab-shard-over-ep`` is turned on or off across this resume
    and the checkpoint cannot follow.

    The flag changes the output layer's local shape and so the distributed optimizer's gradient buckets.
    A distributed checkpoint holds the shard as rows of the whole, so the model's weights load across the
    flag, and the optimizer's state only from a checkpoint saved fully reshardable; that is refused only
    where Megatron would load that state: not for a release checkpoint, ``--finetune``, ``--no-load-optim``,
    no distributed optimizer, or a checkpoint saved with ``--no-save-optim``. A ``--ckpt-format torch``
    checkpoint holds each rank's local tensors, so not even the weights load across it: every such toggle is
    refused.
    """
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
    if not getattr(args, "use_distributed_optimizer", False) or not _loads_optimizer_state(args, saved, release):
        return
    if _optimizer_state_reshardable(state, saved):
        return
    raise PeakflatConfigError(
        flag, now,
        f"the checkpoint in --load {args.load} was saved with it {'on' if before else 'off'}, and its distributed "
        "optimizer state (saved without --dist-ckpt-optim-fully-reshardable) fixes each gradient bucket's size, "
        "which this flag changes: the load would fail after the model is built",
        f"{as_saved}, or with --no-load-optim; "
        "to turn it on or off at a resume, save with --dist-ckpt-optim-fully-reshardable")
