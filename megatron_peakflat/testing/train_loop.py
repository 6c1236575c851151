"""A short Megatron-Core training loop: DDP, Megatron's optimizer, Megatron's pipeline schedule.

Used by the demo and by end-to-end tests, on CPU (after ``install_cpu_shim``) and on CUDA alike.
It is the same machinery ``megatron.training.pretrain`` drives (``DistributedDataParallel``,
``get_megatron_optimizer``, ``get_forward_backward_func``), without its argument parsing, data
pipeline and logging, so two runs (peakflat off and on) can be compared step by step in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

import torch

from ..cli.pretrain import loss_func

__all__ = ["TrainSetup", "build_training", "train_steps", "make_batches"]


@dataclass
class TrainSetup:
    model: Any
    """The DDP-wrapped model (a list of chunks for Megatron's schedules)."""
    optimizer: Any
    """Megatron's optimizer (DistributedOptimizer or FP32Optimizer / Float16OptimizerWithFloat16Params)."""
    config: Any
    """The TransformerConfig."""
    seq_len: int
    micro_batch: int
    losses: list[float] = field(default_factory=list)


def build_training(model: Any, config: Any, *, seq_len: int, micro_batch: int, lr: float = 1e-3,
                   use_distributed_optimizer: bool = True, optimizer_cpu_offload: bool = False,
                   weight_decay: float = 0.01, clip_grad: float = 1.0, **opt_kwargs: Any) -> TrainSetup:
    """Wrap ``model`` in Megatron's DDP and build Megatron's Adam optimizer over it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # As Megatron's training sets it: the schedule then reduces the gradients over the data-parallel (and
    # expert data-parallel) ranks after the last microbatch; without it each rank steps on its own.
    config.finalize_model_grads_func = finalize_model_grads
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=use_distributed_optimizer)
    ddp = DistributedDataParallel(config, ddp_cfg, model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                              bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
                              use_distributed_optimizer=use_distributed_optimizer,
                              optimizer_cpu_offload=optimizer_cpu_offload,
                              use_precision_aware_optimizer=optimizer_cpu_offload, **opt_kwargs)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    return TrainSetup([ddp], optimizer, config, seq_len, micro_batch)


def make_batches(n: int, seq_len: int, micro_batch: int, vocab_size: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` deterministic random batches (the same on every rank for a given seed)."""
    from .megatron_cpu import gpt_batch

    return [gpt_batch(seq_len, micro_batch, vocab_size, seed=seed + i) for i in range(n)]


def _forward_step(device: torch.device, data_iterator: Iterator, model: Any) -> tuple[torch.Tensor, Callable]:
    batch = {k: v.to(device) for k, v in next(data_iterator).items()}
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                loss_mask=batch["loss_mask"])
    return out, partial(loss_func, batch["loss_mask"])


def _set_num_microbatches(num_microbatches: int, micro_batch: int) -> None:
    """Megatron's global microbatch count, as its training loop sets it (components that need the loss's
    scale in advance read it: Ring-DTP's in-forward schedule)."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           get_num_microbatches, init_num_microbatches_calculator)

    try:
        if get_num_microbatches() == num_microbatches:
            return
    except AttributeError:  # not initialised
        pass
    dp = parallel_state.get_data_parallel_world_size()
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(parallel_state.get_data_parallel_rank(), None,
                                     num_microbatches * micro_batch * dp, micro_batch, dp)


def train_steps(setup: TrainSetup, batches: list[dict[str, torch.Tensor]], *, num_microbatches: int = 1,
                device: torch.device | str = "cpu", on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Run one optimizer step per ``num_microbatches`` batches; return the mean token loss of each step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = torch.device(device)
    _set_num_microbatches(num_microbatches, setup.micro_batch)
    fwd_bwd = get_forward_backward_func()
    it = iter(batches)
    steps = len(batches) // num_microbatches
    for step in range(steps):
        for chunk in setup.model:
            chunk.zero_grad_buffer()
        setup.optimizer.zero_grad()
        reports = fwd_bwd(forward_step_func=partial(_forward_step, device), data_iterator=it, model=setup.model,
                          num_microbatches=num_microbatches, seq_length=setup.seq_len,
                          micro_batch_size=setup.micro_batch, forward_only=False)
        setup.optimizer.step()
        loss = float("nan")
        if reports:
            tot = torch.stack([r["lm loss"] for r in reports]).sum(0)
            loss = float(tot[0] / tot[1])
        setup.losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return setup.losses
