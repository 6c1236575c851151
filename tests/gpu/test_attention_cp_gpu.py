"""The context-parallel SDPA attention's kernels on one GPU, fp32 and bf16, against its CPU reference.

One GPU runs no CP > 1 (the CP tests run on CPU with gloo: tests/test_attention_cp.py, tests/test_context_parallel.py).
What runs here is what each rank computes under CP, on the GPU's own SDPA kernels:
- ``context_parallel_attention`` at CP 1 (plain causal SDPA, GQA through ``enable_gqa``);
- one query chunk against the keys up to the end of its chunk (``_attend`` with L < S: the lower-right causal mask,
  which torch runs on flash attention in bf16 and on memory-efficient attention or a built mask otherwise);
- the same chunk with an explicit additive mask (a document mask).

Each is compared, outputs and dQ/dK/dV, with the same function on CPU in fp64: within 1e-5 (relative to the largest
value) in fp32; in bf16 no worse than plain bf16 SDPA on the GPU with the mask built out (the naive same-dtype
reference), plus one bf16 epsilon.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU runs these in "
                                "tests/test_attention_cp.py)")

# (query tokens L, key tokens S, micro-batch, query heads, key/value heads, head dim)
SHAPES = [(2048, 2048, 1, 16, 4, 128), (1024, 3072, 2, 8, 8, 64), (512, 4096, 1, 32, 8, 128)]


def _inputs(L: int, S: int, b: int, h: int, g: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(L, b, h, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(S, b, g, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(L, b, h, d, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _document_bias(L: int, S: int, b: int) -> torch.Tensor:
    """Additive [b, 1, L, S] mask for the last L queries of S tokens: causal within documents, -10000 elsewhere."""
    qpos, kpos = torch.arange(S - L, S).view(L, 1), torch.arange(S).view(1, S)
    out = []
    for i in range(b):
        cut = S // 3 + i
        masked = (kpos > qpos) | ((kpos >= cut) != (qpos >= cut))
        out.append(torch.zeros(L, S, dtype=torch.float64).masked_fill_(masked, -10000.0))
    return torch.stack(out).unsqueeze(1)


def _run(fn, tensors, dout, device, dtype):
    ins = [t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_() for t in tensors]
    out = fn(*ins)
    out.backward(dout.to(device=device, dtype=dtype))
    return [out.detach().double().cpu(), *(t.grad.double().cpu() for t in ins)]


def _naive(q, k, v, bias):
    """Plain SDPA with the mask built out (keys repeated for GQA), as any user would write it."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kb = kb.repeat_interleave(qb.shape[1] // kb.shape[1], dim=1)
    vb = vb.repeat_interleave(qb.shape[1] // vb.shape[1], dim=1)
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias.to(q.dtype)).permute(2, 0, 1, 3)


def _err(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["cp1", "chunk", "chunk-masked"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}_S{}_b{}_h{}_g{}_d{}".format(*s))
def test_cp_attention_kernels_match_the_cpu_reference(shape, mode, dtype):
    from megatron_peakflat.attention.context_parallel import _attend, context_parallel_attention

    L, S, b, h, g, d = shape
    if mode == "cp1":
        L = S  # the whole sequence on one rank
    q, k, v, dout = _inputs(L, S, b, h, g, d, dtype, seed=L + S + h)
    bias = _document_bias(L, S, b) if mode == "chunk-masked" else None
    if mode == "cp1":
        def fn(q_, k_, v_):
            return context_parallel_attention(q_, k_, v_, None)
    else:
        def fn(q_, k_, v_):
            return _attend(q_, k_, v_, None, 0.0, None if bias is None else bias.to(q_.device, q_.dtype))
    want = _run(fn, (q, k, v), dout, "cpu", torch.float64)
    got = _run(fn, (q, k, v), dout, "cuda", dtype)
    names = ("out", "dq", "dk", "dv")
    if dtype == torch.float32:
        for n, a, w in zip(names, got, want):
            assert _err(a, w) <= 1e-5, (n, _err(a, w))
        return
    # bf16: no worse than the naive bf16 SDPA with the mask built out (the lower-right causal mask as a bias), plus
    # one bf16 epsilon (2^-8) of the largest value: a GQA group's dK/dV summed inside the kernel or after the
    # repeat round differently, by a unit or two; a wrong mask or chunk is off by O(1)
    full_bias = bias
    if full_bias is None:
        qpos, kpos = torch.arange(S - L, S).view(L, 1), torch.arange(S).view(1, S)
        full_bias = torch.zeros(L, S, dtype=torch.float64).masked_fill_(kpos > qpos, float("-inf")).view(1, 1, L, S)
    naive = _run(lambda q_, k_, v_: _naive(q_, k_, v_, full_bias.to(q_.device)), (q, k, v), dout, "cuda", dtype)
    for n, a, r, w in zip(names, got, naive, want):
        assert _err(a, w) <= _err(r, w) + 2**-8, (n, _err(a, w), _err(r, w))


def test_chunk_path_uses_no_built_mask_in_bf16():
    """In bf16 the lower-right causal chunk runs on a fused kernel, without the [L, S] mask: its peak stays far
    below the mask's size (the fused kernels' working set is O(L + S) per head)."""
    from megatron_peakflat.attention.context_parallel import _attend

    L, S, b, h, g, d = 4096, 32768, 1, 8, 8, 128
    q = torch.randn(L, b, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(S, b, g, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = _attend(q, k, v, None, 0.0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    mask_bytes = L * S  # a bool [L, S] mask; the scores would be b x h x L x S x 2 bytes more
    assert out.shape == (L, b, h, d)
    assert peak < mask_bytes / 4, (peak, mask_bytes)


@pytest.mark.parametrize("L,S", [(2048, 40960), (40960, 40960)])
def test_one_call_per_kv_head_on_flash_matches_one_call_and_holds_less(L, S):
    """bf16 on flash at a key length past ``GROUPED_CALL_MIN_KEYS``: ``_attend``'s call per K/V head gives the
    output and dQ/dK/dV of one call over every head (within one bf16 epsilon of the largest value), and its backward
    peaks lower, since flash expands dK/dV to the query heads for one call's heads only."""
    from megatron_peakflat.attention import calls
    from megatron_peakflat.attention import context_parallel as cpa

    q, k, v, dout = (t.to("cuda", torch.bfloat16) for t in _inputs(L, S, 1, 32, 4, 64, torch.bfloat16, 11))

    def run(min_keys: int) -> tuple[list[torch.Tensor], int]:
        calls.GROUPED_CALL_MIN_KEYS = min_keys
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = cpa._attend(*leaves, None, 0.0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out.backward(dout)
        torch.cuda.synchronize()
        return [out.detach().float()] + [t.grad.float() for t in leaves], torch.cuda.max_memory_allocated() - base

    saved = calls.GROUPED_CALL_MIN_KEYS
    try:
        one, one_peak = run(1 << 62)
        per_head, per_head_peak = run(1)
    finally:
        calls.GROUPED_CALL_MIN_KEYS = saved
    for a, b in zip(per_head, one):
        assert float((a - b).abs().max()) <= 2**-8 * float(b.abs().max()), float((a - b).abs().max())
    expanded = 2 * S * 32 * 64 * 2  # flash's dK/dV at the 32 query heads, bf16
    assert per_head_peak < one_peak - expanded // 2, (per_head_peak, one_peak, expanded)
