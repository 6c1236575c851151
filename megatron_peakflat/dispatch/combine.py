"""Combine: add each token's expert outputs (one row per routed expert) into the token's output row.

An ``index_add_`` over the pair rows does this with one atomic add per element and pair; on a GPU
with bf16 rows that costs several times a plain pass over the rows (atomics on 16-bit values), and
the k partial sums are rounded k times. When every token has the same number of pairs, the
schedule instead gives each token's pair positions (``token_slots``); ``gather_sum`` then reads the
k rows of a token, sums them in fp32 and adds the result to the output row once: one read of the
rows, one read-modify-write of the outputs, one rounding, no atomics, deterministic.
"""

from __future__ import annotations

import torch

__all__ = ["token_slots", "gather_sum", "add_rows"]


def token_slots(pair_token: torch.Tensor, chunk_offsets: list[int], num_tokens: int, K: int,
                per_token: int) -> torch.Tensor:
    """[T, per_token] int32: for token t, the positions of its pairs among chunk ``t mod K``'s rows.

    ``pair_token`` lists the token of every pair, chunk by chunk (``chunk_offsets``); every token must
    own exactly ``per_token`` pairs, all in its chunk (strided membership guarantees the latter).
    Rows of token t come out in the pairs' order, so the sum is the same on every call.
    """
    if pair_token.numel() != num_tokens * per_token:
        raise ValueError(f"{pair_token.numel()} pairs for {num_tokens} tokens x {per_token}: not uniform")
    dev = pair_token.device
    order = torch.sort(pair_token, stable=True).indices.view(num_tokens, per_token)
    start = torch.tensor(chunk_offsets[:-1], dtype=torch.int64, device=dev)
    base = start[torch.arange(num_tokens, device=dev) % K]
    return (order - base[:, None]).to(torch.int32)


def _gather_sum_torch(rows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    acc = out.float()
    for s in range(slots.shape[1]):
        acc += rows.index_select(0, slots[:, s])
    out.copy_(acc)


def gather_sum(rows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """``out[t] += sum_s rows[slots[t, s]]`` for every t, summed in fp32 and rounded once.

    ``rows`` [n, H] with unit column stride, ``slots`` [T, k] int32, ``out`` [T, H] (any row stride, e.g.
    a strided view ``full[j::K]``). CUDA tensors run one Triton kernel; others a PyTorch loop over k.
    """
    if rows.dim() != 2 or out.dim() != 2 or rows.shape[1] != out.shape[1] or slots.shape[0] != out.shape[0]:
        raise ValueError(f"rows {tuple(rows.shape)}, slots {tuple(slots.shape)}, out {tuple(out.shape)} do not match")
    if out.shape[0] == 0 or slots.shape[1] == 0:
        return
    if rows.is_cuda:
        from .combine_triton import gather_sum_triton

        gather_sum_triton(rows, slots, out)
    else:
        _gather_sum_torch(rows, slots, out)


def add_rows(out: torch.Tensor, rows: torch.Tensor, tok: torch.Tensor, slots: torch.Tensor | None,
             j: int, K: int) -> None:
    """Add chunk j's pair ``rows`` into ``out`` [T, H]: a gather-sum when ``slots`` (``token_slots``) is
    given, else ``index_add_`` by the pairs' tokens ``tok``."""
    if slots is None:
        out.index_add_(0, tok, rows)
    else:
        gather_sum(rows, slots[j::K], out[j::K])
