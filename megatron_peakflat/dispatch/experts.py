"""What PipelinedLLEP needs from an expert implementation, and how weights move between ranks.

An ``ExpertBank`` holds a rank's local experts. PipelinedLLEP calls ``compute`` on one chunk's rows
grouped by expert, with either the bank's own experts or weights received from another rank (a
spilled expert). All experts of a bank have the same parameter shapes, so one expert's weights
travel as one flat vector.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from . import comm
from .schedule import Schedule

__all__ = ["ExpertBank", "flatten_weights", "unflatten_weights", "exchange_weights", "return_weight_grads"]


class ExpertBank(Protocol):
    num_local_experts: int

    def expert_params(self, local: int) -> list[torch.Tensor]:
        """The parameters of local expert ``local``, in a fixed order shared by every expert."""
        ...

    def compute(self, x: torch.Tensor, probs: torch.Tensor, tokens_per_expert: Sequence[int],
                local: Sequence[int | None], weights: Sequence[Sequence[torch.Tensor] | None]) -> torch.Tensor:
        """Rows of ``x`` grouped by expert -> expert outputs (probs applied as the bank's MLP does).

        Segment i has ``tokens_per_expert[i]`` rows; it runs the bank's own expert ``local[i]`` when that
        is not None, else an expert of the same shape with parameters ``weights[i]`` (received weights,
        or aliases of the bank's own in the backward recompute). Segments with no rows may be None.
        """
        ...


def flatten_weights(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One expert's parameters as one new 1-D tensor (detached, in ``params`` order)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def unflatten_weights(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like`` (the inverse of ``flatten_weights``; no copy)."""
    out, o = [], 0
    for p in like:
        out.append(flat[o:o + p.numel()].view(p.shape))
        o += p.numel()
    return out


def _numel(bank: ExpertBank) -> int:
    return sum(p.numel() for p in bank.expert_params(0))


def _splits(pairs: Sequence[tuple[int, int]], numel: int, ep: int) -> list[int]:
    """Elements exchanged with each rank: ``numel`` per (rank, expert) pair naming that rank."""
    return [numel * sum(1 for r, _ in pairs if r == d) for d in range(ep)]


def exchange_weights(sched: Schedule, bank: ExpertBank, group: dist.ProcessGroup | None) -> dict[int, torch.Tensor]:
    """Owners send the weights of spilled experts to their helpers; returns expert -> flat weights here.

    One all-to-all on every rank of the group, or none at all when the plan spills nothing (every
    rank knows the same plan, so every rank skips it together). The owner writes each copy straight into
    one send buffer (one expert's bytes per (helper, expert) pair, freed on return); the helper keeps
    what it receives (one expert's bytes per hosted expert).
    """
    if not sched.moves_weights:
        return {}
    like = bank.expert_params(0)
    W, e_p, P = _numel(bank), sched.num_local_experts, sched.ep
    base = sched.rank * e_p
    send_buf = like[0].new_empty(W * len(sched.weight_sends))
    for i, (_, e) in enumerate(sched.weight_sends):
        for dst, p in zip(unflatten_weights(send_buf[i * W:(i + 1) * W], like), bank.expert_params(e - base)):
            dst.copy_(p.detach())
    recv = comm.all_to_all(send_buf, _splits(sched.weight_sends, W, P), _splits(sched.weight_recvs, W, P), group)
    del send_buf
    return {e: recv[i * W:(i + 1) * W] for i, (_, e) in enumerate(sched.weight_recvs)}


def return_weight_grads(sched: Schedule, send_buf: torch.Tensor, bank: ExpertBank,
                        group: dist.ProcessGroup | None) -> list[tuple[int, torch.Tensor]]:
    """Helpers send the gradients of spilled experts' weights back; returns (expert, flat grad) at the owner,
    one per (helper, expert) pair in ``sched.weight_sends`` order, for the caller to add up.

    The reverse of ``exchange_weights``: same pairs, opposite direction. ``send_buf`` holds this rank's
    hosted experts' gradients, flat, in ``sched.weight_recvs`` order (one expert's elements each). Each
    helper's contribution is returned separately, so nothing is lost or double counted.
    """
    if not sched.moves_weights:
        return []
    W, P = _numel(bank), sched.ep
    if send_buf.numel() != W * len(sched.weight_recvs):
        raise ValueError(f"send_buf has {send_buf.numel()} elements, expected {W} x {len(sched.weight_recvs)} hosted")
    recv = comm.all_to_all(send_buf, _splits(sched.weight_recvs, W, P), _splits(sched.weight_sends, W, P), group)
    return [(e, recv[i * W:(i + 1) * W]) for i, (_, e) in enumerate(sched.weight_sends)]
