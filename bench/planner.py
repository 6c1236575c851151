"""Planner: predicted vs measured peak, one row per term of the memory model (bench/results/planner.json).

    python bench/planner.py              # on one H200, about a minute; PYTHONPATH=. when not installed
    python bench/planner.py --dry-run    # tiny shapes on CPU (LiveBytesMeter), ~30 s: checks, no JSON
    python bench/planner.py --terms dispatch,optimizer    # a subset
    python bench/planner.py --terms dispatch --dispatch-shape 4096x8x2x14336 --dispatch-dtype fp32  # another layer

Each row measures one term of the memory model (``max_memory_allocated`` minus the memory allocated
before, inputs already on the device; with ``--dry-run``, the peak of LiveBytesMeter on CPU) and records the planner's
prediction for the same shape in ``extra.predicted_gib`` with ``extra.error_pct``. Predictions come
from ``megatron_peakflat.planner.model`` itself (``plan`` or the term's function), never from a formula
typed here. Terms (``--terms``):

- ``state``: parameters + gradients + Adam state of a small fp32 torch model shaped like the planner's layers;
- ``sco``: checkpoint boundaries of a bf16 block stack under ``torch.utils.checkpoint`` (full recompute), the
  planner's ``sco`` row (rows written before the planner's rows took their component's name say ``boundaries``);
- ``vocab``: Megatron's ``vocab_parallel_cross_entropy`` on a 1-rank group (native and fused), and
  Ring-DTP (``megatron_peakflat.vocab``);
- ``dispatch``: forward + backward of one Megatron MoELayer (local spec, SequentialMLP, bf16, SwiGLU)
  with ``--peakflat-dispatch pipelined-llep`` at the flags' defaults, inside Megatron's DDP with the
  distributed optimizer's parameter buffer (fp32 main_grad, as in training), at two token counts, so
  that the growth with tokens is checked too, in two regimes: ``recompute=none`` (the layer as is)
  and ``recompute=full`` (inside Megatron's checkpoint, where PipelinedLLEP fuses each chunk's
  forward and backward into the recompute), on the GPU with Megatron's SwiGLU unfused and fused (its training
  default, a torch.compile'd function; rows ``,fused_act``, planned with ``activation_fusion``). Measured: the
  step's peak above the inputs (the layer
  output is held through backward). Predicted: the plan's dispatch row for that recompute setting
  (``peakflat``: ``llep_expected_working_set``; ``extra.bound_gib``: ``working_set_bound``), plus,
  under full recompute, the plan's sco row (boundaries) of this one layer (its no-grad output, alive while
  it recomputes). The measurement also holds the router's [T, E] tensors, which the planner counts in
  its 'layer working set' row (~3% here);
- ``optimizer``: one step of ``OffloadStreamAdamW(engine='gpu')`` on a ~70M-parameter bf16 model after
  its host state exists (``dummy_step``): the GPU staging slots, at the default bucket and a smaller one.
  Predicted: the plan's optimizer row with ``--peakflat-optimizer offload-stream``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, megatron_ce, peak_once, write  # noqa: E402
from megatron_peakflat.config import PeakflatConfig  # noqa: E402
from megatron_peakflat.planner import model as M  # noqa: E402
from megatron_peakflat.planner.model import GIB, RunConfig, plan  # noqa: E402
from megatron_peakflat.planner.shapes import ModelShape  # noqa: E402

DEV = torch.device("cuda")
DRY = False
"""--dry-run: CPU tensors, LiveBytesMeter instead of the CUDA allocator's statistics."""
TERMS = ("state", "sco", "vocab", "dispatch", "optimizer")


def peak_of(fn: Callable[[], Any]) -> float:
    """Peak bytes above the allocation before ``fn`` (inputs already on the device)."""
    return peak_once(fn, cpu=DRY)[1]


def kept_by(fn: Callable[[], Any]) -> float:
    """Bytes that ``fn`` leaves allocated (alive after it returns)."""
    if DRY:
        from megatron_peakflat.testing.live_bytes import LiveBytesMeter

        gc.collect()
        with LiveBytesMeter() as m:
            fn()
            gc.collect()
            return m.live
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def row(case: str, method: str, measured: float, predicted: float, what: str, **extra: Any) -> Row:
    err = 100 * (measured - predicted) / predicted
    r = Row(case, method, round(measured / GIB, 4), None, None,
            {"predicted_gib": round(predicted / GIB, 4), "error_pct": round(err, 2), "term": what, **extra})
    print(f"{case:44s} {method:28s} {what:12s} measured {measured / GIB:8.4f} GiB  predicted "
          f"{predicted / GIB:8.4f} GiB  error {err:+6.1f}%", flush=True)
    return r


def state_model(s: ModelShape) -> nn.Module:
    """A torch model holding exactly the weights the planner counts for ``s`` (Megatron local-spec shapes)."""
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

    model = nn.ModuleList([nn.Embedding(s.vocab, h), nn.Linear(h, s.vocab, bias=False)]
                          + [layer(i >= s.dense_layers) for i in range(s.layers)])
    model.register_parameter("final_ln", nn.Parameter(torch.ones(h)))
    return model


STATE = ModelShape(name="state", hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, ffn=2816, vocab=32000,
                   experts=8, topk=2, moe_ffn=1024, dense_layers=1)
STATE_DRY = ModelShape(name="state", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=512,
                       experts=4, topk=2, moe_ffn=48, dense_layers=1)


def bench_model_state(s: ModelShape) -> list[Row]:
    run = RunConfig(seq_len=1024, precision="fp32", distributed_optimizer=False)
    pr = plan(s, run).stages[0].rows
    holder: dict[str, Any] = {}

    def build() -> None:
        holder["model"] = state_model(s).to(DEV)

    def grads() -> None:
        for p in holder["model"].parameters():
            p.grad = torch.ones_like(p)

    def adam() -> None:
        fused = DEV.type == "cuda"
        opt = torch.optim.Adam(holder["model"].parameters(), fused=fused, foreach=False if not fused else None)
        opt.step()
        holder["opt"] = opt

    case = f"H={s.hidden},L={s.layers},E={s.experts},fp32"
    rows = [row(case, "torch", peak_of(build), pr["parameters"].baseline, "parameters"),
            row(case, "torch", peak_of(grads), pr["gradients"].baseline, "gradients"),
            row(case, "torch-adam", kept_by(adam), pr["optimizer"].baseline, "optimizer")]
    holder.clear()
    return rows


def bench_sco(S: int = 32768, h: int = 4096, L: int = 8, b: int = 1) -> list[Row]:
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

    live = kept_by(forward)
    held.clear()
    pred = plan(shape, RunConfig(seq_len=S, micro_batch=b, recompute="full")).stages[0].rows["sco"].baseline
    return [row(f"S={S},H={h},L={L},bf16", "megatron-full-recompute", live, pred, "sco")]


def _one_rank_group():  # noqa: ANN202
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if DEV.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if DEV.type == "cuda" else "gloo", rank=0, world_size=1)
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
                loss = megatron_ce(fn, (hidden @ weight.t()).unsqueeze(1), labels.unsqueeze(1), group)
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
        # 'auto' is the Triton kernel on CUDA and the plain-PyTorch one on CPU: predict the one that runs
        pf.vocab = dataclasses.replace(pf.vocab, block_size=block, kernel="torch" if DRY else pf.vocab.kernel)

        def ring() -> None:
            ring_linear_cross_entropy(hidden, weight, labels, block_size=block, reduction="sum").backward()
            hidden.grad = weight.grad = None

        pred = M.vocab_ring_dtp(shape, RunConfig(seq_len=N), pf, main_grad=False)  # dW returned
        rows.append(row(case, "peakflat" if block == 0 else f"peakflat-b{block}", peak_of(ring), pred, "vocab"))
    return rows


def moe_layer_shape(hidden: int, experts: int, topk: int, ffn: int) -> ModelShape:
    """The planner's shape of the dispatch term's MoE layer (``bench.dispatch.build_layer``: one gated layer, heads of
    128), so that its rows are planned again as they were measured."""
    return ModelShape(name="moe-layer", hidden=hidden, layers=1, heads=max(1, hidden // 128),
                      kv_heads=max(1, hidden // 128), head_dim=128, ffn=4 * hidden, vocab=1000, experts=experts,
                      topk=topk, moe_ffn=ffn, gated=True)


def bench_dispatch(tokens: tuple[int, ...] = (16384, 65536), hidden: int = 4096, experts: int = 64, topk: int = 8,
                   ffn: int = 1536, chunk_cap: int | None = None, regimes: tuple[str, ...] = ("none", "full"),
                   fusions: tuple[bool, ...] = (False,), dtype: torch.dtype = torch.bfloat16) -> list[Row]:
    """PipelinedLLEP's working set in one Megatron MoELayer forward + backward, measured vs the plan, for each of
    ``fusions`` (Megatron's fused SwiGLU off / on: the plan's ``activation_fusion``) and in ``dtype`` (fp32 takes
    the per-expert path, bf16 the grouped GEMMs)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import megatron_peakflat
    from bench.dispatch import build_layer
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.testing import megatron_cpu

    _one_rank_group()
    megatron_cpu.init_megatron_parallel(ep=1, cpu=DRY)
    # fp32 takes the per-expert path, as on the GPU (torch._grouped_mm takes bf16 there; the CPU would group fp32)
    disp = DispatchConfig(impl="pipelined-llep", grouped_gemm=dtype == torch.bfloat16)
    if chunk_cap is not None:
        disp = dataclasses.replace(disp, chunk_cap=chunk_cap)
    pf = PeakflatConfig(dispatch=disp, general=GeneralConfig(attention="local"))
    megatron_peakflat.apply(pf)  # MoELayer gets the PipelinedLLEP dispatcher
    rows: list[Row] = []
    try:
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        shape = moe_layer_shape(hidden, experts, topk, ffn)
        for fused in fusions:
            _, layer = build_layer(hidden, experts, topk, ffn, DRY, ddp=False, dtype=dtype,
                                   activation_fusion=fused)
            # As in training: the distributed optimizer's parameter buffer (experts at one stride, so the
            # grouped GEMMs see one run) and fp32 main_grad buffers that take the weight gradients.
            ddp = DistributedDataParallel(layer.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True), layer)
            layer.moe_layer_recompute = False  # PipelinedLLEP recomputes its chunks itself
            for regime in regimes:
                measured_at: dict[int, tuple[float, float, float]] = {}
                for T in tokens:
                    g = torch.Generator(device="cpu").manual_seed(T)
                    x = (torch.randn(T, 1, hidden, generator=g) * 0.5).to(DEV, dtype).requires_grad_(True)
                    gout = torch.randn(T, 1, hidden, generator=g).to(DEV, dtype)
                    step = _moe_step(ddp, x, gout, regime)
                    step()  # warm-up: library workspaces, the router's first call, weight packing
                    ddp.zero_grad_buffer()
                    x.grad = None
                    # Measure a layer's first recompute, the run's peak: it computes the MoE output, which the
                    # later ones skip once the assumed gradient is confirmed (integration/dispatch_recompute.py).
                    layer.token_dispatcher._bank.assumed_grad_confirmed = False
                    stats.reset()
                    measured = peak_of(step)
                    snap = stats.snapshot().get("dispatch", {})
                    run = RunConfig(seq_len=T, precision=precision, recompute=regime, activation_fusion=fused)
                    pr = plan(shape, run, pf).stages[0].rows
                    # Under full recompute the layer's no-grad output (the next checkpoint boundary, the plan's
                    # 'sco' row for this one layer) is alive while the layer recomputes.
                    held = pr["sco"].baseline if regime == "full" else 0.0
                    predicted, bound = pr["dispatch"].peakflat + held, pr["dispatch"].bound + held
                    K, c = M.llep_chunks(shape, run, pf)
                    measured_at[T] = (measured, predicted, bound)
                    rows.append(row(f"recompute={regime},N={T},H={hidden},E={experts},k={topk},F={ffn},ep=1,{precision}"
                                    f"{',fused_act' if fused else ''}",
                                    "peakflat", measured, predicted, "dispatch", bound_gib=round(bound / GIB, 4),
                                    within_bound=measured <= bound, boundary_gib=round(held / GIB, 4),
                                    chunk_cap=pf.dispatch.cap(topk), chunks=snap.get("chunks"), chunks_planned=K,
                                    max_chunk_rows=snap.get("max_chunk_rows"), rows_planned=c,
                                    experts_path=snap.get("experts"), dispatch_recompute=M.llep_fused(run, pf),
                                    dispatch_recompute_calls=snap.get("dispatch_recompute_calls", 0)))
                    del x, gout, step
                    ddp.zero_grad_buffer()
                    gc.collect()
                if len(tokens) >= 2:
                    (m0, p0, b0), (m1, p1, b1) = measured_at[tokens[0]], measured_at[tokens[-1]]
                    growth = {"growth_measured_gib": round((m1 - m0) / GIB, 4),
                              "growth_predicted_gib": round((p1 - p0) / GIB, 4),
                              "growth_bound_gib": round((b1 - b0) / GIB, 4),
                              "growth_error_pct": round(100 * ((m1 - m0) - (p1 - p0)) / max(p1 - p0, 1.0), 2)}
                    rows[-1].extra.update(growth)
                    print(f"dispatch growth, recompute={regime}, fused_act={fused}, {tokens[0]} -> {tokens[-1]} "
                          f"tokens: measured {growth['growth_measured_gib']:.4f} GiB, predicted "
                          f"{growth['growth_predicted_gib']:.4f} GiB, bound {growth['growth_bound_gib']:.4f} GiB", flush=True)
            del ddp, layer
    finally:
        megatron_peakflat.remove()
        gc.collect()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _moe_step(ddp: Any, x: torch.Tensor, gout: torch.Tensor, regime: str) -> Callable[[], None]:
    """Forward + backward of the layer; ``regime='full'``: inside Megatron's checkpoint (full recompute),
    where PipelinedLLEP fuses each chunk's forward and backward into the recompute."""
    from megatron.core import tensor_parallel

    def run(h: torch.Tensor) -> torch.Tensor:
        return ddp(h)[0]

    def step() -> None:
        out = tensor_parallel.checkpoint(run, False, x) if regime == "full" else run(x)
        out.backward(gout)  # the output is held through backward, as the term counts it

    return step


OPT = ModelShape(name="opt", hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, ffn=2816, vocab=8000,
                 experts=4, topk=2, moe_ffn=1024, dense_layers=1)
"""~73M parameters: two buckets at the default 50M, five at 16M (more than the 3 staging slots)."""
OPT_DRY = ModelShape(name="opt", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=512,
                     experts=4, topk=2, moe_ffn=48, dense_layers=1)


def bench_optimizer(s: ModelShape, buckets: tuple[int, ...]) -> list[Row]:
    """GPU bytes of one OffloadStreamAdamW(engine='gpu') step (the staging slots) vs the plan's optimizer row."""
    from megatron_peakflat.optimizer import OffloadStreamAdamW
    from megatron_peakflat.optimizer.config import OptimizerConfig

    model = state_model(s).to(DEV, torch.bfloat16)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    n = sum(p.numel() for p in params)
    run = RunConfig(seq_len=1024, precision="bf16", distributed_optimizer=False)
    counted = sum(M.stage_params(s, run, s.dense_layers, s.moe_layers, True, True))
    assert n == counted, f"the model holds {n} parameters, the planner counts {counted}"
    rows = []
    for i, bucket in enumerate(buckets):
        pf = PeakflatConfig(optimizer=OptimizerConfig(impl="offload-stream", bucket=bucket, engine="gpu"))
        opt = OffloadStreamAdamW(params, bucket=bucket, engine="gpu", slots=pf.optimizer.slots)
        opt.dummy_step()  # the host state (pinned host memory, not the device's)
        measured = peak_of(opt.step)
        t0 = time.perf_counter()
        opt.step()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        pr = plan(s, run, pf).stages[0].rows["optimizer"]
        method = "peakflat-gpu" if i == 0 else f"peakflat-gpu-b{bucket}"
        rows.append(row(f"params={n},bf16", method, measured, pr.peakflat, "optimizer", bucket=bucket,
                        slots=pf.optimizer.slots, buckets=-(-n // bucket), bound_gib=round(pr.bound / GIB, 4),
                        step_ms=round(ms, 2)))
        del opt
        gc.collect()
    del model, params
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    global DEV, DRY
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU with LiveBytesMeter; writes no JSON")
    ap.add_argument("--terms", default=",".join(TERMS), help="comma list of %(default)s")
    ap.add_argument("--tol", type=float, default=10.0,
                    help="--dry-run fails when a dispatch or optimizer row is off by more than this many percent")
    ap.add_argument("--dispatch-shape", default=None, metavar="HxExKxF",
                    help="the dispatch term's MoE layer: hidden x experts x top-k x expert FFN "
                         "(default 4096x64x8x1536)")
    ap.add_argument("--dispatch-tokens", default=None, metavar="T1,T2", help="its token counts (default 16384,65536)")
    ap.add_argument("--dispatch-dtype", choices=("bf16", "fp32"), default="bf16",
                    help="bf16 runs the grouped GEMMs, fp32 the per-expert path (default bf16)")
    args = ap.parse_args(argv)
    try:
        layer_shape = tuple(int(v) for v in args.dispatch_shape.split("x")) if args.dispatch_shape else None
        layer_tokens = tuple(int(v) for v in args.dispatch_tokens.split(",")) if args.dispatch_tokens else None
    except ValueError:
        ap.error("--dispatch-shape takes HxExKxF (e.g. 4096x8x2x14336), --dispatch-tokens T1,T2 (e.g. 16384,65536)")
    if layer_shape is not None and len(layer_shape) != 4:
        ap.error(f"--dispatch-shape {args.dispatch_shape}: pass four sizes, HxExKxF (e.g. 4096x8x2x14336)")
    terms = [t for t in args.terms.split(",") if t]
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise SystemExit(f"--terms: unknown {sorted(unknown)}; choose from {','.join(TERMS)}")
    DRY = args.dry_run
    if DRY:
        from megatron_peakflat.testing import megatron_cpu

        megatron_cpu.install_cpu_shim()  # before Megatron builds anything; CUDA stays untouched on the GPU path
        DEV = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("bench/planner.py needs CUDA (or --dry-run)")
    t0 = time.time()
    rows: list[Row] = []
    for term in terms:
        try:
            if term == "state":
                rows += bench_model_state(STATE_DRY if DRY else STATE)
            elif term == "sco":
                rows += bench_sco(256, 64, 4, 2) if DRY else bench_sco()
            elif term == "vocab":
                rows += bench_vocab(512, 64, 4096) if DRY else bench_vocab()
            elif term == "dispatch":
                dtype = torch.float32 if args.dispatch_dtype == "fp32" else torch.bfloat16
                if DRY:  # LiveBytesMeter runs torch.compile'd functions as plain ops: the unfused path alone
                    rows += bench_dispatch(layer_tokens or (2048, 8192), *(layer_shape or (256, 16, 4, 96)),
                                           chunk_cap=8192, dtype=dtype)
                else:
                    rows += bench_dispatch(layer_tokens or (16384, 65536), *(layer_shape or (4096, 64, 8, 1536)),
                                           fusions=(False, True), dtype=dtype)
            elif term == "optimizer":
                rows += bench_optimizer(OPT_DRY, (20_000, 6_000)) if DRY else bench_optimizer(OPT, (50_000_000, 16_000_000))
        except Exception:  # noqa: BLE001 - one failing term must not lose the others' rows on the GPU
            if DRY:
                raise
            traceback.print_exc()
            print(f"term {term} failed; its rows are missing", flush=True)
    print(f"total {time.time() - t0:.0f} s")
    if not rows:
        raise SystemExit("no rows measured")
    worst = max(abs(r.extra["error_pct"]) for r in rows)
    print(f"worst |error| {worst:.1f}% over {len(rows)} rows")
    if DRY:
        bad = [r for r in rows if r.extra["term"] in ("dispatch", "optimizer") and abs(r.extra["error_pct"]) > args.tol]
        bad += [r for r in rows if r.extra.get("within_bound") is False]
        if bad:
            raise SystemExit(f"dry run: {len(bad)} dispatch/optimizer rows off by more than {args.tol}% or over "
                             f"their bound: {[(r.case, r.method) for r in bad]}")
        print("dry run: dispatch and optimizer rows within tolerance (no JSON written)")
        return
    write("planner", rows, merge=set(terms) != set(TERMS))  # a subset of terms keeps the other terms' rows


if __name__ == "__main__":
    main()
