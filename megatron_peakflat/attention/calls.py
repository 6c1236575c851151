"""How many SDPA calls the SDPA attention (``context_parallel._attend``) splits one attention into.

Torch-free, so that the planner counts what the attention allocates. Flash attention, the one CUDA kernel that
takes grouped K/V heads as they are, allocates in its backward dK and dV at the *query* heads' count over every
key before it sums them down to the K/V heads (FlashAttention-2's ``mha_bwd``, as torch ships it:
``dk_expanded``, ``dv_expanded``), beside an fp32 dQ accumulator at every query head. For gpt-oss-20b's layer
(64 query heads over 8 K/V heads of 64) that is 16 KB per key and 16 KB per query in bf16: 16 GiB of dK/dV for a
tile attending to a 1M-token prefix. One call per K/V head holds both for that head's queries only, a
``kv_heads``-th of them, at no change to the result: each query head attends only to its own K/V head.
"""

from __future__ import annotations

__all__ = ["GROUPED_CALL_MIN_KEYS", "kv_head_calls"]

GROUPED_CALL_MIN_KEYS = 32768
"""Keys (micro-batch x key length) from which a grouped-head attention runs as one call per K/V head. Below it one
call: its backward's grid (keys / 128 blocks x heads) would leave an H100's 132 SMs partly idle with few heads a
call, and its expanded dK/dV (at most 32 MiB per head of 64 in bf16) are small."""


def kv_head_calls(q_heads: int, kv_heads: int, keys: int) -> int:
    """The calls one attention of ``q_heads`` query heads over ``kv_heads`` grouped K/V heads and ``keys`` keys
    (micro-batch x key length) is run as: ``kv_heads`` where the heads are grouped and ``keys`` reaches
    ``GROUPED_CALL_MIN_KEYS``, else 1. Only where the kernel takes grouped heads; the caller decides that."""
    if q_heads < 1 or kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{kv_heads} K/V heads must divide {q_heads} query heads (both at least 1)")
    if kv_heads == q_heads or keys < GROUPED_CALL_MIN_KEYS:
        return 1
    return kv_heads
