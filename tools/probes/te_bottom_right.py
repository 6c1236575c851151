"""Which backend Transformer Engine's attention runs for a tile of queries against a longer causal prefix
(``causal_bottom_right``), bf16, GQA, sbhd, and what it allocates: the tiled attention sublayer's attention call.

    NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 python3 tools/probes/te_bottom_right.py [TILE] [KEYS]

An unfused backend would hold [heads, tile, keys] fp32 scores (64 x 8192 x 65536 x 4 B = 128 GiB): the peak
printed here tells at once whether the scores stay on chip.
"""

from __future__ import annotations

import sys
import time

import torch
import transformer_engine.pytorch as te


def main() -> None:
    tile = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    keys = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    heads, groups, dim = 64, 8, 64
    attn = te.DotProductAttention(heads, dim, num_gqa_groups=groups, attn_mask_type="causal_bottom_right",
                                  qkv_format="sbhd", attention_dropout=0.0).cuda()
    q = torch.randn(tile, 1, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(keys, 1, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(keys, 1, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = attn(q, k, v, attn_mask_type="causal_bottom_right")
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"te_bottom_right tile={tile} keys={keys}: forward+backward {ms:.1f} ms, peak {peak:.2f} GiB beyond inputs",
          flush=True)


if __name__ == "__main__":
    main()
