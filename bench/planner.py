"""Planner: predicted vs measured peak on one GPU (bench/results/planner.json). About a minute.

    python bench/planner.py            # on the H200; PYTHONPATH=. when not installed

Each row measures one term of the memory model on the GPU (``max_memory_allocated`` minus the
memory allocated before, DESIGN.md) and records the planner's prediction for the same shape in
``extra.predicted_gib`` with ``extra.error_pct``:

- parameters + gradients + Adam state of a small fp32 torch model shaped like the planner's layers;
- checkpoint boundaries of a bf16 block stack under ``torch.utils.checkpoint`` (full recompute);
- vocabulary projection: Megatron's ``vocab_parallel_cross_entropy`` on a 1-rank group (native and
  fused), and Ring-DTP (``megatron_peakflat.vocab``) when it is importable.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, write  # noqa: E402
from megatron_peakflat.config import PeakflatConfig  # noqa: E402
from megatron_peakflat.memory import model as M  # noqa: E402
from megatron_peakflat.memory.model import GIB, RunConfig, plan  # noqa: E402
from megatron_peakflat.memory.shapes import ModelShape  # noqa: E402

DEV = torch.device("cuda")


def peak_of(fn) -> float:  # noqa: ANN001
    """Peak bytes above the allocation before ``fn`` (inputs already on the device)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def row(case: str, method: str, measured: float, predicted: float, what: str) -> Row:
    err = 100 * (measured - predicted) / predicted
    r = Row(case, method, round(measured / GIB, 4), None, None,
            {"predicted_gib": round(predicted / GIB, 4), "error_pct": round(err, 2), "term": what})
    print(f"{case:44s} {method:28s} {what:12s} measured {measured / GIB:8.3f} GiB  predicted "
          f"{predicted / GIB:8.3f} GiB  error {err:+6.1f}%", flush=True)
    return r


def bench_model_state() -> list[Row]:
    s = ModelShape(name="state", hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, ffn=2816, vocab=32000,
                   experts=8, topk=2, moe_ffn=1024, dense_layers=1)
    run = RunConfig(seq_len=1024, precision="fp32", distributed_optimizer=False)
    pr = plan(s, run).stages[0].rows
    h = s.hidden

    def layer(moe: bool) -> nn.Module:
        m = nn.Module()
        m.ln = nn.Parameter(torch.ones(2 * h))
        m.qkv = nn.Linear(h, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        m.proj = nn.Linear(s.heads * s.head_dim, h, bias=False)
        if moe:
            m.router = nn.Linear(h, s.experts, bias=False)
            m.experts = nn.ModuleList(nn.Linear(h, 3 * s.moe_ffn, bias=False) for _ in range(s.experts))
        else:
            m.fc = nn.Linear(h, 3 * s.ffn, bias=False)
        return m

    holder: dict[str, object] = {}

    def build() -> None:
        model = nn.ModuleList([nn.Embedding(s.vocab, h), nn.Linear(h, s.vocab, bias=False)]
                              + [layer(i >= s.dense_layers) for i in range(s.layers)]).to(DEV)
        model.register_parameter("final_ln", nn.Parameter(torch.ones(h, device=DEV)))
        holder["model"] = model

    def grads() -> None:
        for p in holder["model"].parameters():  # type: ignore[union-attr]
            p.grad = torch.ones_like(p)

    def adam() -> None:
        opt = torch.optim.Adam(holder["model"].parameters(), fused=True)  # type: ignore[union-attr]
        opt.step()
        holder["opt"] = opt

    case = f"H={h},L={s.layers},E={s.experts},fp32"
    rows = [row(case, "torch", peak_of(build), pr["parameters"].baseline, "parameters"),
            row(case, "torch", peak_of(grads), pr["gradients"].baseline, "gradients")]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    adam()
    rows.append(row(case, "torch-adam", torch.cuda.memory_allocated() - before, pr["optimizer"].baseline, "optimizer"))
    holder.clear()
    return rows


def bench_boundaries(S: int = 32768, h: int = 4096, L: int = 8, b: int = 1) -> list[Row]:
    from torch.utils.checkpoint import checkpoint

    shape = ModelShape(name="ckpt", hidden=h, layers=L, heads=32, kv_heads=32, head_dim=128, ffn=4 * h, vocab=1000,
                       gated=False)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
                           for _ in range(L)).to(DEV, torch.bfloat16)
    x = torch.randn(S, b, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    held: dict[str, torch.Tensor] = {}

    def forward() -> None:
        y = x
        for blk in blocks:
            y = checkpoint(blk, y, use_reentrant=False)
        held["y"] = y

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    forward()
    torch.cuda.synchronize()
    live = torch.cuda.memory_allocated() - before
    held.clear()
    pred = plan(shape, RunConfig(seq_len=S, micro_batch=b, recompute="full")).stages[0].rows["boundaries"].baseline
    return [row(f"S={S},H={h},L={L},bf16", "megatron-full-recompute", live, pred, "boundaries")]


def _one_rank_group():  # noqa: ANN202
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    return dist.group.WORLD


def bench_vocab(N: int = 16384, H: int = 4096, V: int = 201088) -> list[Row]:
    rows: list[Row] = []
    shape = ModelShape(name="vocab", hidden=H, layers=1, heads=32, kv_heads=8, head_dim=128, ffn=1, vocab=V)
    hidden = torch.randn(N, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device=DEV, dtype=torch.bfloat16) * 0.02).requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)
    case = f"N={N},H={H},V={V},tp=1"
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        group = _one_rank_group()
        for fused, fn in ((False, vocab_parallel_cross_entropy), (True, fused_vocab_parallel_cross_entropy)):
            def step() -> None:
                # as in GPTModel, nothing but the loss function holds the [s, b, v] logits
                loss = fn((hidden @ weight.t()).unsqueeze(1), labels.unsqueeze(1), tp_group=group)
                loss.sum().backward()
                hidden.grad = weight.grad = None

            pred = M.vocab_baseline(shape, RunConfig(seq_len=N, cross_entropy_fusion=fused))
            rows.append(row(case, "megatron-fused-ce" if fused else "megatron-native-ce", peak_of(step), pred, "vocab"))
    except Exception as e:  # noqa: BLE001
        print(f"megatron cross-entropy skipped: {type(e).__name__}: {e}")
    try:
        from megatron_peakflat.vocab.api import ring_linear_cross_entropy
    except Exception as e:  # noqa: BLE001
        print(f"ring-dtp skipped: {type(e).__name__}: {e}")
        return rows
    for block in (0, 4096):
        pf = PeakflatConfig()
        pf.vocab = dataclasses.replace(pf.vocab, block_size=block)

        def ring() -> None:
            ring_linear_cross_entropy(hidden, weight, labels, block_size=block, reduction="sum").backward()
            hidden.grad = weight.grad = None

        pred = M.vocab_ring_dtp(shape, RunConfig(seq_len=N), pf)
        rows.append(row(case, "peakflat" if block == 0 else f"peakflat-b{block}", peak_of(ring), pred, "vocab"))
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/planner.py needs CUDA")
    rows = bench_model_state() + bench_boundaries() + bench_vocab()
    write("planner", rows)
    worst = max(abs(r.extra["error_pct"]) for r in rows)
    print(f"worst |error| {worst:.1f}% over {len(rows)} rows")


if __name__ == "__main__":
    main()
