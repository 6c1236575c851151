"""A plain-torch GroupedLinear with Transformer Engine's parameter layout, so that CPU tests (and GPUs
without TE) can build Megatron's ``TEGroupedMLP``.

``TEGroupedMLP`` takes its two projections from builders (``GroupedMLPSubmodules``); with TE these are
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``, subclasses of TE's
``GroupedLinear``, which hold one [out, in] parameter ``weight{i}`` per local expert and return
``(output, bias)`` from ``forward(x, m_splits)``. ``TorchGroupedLinear`` does the same with
``torch.nn.functional.linear`` per split: Megatron's TEGroupedMLP code (its activation, probability
scale and glue) then runs unchanged around it. Test use only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["TorchGroupedLinear"]


class TorchGroupedLinear(torch.nn.Module):
    """``num_gemms`` bias-free linears in TE GroupedLinear's layout (``weight0`` .. ``weight{n-1}``)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, /, *, config: Any,
                 init_method: Callable[[torch.Tensor], None], bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: str | None = None, pg_collection: Any = None, name: str | None = None) -> None:
        super().__init__()
        if bias:
            raise ValueError("TorchGroupedLinear is bias-free (pass add_bias_linear=False)")
        self.num_gemms = num_gemms
        expert_parallel = config.expert_model_parallel_size > 1
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(w)
            # As TE's GroupedLinear under Megatron: experts are reduced over the expert-data-parallel group.
            w.allreduce = not (is_expert and expert_parallel)
            self.register_parameter(f"weight{i}", w)

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, None]:
        ws = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        parts = [torch.nn.functional.linear(xs, w) for xs, w in zip(torch.split(x, list(m_splits)), ws)]
        return torch.cat(parts) if parts else x.new_empty(0, ws[0].shape[0]), None

    def backward_dw(self) -> None:
        """Nothing is delayed here (TEGroupedMLP calls it under delay_wgrad_compute only)."""
