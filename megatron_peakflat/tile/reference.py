"""Plain-PyTorch twins for the tiled sublayer's tests: a self-attention sublayer (RMSNorm, one QKV projection,
RoPE, causal attention with grouped K/V heads, output projection, residual) run whole, and its ``TileOps``.

``causal_attention`` aligns the causal mask bottom right when there are fewer queries than keys (torch's
``causal_lower_right``), the alignment ``TileOps.attend`` promises; with as many queries as keys it is the
plain causal mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .ops import TileOps

__all__ = ["rope_freqs", "apply_rope", "causal_attention", "ReferenceAttentionLayer"]


def rope_freqs(seq: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE angles [seq, 1, 1, dim] for positions 0 .. seq-1, laid out as Megatron's RotaryEmbedding builds them."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused RoPE (non-interleaved): t * cos + rotate_half(t) * sin, over t's leading positions."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return t * torch.cos(freqs).to(t.dtype) + rotated * torch.sin(freqs).to(t.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of q [t, b, nq, d] over k, v [L, b, nkv, d] (t <= L, the queries are the last t
    positions), grouped heads repeated; out [t, b, nq * d]."""
    t, b, nq, d = q.shape
    L, nkv = k.shape[0], k.shape[2]
    qh, kh, vh = (z.permute(1, 2, 0, 3) for z in (q, k, v))
    if nq != nkv:
        kh = kh.repeat_interleave(nq // nkv, dim=1)
        vh = vh.repeat_interleave(nq // nkv, dim=1)
    if t == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, L), scale=scale)
    return out.permute(2, 0, 1, 3).reshape(t, b, nq * d)


class ReferenceAttentionLayer(torch.nn.Module):
    """y = x + proj(attn(rope(qkv(rmsnorm(x))))); x [s, b, hidden]."""

    def __init__(self, hidden: int, q_heads: int, kv_heads: int, head_dim: int, seq: int, bias: bool = True,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        if q_heads % kv_heads:
            raise ValueError(f"{q_heads} query heads do not group over {kv_heads} key/value heads")
        g = torch.Generator().manual_seed(seed)
        self.nq, self.nkv, self.d = q_heads, kv_heads, head_dim
        qkv_out = (q_heads + 2 * kv_heads) * head_dim

        def rand(*shape: int, scale: float) -> torch.nn.Parameter:
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype))

        self.norm = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
        self.w_qkv = rand(qkv_out, hidden, scale=1 / math.sqrt(hidden))
        self.b_qkv = rand(qkv_out, scale=0.1) if bias else None
        self.w_o = rand(hidden, q_heads * head_dim, scale=1 / math.sqrt(q_heads * head_dim))
        self.b_o = rand(hidden, scale=0.1) if bias else None
        self.register_buffer("freqs", rope_freqs(seq, head_dim), persistent=False)

    def qkv(self, x: torch.Tensor, start: int, freqs: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the rows ``x``, the first of which is row ``start`` of the rotary table ``freqs`` (the
        layer's, positions 0 .. seq-1, by default)."""
        t, b, _ = x.shape
        mixed = F.linear(self.norm(x), self.w_qkv, self.b_qkv)
        q, k, v = mixed.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        freqs = (self.freqs if freqs is None else freqs)[start:start + t]
        q = apply_rope(q.reshape(t, b, self.nq, self.d), freqs)
        k = apply_rope(k.reshape(t, b, self.nkv, self.d), freqs)
        return q, k, v.reshape(t, b, self.nkv, self.d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v)

    def project(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(o, self.w_o, self.b_o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x, 0)
        return self.project(self.attend(q, k, v), x)

    def ops(self) -> TileOps:
        return TileOps(qkv=self.qkv, attend=self.attend, project=self.project)

    def cp_ops(self, cp: int, rank: int) -> TileOps:
        """``TileOps`` for context-parallel rank ``rank``'s share of the sequence (chunks r and 2CP-1-r): the
        rotary table cut to the rank's rows, as Megatron's ``get_pos_emb_on_this_cp_rank`` cuts it."""
        from ..attention.context_parallel import split_sequence

        freqs = split_sequence(self.freqs, cp, rank)
        return TileOps(qkv=lambda x, start: self.qkv(x, start, freqs), attend=self.attend, project=self.project)
