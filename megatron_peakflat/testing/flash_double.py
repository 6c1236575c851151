"""A flash-class causal attention on CPU for memory tests: keys in blocks, online softmax, no [t, L] scores.

Saves q, k, v, the output and the log-sum-exp; backward keeps an fp32 dq accumulator and returns dk, dv over all
L keys, as flash kernels do. Its scratch (per-block scores, the per-block GQA expansion of K and V, the fp32
output accumulator) is ``workspace_bytes``: the part of a tile's working set that belongs to the kernel.
"""

from __future__ import annotations

import math

import torch


def workspace_bytes(t: int, b: int, nq: int, d: int, block: int, dtype_bytes: int) -> int:
    """Upper bound on the scratch below, per call: six [b, nq, t, block] fp32 score-sized tensors, six
    [b, nq, block, d] block tensors (expanded K/V blocks and their gradients), the fp32 output accumulator and
    three fp32 [b, nq, t] row statistics, and the fp32 copies of q and the output gradient."""
    return (6 * b * nq * t * block * 4 + 6 * b * nq * block * d * 4 + 3 * b * nq * t * d * 4
            + 3 * b * nq * t * 4 + b * nq * t * d * dtype_bytes)


class FlashDouble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block):  # noqa: ANN001, ANN205
        t, b, nq, d = q.shape
        L, nkv = k.shape[0], k.shape[2]
        scale = 1.0 / math.sqrt(d)
        f = torch.promote_types(q.dtype, torch.float32)
        qh = q.permute(1, 2, 0, 3).to(f)
        acc = torch.zeros(b, nq, t, d, dtype=f)
        m = torch.full((b, nq, t), -math.inf, dtype=f)
        l = torch.zeros(b, nq, t, dtype=f)
        qpos = torch.arange(L - t, L).view(t, 1)
        for j0 in range(0, L, block):
            j1 = min(L, j0 + block)
            kb = _expand(k[j0:j1], nq // nkv)
            vb = _expand(v[j0:j1], nq // nkv)
            s = (qh @ kb.transpose(-1, -2)) * scale
            s.masked_fill_(torch.arange(j0, j1).view(1, -1) > qpos, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            alive = torch.isfinite(m_new)
            m_safe = torch.where(alive, m_new, torch.zeros_like(m_new))
            p = torch.exp(s - m_safe.unsqueeze(-1))
            corr = torch.where(alive, torch.exp(m - m_safe), torch.zeros_like(m))
            l = l * corr + p.sum(-1)
            acc = acc * corr.unsqueeze(-1) + p @ vb
            m = m_new
            del s, p, kb, vb
        o = (acc / l.unsqueeze(-1)).to(q.dtype)
        lse = m + torch.log(l)
        out = o.permute(2, 0, 1, 3).reshape(t, b, nq * d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        t, b, nq, d = q.shape
        L, nkv = k.shape[0], k.shape[2]
        g = nq // nkv
        scale = 1.0 / math.sqrt(d)
        f = torch.promote_types(q.dtype, torch.float32)
        qh = q.permute(1, 2, 0, 3).to(f)
        do = dout.reshape(t, b, nq, d).permute(1, 2, 0, 3).to(f)
        oh = out.reshape(t, b, nq, d).permute(1, 2, 0, 3).to(f)
        D = (do * oh).sum(-1)
        del oh
        dq = torch.zeros(b, nq, t, d, dtype=f)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        qpos = torch.arange(L - t, L).view(t, 1)
        for j0 in range(0, L, ctx.block):
            j1 = min(L, j0 + ctx.block)
            kb, vb = _expand(k[j0:j1], g), _expand(v[j0:j1], g)
            s = (qh @ kb.transpose(-1, -2)) * scale
            s.masked_fill_(torch.arange(j0, j1).view(1, -1) > qpos, -math.inf)
            p = torch.exp(s - lse.unsqueeze(-1))
            del s
            dvb = p.transpose(-1, -2) @ do
            dp = do @ vb.transpose(-1, -2)
            ds = p * (dp - D.unsqueeze(-1))
            del p, dp
            dq += (ds @ kb) * scale
            dkb = (ds.transpose(-1, -2) @ qh) * scale
            del ds
            dk[j0:j1] += _fold(dkb, g).to(k.dtype)
            dv[j0:j1] += _fold(dvb, g).to(v.dtype)
            del kb, vb, dkb, dvb
        return dq.to(q.dtype).permute(2, 0, 1, 3), dk, dv, None


def _expand(x: torch.Tensor, g: int) -> torch.Tensor:
    """[n, b, nkv, d] -> [b, nkv * g, n, d], in fp32 at least."""
    return x.permute(1, 2, 0, 3).to(torch.promote_types(x.dtype, torch.float32)).repeat_interleave(g, dim=1)


def _fold(x: torch.Tensor, g: int) -> torch.Tensor:
    """fp32 [b, nkv * g, n, d] -> [n, b, nkv, d], summed over each group of g query heads."""
    b, nq, n, d = x.shape
    return x.view(b, nq // g, g, n, d).sum(2).permute(2, 0, 1, 3)
