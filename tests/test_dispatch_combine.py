"""The combine step: ``combine_map`` lists every pair once, under its token, in its chunk, for any
chunk membership and any number of pairs per token; ``gather_sum`` equals an fp32 index_add_ of the
same rows (one rounding per token and chunk); its Triton kernel equals the PyTorch path (through
TRITON_INTERPRET=1 on CPU, in a subprocess: the interpreter must be on before triton is imported)."""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.dispatch.combine import add_rows, combine_map, gather_sum


def _pairs(T: int, k: int, K: int, seed: int, membership: str) -> tuple[torch.Tensor, list[int]]:
    """Pair tokens chunk by chunk, as the schedule orders them: strided (token t in chunk t mod K) or
    expert-major (pairs sorted by expert then token, cut into K slices), k or ragged pairs per token."""
    g = torch.Generator().manual_seed(seed)
    per = torch.full((T,), k) if k > 0 else torch.randint(0, 4, (T,), generator=g)
    tok = torch.arange(T).repeat_interleave(per)
    exp = torch.randint(0, 5, (tok.numel(),), generator=g)
    n = tok.numel()
    if membership == "strided":
        cid = tok % K
    else:
        cid = torch.empty_like(tok)
        cid[torch.argsort(exp * 10_000 + tok, stable=True)] = torch.arange(n) * K // max(1, n)
    order = torch.argsort(cid * 100_000 + exp * 1000 + tok, stable=True)
    tok = tok[order]
    sizes = torch.bincount(cid, minlength=K).tolist()
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    return tok, offsets


CASES = [(23, 2, 3, "strided"), (16, 8, 4, "strided"), (5, 1, 7, "strided"), (23, 3, 4, "expert"),
         (16, 8, 3, "expert"), (19, 0, 3, "expert"), (19, 0, 2, "strided")]


@pytest.mark.parametrize("T,k,K,membership", CASES)
def test_combine_map_lists_every_pair_once_under_its_token(T, k, K, membership):
    tok, offsets = _pairs(T, k, K, seed=T + K, membership=membership)
    m = combine_map(tok, offsets, T)
    assert m.perm.dtype == m.token.dtype == m.count.dtype == torch.int32
    seen = []
    for j in range(K):
        perm, token, count = (t.long() for t in m.chunk(j))
        chunk_tok = tok[offsets[j]:offsets[j + 1]]
        assert int(count.sum()) == chunk_tok.numel()
        starts = count.nonzero().flatten().tolist()
        assert len(set(token[starts].tolist())) == len(starts)  # one run per token and chunk
        for e in starts:
            rows = perm[e:e + int(count[e])]
            assert (chunk_tok[rows] == token[e]).all()
            assert torch.equal(rows, rows.sort().values)  # pairs keep their chunk order: a fixed sum order
            seen.extend((rows + offsets[j]).tolist())
    assert sorted(seen) == list(range(tok.numel()))


@pytest.mark.parametrize("membership", ["strided", "expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum_equals_index_add_per_chunk(dtype, membership):
    T, k, K, H = 23, 3, 4, 10
    tok, offsets = _pairs(T, k, K, seed=1, membership=membership)
    m = combine_map(tok, offsets, T)
    g = torch.Generator().manual_seed(2)
    start = torch.randn(T, H, generator=g).to(dtype)
    got, want = start.clone(), start.float()
    for j in range(K):
        rows = torch.randn(offsets[j + 1] - offsets[j], H, generator=g).to(dtype)
        add_rows(got, rows, m, j)
        part = torch.zeros(T, H).index_add_(0, tok[offsets[j]:offsets[j + 1]], rows.float())
        want = (want + part).to(dtype).float()  # one rounding per token and chunk
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert ((got.float() - want).abs() / want.abs().clamp_min(1.0)).max() <= tol
    assert not torch.equal(got, start)


def test_gather_sum_shape_errors():
    z = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not match"):
        gather_sum(torch.zeros(4, 3), z, z, z[:2], torch.zeros(3, 3))


SCRIPT = r"""
import torch
from megatron_peakflat.dispatch import combine_triton as ct
from megatron_peakflat.dispatch.combine import _gather_sum_torch, combine_map
ct._BLOCK = 8  # several column blocks per row, the last one partial
g = torch.Generator().manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    tok = torch.randint(0, 27, (30,), generator=g)  # ragged: 0 to several pairs per token
    m = combine_map(tok, [0, 30], 27)
    rows = torch.randn(30, 21, generator=g).to(dt)
    full = torch.randn(27, 21, generator=g).to(dt)
    a, b = full.clone(), full.clone()
    _gather_sum_torch(rows, m.perm, m.token, m.count, a)
    ct.gather_sum_triton(rows, m.perm, m.token, m.count, b)
    if dt == torch.float32:
        assert torch.equal(a, b), (a - b).abs().max()
    else:  # the interpreter's fp32 -> bf16 cast may round differently: one bf16 ulp (GPU: bitwise, tests/gpu)
        ulp = 2.0 ** (torch.floor(torch.log2(a.float().abs().clamp_min(1e-30))) - 7)
        assert ((a.float() - b.float()).abs() <= ulp).all(), (a.float() - b.float()).abs().max()
    assert not torch.equal(a, full)
print("ok")
"""


def test_gather_sum_triton_kernel_matches_torch_in_interpreter(triton_interpreter):
    res = triton_interpreter(SCRIPT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
