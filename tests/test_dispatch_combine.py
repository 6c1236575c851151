"""The combine step: ``token_slots`` lists every pair once, ``gather_sum`` equals an index_add_ of the
same rows (fp32 sums, one rounding), and its Triton kernel equals the PyTorch path (through
TRITON_INTERPRET=1 on CPU, in a subprocess: the interpreter must be on before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_peakflat.dispatch.combine import add_rows, gather_sum, token_slots

ROOT = Path(__file__).resolve().parents[1]


def _pairs(T: int, k: int, K: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Pair tokens ordered by (chunk, some expert order, token), as the schedule orders them."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.arange(T).repeat_interleave(k)
    exp = torch.randint(0, 5, (T * k,), generator=g)
    order = torch.argsort((tok % K) * 10_000 + exp * 100 + tok, stable=True)
    tok = tok[order]
    sizes = torch.bincount(tok % K, minlength=K).tolist()
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    return tok, offsets


@pytest.mark.parametrize("T,k,K", [(23, 2, 3), (16, 8, 4), (5, 1, 7)])
def test_token_slots_cover_every_pair_once_in_its_chunk(T, k, K):
    tok, offsets = _pairs(T, k, K, seed=T)
    slots = token_slots(tok, offsets, T, K, k)
    assert slots.shape == (T, k) and slots.dtype == torch.int32
    for t in range(T):
        j = t % K
        pos = slots[t].long() + offsets[j]
        assert ((pos >= offsets[j]) & (pos < offsets[j + 1])).all()
        assert (tok[pos] == t).all()
    flat = torch.cat([slots[j::K].reshape(-1).long() + offsets[j] for j in range(K)])
    assert torch.equal(flat.sort().values, torch.arange(T * k))


def test_token_slots_refuse_ragged_pairs():
    with pytest.raises(ValueError, match="not uniform"):
        token_slots(torch.tensor([0, 0, 1]), [0, 3], 2, 1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum_equals_index_add_per_chunk(dtype):
    T, k, K, H = 23, 3, 4, 10
    tok, offsets = _pairs(T, k, K, seed=1)
    slots = token_slots(tok, offsets, T, K, k)
    g = torch.Generator().manual_seed(2)
    start = torch.randn(T, H, generator=g).to(dtype)
    got, want = start.clone(), start.float()
    for j in range(K):
        rows = torch.randn(offsets[j + 1] - offsets[j], H, generator=g).to(dtype)
        add_rows(got, rows, tok[offsets[j]:offsets[j + 1]], slots, j, K)
        want.index_add_(0, tok[offsets[j]:offsets[j + 1]], rows.float())
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert ((got.float() - want).abs() / want.abs().clamp_min(1.0)).max() <= tol
    fallback = start.clone()
    for j in range(K):
        rows = torch.randn(offsets[j + 1] - offsets[j], H, generator=torch.Generator().manual_seed(j)).to(dtype)
        add_rows(fallback, rows, tok[offsets[j]:offsets[j + 1]], None, j, K)
    assert torch.isfinite(fallback).all() and not torch.equal(fallback, start)


def test_gather_sum_shape_errors():
    with pytest.raises(ValueError, match="do not match"):
        gather_sum(torch.zeros(4, 3), torch.zeros(2, 2, dtype=torch.int32), torch.zeros(3, 3))


SCRIPT = r"""
import torch
from megatron_peakflat.dispatch import combine_triton as ct
from megatron_peakflat.dispatch.combine import _gather_sum_torch
ct._BLOCK = 8  # several column blocks per row, the last one partial
g = torch.Generator().manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    rows = torch.randn(30, 21, generator=g).to(dt)
    slots = torch.randint(0, 30, (9, 3), generator=g, dtype=torch.int32)
    full = torch.randn(27, 21, generator=g).to(dt)
    a, b = full.clone(), full.clone()
    _gather_sum_torch(rows, slots, a[1::3])
    ct.gather_sum_triton(rows, slots, b[1::3])
    if dt == torch.float32:
        assert torch.equal(a, b), (a - b).abs().max()
    else:  # the interpreter's fp32 -> bf16 cast may round differently: one bf16 ulp (GPU: bitwise, tests/gpu)
        ulp = 2.0 ** (torch.floor(torch.log2(a.float().abs().clamp_min(1e-30))) - 7)
        assert ((a.float() - b.float()).abs() <= ulp).all(), (a.float() - b.float()).abs().max()
    assert not torch.equal(a, full)
print("ok")
"""


def test_gather_sum_triton_kernel_matches_torch_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
