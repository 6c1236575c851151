"""Whether Transformer Engine's attention, run as one call per K/V head, bounds cuDNN's backward workspace the way
the SDPA attention's per-K/V-head calls bound flash's: a tile of queries against a long causal prefix
(``causal_bottom_right``), bf16, GQA, sbhd, as the tiled sublayer calls it.

    python3 tools/probes/te_kv_head_calls.py [TILE] [KEYS]

With grouped heads cuDNN's backward holds dK and dV at every query head over the keys (16 GiB for 64 heads of 64
against 1M keys: ``planner/te_limits.gqa_expansion_bytes``). Split per K/V head, each call takes heads / groups
query heads and one K/V head, through a ``DotProductAttention`` built for that, so one group's expansion is alive at
a time. Prints each way's forward + backward peak beyond its inputs and time, the planner's expansion for one call
of each, and the largest difference of the output and of dQ, dK, dV between the two ways (each relative to the
one-call tensor's largest entry).
"""

from __future__ import annotations

import sys
import time

import torch
import transformer_engine.pytorch as te

from megatron_peakflat.planner.te_limits import gqa_expansion_bytes

HEADS, GROUPS, DIM = 64, 8, 64


def _run(fn, q, k, v):  # noqa: ANN001, ANN202
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out.detach(), [t.grad.detach() for t in (q, k, v)], peak, ms


def main() -> None:
    tile = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    keys = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    rep = HEADS // GROUPS
    kw = dict(attn_mask_type="causal_bottom_right", qkv_format="sbhd", attention_dropout=0.0)
    whole = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, **kw).cuda()
    group = te.DotProductAttention(rep, DIM, num_gqa_groups=1, **kw).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tile, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k = torch.randn(keys, 1, GROUPS, DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    v = torch.randn(keys, 1, GROUPS, DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)

    def one_call(q, k, v):  # noqa: ANN001, ANN202
        return whole(q, k, v, attn_mask_type="causal_bottom_right")

    def per_kv_head(q, k, v):  # noqa: ANN001, ANN202
        outs = [group(q[:, :, i * rep:(i + 1) * rep].contiguous(), k[:, :, i:i + 1].contiguous(),
                      v[:, :, i:i + 1].contiguous(), attn_mask_type="causal_bottom_right") for i in range(GROUPS)]
        return torch.cat(outs, dim=-1)

    results = {}
    for name, fn in (("one call", one_call), ("per K/V head", per_kv_head)):
        for _ in range(2):  # the second pass: backends chosen, workspaces sized
            results[name] = _run(fn, q, k, v)
        _, _, peak, ms = results[name]
        heads = HEADS if name == "one call" else rep
        plan = gqa_expansion_bytes(micro_batch=1, heads=heads, tp=1, kv_tokens=keys, head_dim=DIM,
                                   bytes_per_element=2) / 2**30
        print(f"te_kv_head_calls tile={tile} keys={keys} {name}: forward+backward {ms:.1f} ms, peak {peak:.2f} GiB "
              f"beyond inputs; planner: expansion {plan:.2f} GiB per call", flush=True)
    (o1, g1, _, _), (o2, g2, _, _) = results["one call"], results["per K/V head"]

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    print(f"te_kv_head_calls: largest difference, per K/V head against one call: out {err(o2, o1):.2e}, "
          f"dq {err(g2[0], g1[0]):.2e}, dk {err(g2[1], g1[1]):.2e}, dv {err(g2[2], g1[2]):.2e}", flush=True)


if __name__ == "__main__":
    main()
