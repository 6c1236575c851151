"""Ring-DTP's automatic block and chunk sizes as torch-free arithmetic (the API's and the planner's)."""

from __future__ import annotations

__all__ = ["AUTO_BLOCK_BYTES", "AUTO_CHUNK_BYTES", "AUTO_CHUNKS_AT_LEAST", "auto_block_size", "auto_chunk_tokens"]

AUTO_BLOCK_BYTES = 128 * 2**20
"""Target size of one [tokens, block] block of logits of the recompute schedules when ``block_size=0``."""

AUTO_CHUNK_BYTES = 2048 * 2**20
"""Largest [chunk, V/P] block of logits of the in-forward schedule when ``chunk_tokens=0``."""

AUTO_CHUNKS_AT_LEAST = 8
"""... and at most this fraction (1/8) of the whole [N, V/P] logits, so that the working set stays a
small part of what Megatron's vocab-parallel cross-entropy holds at any N."""


def auto_block_size(tokens: int, element_size: int) -> int:
    """Vocabulary rows per block so that one [tokens, rows] block of logits is about AUTO_BLOCK_BYTES
    (a multiple of 256 rows, between 256 and 16384): big enough for efficient GEMMs, small next to dW."""
    rows = AUTO_BLOCK_BYTES // max(1, int(tokens) * element_size)
    return int(min(16384, max(256, rows // 256 * 256)))


def auto_chunk_tokens(shard_rows: int, element_size: int, ring_size: int, total_tokens: int, hidden: int) -> int:
    """Tokens per in-forward chunk (over the whole ring, ``total_tokens`` in all); the one rule that the API
    (``chunk_tokens=0``) and the planner use.

    The larger the chunk, the fewer passes over dW (one read-modify-write of the shard's fp32 dW per chunk),
    so the chunk is as large as three caps allow:

    - ``hidden`` tokens: one chunk's [chunk, shard_rows] logits are then no larger than the [shard_rows,
      hidden] weight shard in the same dtype. A fused linear cross-entropy that returns dW (Liger's) holds
      dX, that dW in the weight's dtype and its own chunk of logits; this schedule holds dX and one chunk,
      with dW in DDP's main_grad. So its working set stays at or under such a peer's peak at every N,
      where a cap in tokens alone grew with N (tests/test_vocab_in_forward.py checks it over the
      benchmarked shapes against a model of Liger's chunking);
    - AUTO_CHUNK_BYTES of logits;
    - 1/AUTO_CHUNKS_AT_LEAST of all tokens.

    A multiple of 128 tokens per rank, at least 128 per rank."""
    tokens = min(int(hidden), AUTO_CHUNK_BYTES // max(1, int(shard_rows) * element_size),
                 -(-int(total_tokens) // AUTO_CHUNKS_AT_LEAST))
    per_rank = tokens // ring_size
    return int(max(128, per_rank // 128 * 128) * ring_size)
