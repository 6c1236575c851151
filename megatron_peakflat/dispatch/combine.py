"""Combine: add each token's expert outputs (one row per routed expert) into the token's output row.

An ``index_add_`` over the pair rows does this with one atomic add per element and pair; on a GPU
with bf16 rows that costs several times a plain pass over the rows (atomics on 16-bit values), and
the partial sums are rounded once per pair. Instead the schedule lists, chunk by chunk, the pairs of
each token that the chunk holds (``CombineMap``, a CSR over the chunk's rows sorted by token); one
kernel then reads those rows, sums them in fp32 and adds the sum to the output row once: one read of
the rows, one read-modify-write per token and chunk, one rounding each, no atomics, deterministic.
This holds for any chunk membership and any number of pairs per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .upload import to_device

__all__ = ["CombineMap", "combine_map", "gather_sum", "add_rows"]


@dataclass
class CombineMap:
    """Which rows of each chunk belong to which token. Three int32 arrays over every local pair,
    chunk by chunk (chunk j is ``[offsets[j], offsets[j + 1])``), each chunk's entries sorted by token:

    - ``perm``: the entry's pair, as its row position within its chunk;
    - ``token``: the entry's token;
    - ``count``: at the first entry of a token's run, how many pairs of that token the chunk holds
      (its rows are ``perm[e : e + count]``); 0 at the other entries.
    """

    perm: torch.Tensor
    token: torch.Tensor
    count: torch.Tensor
    offsets: list[int]

    def chunk(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b = self.offsets[j], self.offsets[j + 1]
        return self.perm[a:b], self.token[a:b], self.count[a:b]


def combine_map(pair_token: torch.Tensor, chunk_offsets: list[int], num_tokens: int,
                offsets_dev: torch.Tensor | None = None) -> CombineMap:
    """The ``CombineMap`` of pairs whose tokens are ``pair_token``, chunk by chunk (``chunk_offsets``).

    Device arithmetic only (a sort and a few scans, no host sync). Within a token's run the pairs
    keep their order in ``pair_token``, so the sum is the same on every call. ``offsets_dev``:
    ``chunk_offsets`` already on the device (else they are uploaded here).
    """
    n, dev = pair_token.numel(), pair_token.device
    K = len(chunk_offsets) - 1
    if n == 0:
        e = torch.zeros(0, dtype=torch.int32, device=dev)
        return CombineMap(e, e.clone(), e.clone(), list(chunk_offsets))
    if offsets_dev is None:
        offsets_dev = to_device(chunk_offsets, dev)
    sizes = offsets_dev[1:] - offsets_dev[:-1]
    T = max(1, num_tokens)
    key = torch.repeat_interleave(torch.arange(K, device=dev) * T, sizes, output_size=n) + pair_token
    skey, order = torch.sort(key, stable=True)
    del key
    cid = skey // T  # chunks stay contiguous under a chunk-major key
    perm = (order - offsets_dev[cid]).to(torch.int32)
    del order
    token = (skey - cid * T).to(torch.int32)
    del cid
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = skey[1:] != skey[:-1]
    del skey
    pos = torch.arange(n, device=dev, dtype=torch.int32)
    run_start = torch.where(first, pos, 0).cummax(0).values.long()
    del pos
    count = torch.zeros(n, dtype=torch.int32, device=dev).index_add_(0, run_start, first.new_ones(n, dtype=torch.int32))
    return CombineMap(perm, token, count, list(chunk_offsets))


_TORCH_BLOCK = 1024
"""Tokens per step of the PyTorch path: its fp32 sums stay [1024, H] however many tokens a chunk has."""


def _gather_sum_torch(rows: torch.Tensor, perm: torch.Tensor, token: torch.Tensor, count: torch.Tensor,
                      out: torch.Tensor) -> None:
    all_starts = (count > 0).nonzero().flatten()
    for b in range(0, all_starts.numel(), _TORCH_BLOCK):
        starts = all_starts[b:b + _TORCH_BLOCK]
        n = count[starts].long()
        acc = torch.zeros(starts.numel(), rows.shape[1], dtype=torch.float32, device=rows.device)
        for s in range(int(n.max())):  # the kernel's order: a run's rows first to last, then the output
            live = n > s
            acc[live] += rows.index_select(0, perm[starts[live] + s].long()).float()
        tok = token[starts].long()
        out.index_copy_(0, tok, (acc + out.index_select(0, tok).float()).to(out.dtype))


def gather_sum(rows: torch.Tensor, perm: torch.Tensor, token: torch.Tensor, count: torch.Tensor,
               out: torch.Tensor) -> None:
    """``out[token[e]] += sum(rows[perm[e : e + count[e]]])`` at every entry e with ``count[e] > 0``, summed in
    fp32 and rounded once per token (one chunk of a ``CombineMap``; each token has one run).

    ``rows`` [n, H] and ``out`` [T, H] with unit column stride. CUDA tensors run one Triton kernel;
    others the same sums in PyTorch.
    """
    if rows.dim() != 2 or out.dim() != 2 or rows.shape[1] != out.shape[1] or not (
            perm.shape == token.shape == count.shape == (rows.shape[0],)):
        raise ValueError(f"rows {tuple(rows.shape)}, perm/token/count {tuple(perm.shape)}/{tuple(token.shape)}/"
                         f"{tuple(count.shape)}, out {tuple(out.shape)} do not match")
    if rows.shape[0] == 0:
        return
    if rows.is_cuda:
        from .combine_triton import gather_sum_triton

        gather_sum_triton(rows, perm, token, count, out)
    else:
        _gather_sum_torch(rows, perm, token, count, out)


def add_rows(out: torch.Tensor, rows: torch.Tensor, cmap: CombineMap, j: int) -> None:
    """Add chunk j's pair ``rows`` (in the chunk's row order) into ``out`` [T, H]."""
    gather_sum(rows, *cmap.chunk(j), out)
