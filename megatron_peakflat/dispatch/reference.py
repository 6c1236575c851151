"""Plain-PyTorch twins: an expert bank with Megatron's MLP math, and an unchunked single-rank MoE.

``reference_moe`` is the ground truth for tests: every expert's weights on one rank, each expert
applied to its routed rows, outputs summed per token. Autograd does the backward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .grouped import GroupedExperts

__all__ = ["ReferenceExperts", "expert_activation", "expert_mlp", "reference_moe"]


def expert_activation(h: torch.Tensor, probs: torch.Tensor, *, glu: bool = True,
                      act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """Megatron's expert activation between fc1 and fc2: act (gated when ``glu``) times the prob."""
    dtype = h.dtype
    if glu:
        a, b = torch.chunk(h, 2, dim=-1)
        h = act(a) * b
    else:
        h = act(h)
    return (h * probs.unsqueeze(-1)).to(dtype)


def expert_mlp(x: torch.Tensor, probs: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, *, glu: bool = True,
               act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """Megatron's expert MLP without biases: fc2(act(fc1 x) * prob), with a gated unit when ``glu``."""
    return expert_activation(x @ fc1.t(), probs, glu=glu, act=act) @ fc2.t()


class ReferenceExperts(torch.nn.Module, GroupedExperts):
    """``num_local_experts`` bias-free MLP experts; implements the ExpertBank protocol.

    ``grouped=True`` runs chunks through grouped GEMMs (``GroupedExperts``); False, one expert at a time.
    """

    def __init__(self, fc1: Sequence[torch.Tensor], fc2: Sequence[torch.Tensor], *, glu: bool = True,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu, grouped: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in fc1])
        self.fc2 = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in fc2])
        self.num_local_experts = len(self.fc1)
        self.glu, self.act, self.grouped = glu, act, grouped

    def expert_params(self, local: int) -> list[torch.Tensor]:
        return [self.fc1[local], self.fc2[local]]

    def elementwise(self, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return expert_activation(h, p, glu=self.glu, act=self.act)

    def compute(self, x: torch.Tensor, probs: torch.Tensor, tokens_per_expert: Sequence[int],
                local: Sequence[int | None], weights: Sequence[Sequence[torch.Tensor] | None]) -> torch.Tensor:
        """ExpertBank.compute: each segment through ``expert_mlp`` with its own or the given weights."""
        outs = []
        o = 0
        for n, li, w in zip(tokens_per_expert, local, weights):
            if n == 0:
                continue
            fc1, fc2 = self.expert_params(li) if li is not None else w
            outs.append(expert_mlp(x[o:o + n], probs[o:o + n], fc1, fc2, glu=self.glu, act=self.act))
            o += n
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])


def reference_moe(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, fc1: Sequence[torch.Tensor],
                  fc2: Sequence[torch.Tensor], *, glu: bool = True,
                  act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """out[t] = sum over experts e routed by t of expert_e(x[t]) * probs[t, e] (inside the MLP)."""
    out = torch.zeros_like(x)
    for e in range(routing_map.shape[1]):
        idx = routing_map[:, e].nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        out = out.index_add(0, idx, expert_mlp(x[idx], probs[idx, e], fc1[e], fc2[e], glu=glu, act=act))
    return out
