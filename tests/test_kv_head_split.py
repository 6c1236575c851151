"""``attention.kv_head_split.attend_per_kv_head``: one grouped-head attention as one call per K/V head group, against
one call on the same inputs (fp32, CPU): the output and dQ, dK, dV, with causal bottom-right queries, at every divisor
of the K/V heads; and the calls it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_peakflat.attention.kv_head_split import attend_per_kv_head


def _attend(seen: list[tuple[int, int, bool]]):  # noqa: ANN202
    """Causal bottom-right attention of sbhd q [L, b, h, d] on k, v [S, b, g, d], g dividing h, returning
    [L, b, h x d] as Transformer Engine's does; records (query heads, K/V heads, all three contiguous) per call."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append((q.shape[2], k.shape[2], all(t.is_contiguous() for t in (q, k, v))))
        L, S = q.shape[0], k.shape[0]
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        rep = qb.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=torch.ones(L, S, dtype=torch.bool).tril(S - L))
        return out.permute(2, 0, 1, 3).reshape(L, q.shape[1], -1)

    return attend


@pytest.mark.parametrize("heads,groups,calls", [(8, 4, 4), (8, 4, 2), (12, 3, 3), (6, 6, 3), (8, 1, 1)])
def test_per_kv_head_calls_equal_one_call(heads: int, groups: int, calls: int) -> None:
    g = torch.Generator().manual_seed(heads * 10 + groups)
    L, S, b, d = 5, 13, 2, 8
    q = torch.randn(L, b, heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(S, b, groups, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(S, b, groups, d, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(L, b, heads * d, generator=g, dtype=torch.float64)
    got = []
    for split in (1, calls):
        seen: list[tuple[int, int, bool]] = []
        out = attend_per_kv_head(_attend(seen), q, k, v, split)
        grads = torch.autograd.grad(out, (q, k, v), dy)
        got.append((out.detach(), *grads))
        assert seen == ([(heads, groups, True)] if split == 1 else
                        [(heads // calls, groups // calls, True)] * calls)
    for a, want in zip(got[1], got[0]):
        assert torch.allclose(a, want, rtol=0, atol=1e-12), float((a - want).abs().max())


def test_the_heads_must_divide() -> None:
    q, k = torch.zeros(2, 1, 8, 4), torch.zeros(3, 1, 4, 4)
    never = _attend([])
    for calls, kk, vv in ((3, k, k), (0, k, k), (2, torch.zeros(3, 1, 3, 4), torch.zeros(3, 1, 3, 4)),
                          (2, k, torch.zeros(3, 1, 2, 4))):
        with pytest.raises(ValueError, match="calls must divide the K/V heads"):
            attend_per_kv_head(never, q, kk, vv, calls)
