"""Peak planner: formulas against hand-computed values, published parameter counts, the H200 anchors,
and LiveBytesMeter measurements of small torch models on CPU."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_peakflat.config import PeakflatConfig
from megatron_peakflat.dispatch.config import DispatchConfig
from megatron_peakflat.optimizer.config import OptimizerConfig
from megatron_peakflat.planner import model as M
from megatron_peakflat.planner.build import build
from megatron_peakflat.planner.model import GIB, RunConfig, plan
from megatron_peakflat.planner.shapes import PRESETS, ModelShape
from megatron_peakflat.sco.config import SCOConfig
from megatron_peakflat.testing.live_bytes import LiveBytesMeter


def total_params(shape: ModelShape) -> float:
    run = RunConfig(seq_len=4096)
    d, e = M.stage_params(shape, run, shape.dense_layers if shape.experts else shape.layers, shape.moe_layers, True, True)
    return d + e


# ---- published parameter counts --------------------------------------------------------------

@pytest.mark.parametrize("name,published,tol", [
    ("gpt-oss-120b", 116.8e9, 0.01),   # OpenAI model card: 116.8B total
    ("gpt-oss-20b", 20.9e9, 0.02),     # 20.9B total
    ("qwen3-235b-a22b", 235e9, 0.02),  # 235B total
    ("deepseek-v3", 671e9, 0.02),      # 671B main model (the 14B MTP module is not modelled)
])
def test_parameter_count_matches_published(name, published, tol):
    got = total_params(PRESETS[name])
    assert abs(got - published) / published < tol, f"{name}: {got / 1e9:.2f}B vs {published / 1e9:.1f}B"


# ---- hand-computed formulas -----------------------------------------------------------------

TINY = ModelShape(name="tiny", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=1024,
                  experts=8, topk=2, moe_ffn=32, dense_layers=1)


def test_params_by_hand():
    run = RunConfig(seq_len=128, tp=2, ep=4, dp=2)  # world 4... tp x dp = 4 GPUs, EP 4
    dense, expert = M.stage_params(TINY, run, 1, 3, True, True)
    attn = (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64) / 2 + 2 * 64
    mlp = 3 * 64 * 128 / 2
    router = 64 * 8
    emb = 1024 * 64 / 2
    out = 1024 * 64 / 2 + 64
    assert dense == pytest.approx(4 * attn + mlp + 3 * router + emb + out)
    assert expert == pytest.approx(3 * (8 / 4) * 3 * 64 * 32)


def test_output_layer_sharded_over_ep_by_hand():
    """--peakflat-vocab-shard-over-ep at TP=1: the output layer's V x H become V/EP x H expert-parallel
    params on each rank (parameters and gradients of the peakflat column), and the ring is the EP group."""
    from megatron_peakflat.vocab.config import VocabConfig

    run = RunConfig(seq_len=4096, tp=1, ep=4, dp=4)
    dense, expert = M.stage_params(TINY, run, 1, 3, True, True)
    d4, e4 = M.stage_params(TINY, run, 1, 3, True, True, output_shards=4)
    assert d4 == pytest.approx(dense - 1024 * 64) and e4 == pytest.approx(expert + 1024 * 64 / 4)
    pf = PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", shard_over_ep=True))
    assert M.vocab_ring_size(run, pf) == 4 and M.vocab_ring_size(run, PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))) == 1
    assert M.vocab_ring_size(RunConfig(seq_len=4096, tp=2, ep=4, dp=2), pf) == 2  # TP > 1: the TP ring
    base = plan(TINY, run, PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))).stages[0].rows
    got = plan(TINY, run, pf).stages[0].rows
    for name, per_param in (("parameters", run.w), ("gradients", run.grad_bytes)):
        assert got[name].baseline == base[name].baseline
        assert base[name].baseline - got[name].peakflat == pytest.approx(1024 * 64 * 3 / 4 * per_param)
    # Megatron's optimizer state follows the shard: the same per rank under the distributed optimizer (dense
    # over DP=4 before, V/4 rows over expert-DP=1 after), V/EP rows instead of V without it
    state = 4 + 8 if run.w < 4 else 8
    assert got["optimizer"].peakflat == pytest.approx(base["optimizer"].baseline)
    plain = replace(run, distributed_optimizer=False)
    base = plan(TINY, plain, PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))).stages[0].rows["optimizer"]
    got = plan(TINY, plain, pf).stages[0].rows["optimizer"]
    assert got.baseline == base.baseline == base.peakflat
    assert base.baseline - got.peakflat == pytest.approx(1024 * 64 * 3 / 4 * state)


def test_boundaries_sco_and_optimizer_by_hand():
    run = RunConfig(seq_len=1024, cp=2, tp=2, dp=1, ep=2, recompute="full", hbm_bytes=80 * GIB,
                    host_bytes_per_node=1 * GIB)
    boundary = (1024 / 2 / 2) * 64 * 2  # [s/cp/tp, b, h] in bf16
    off = plan(TINY, run, PeakflatConfig())
    st = off.stages[0]
    assert st.rows["sco"].baseline == pytest.approx(4 * boundary)
    # SCO with a budget holding everything: 1 + prefetch boundaries stay on the GPU.
    on = PeakflatConfig(sco=SCOConfig(enabled=True, budget=10**9, prefetch=1))
    row = plan(TINY, run, on).stages[0].rows["sco"]
    assert row.peakflat == pytest.approx(2 * boundary) and row.host_peakflat == pytest.approx(4 * boundary)
    # A budget of 2.5 boundaries holds 2 whole ones: 2 stay + 2 brought back.
    on = PeakflatConfig(sco=SCOConfig(enabled=True, budget=int(2.5 * boundary), prefetch=1))
    row = plan(TINY, run, on).stages[0].rows["sco"]
    assert row.peakflat == pytest.approx(4 * boundary) and row.host_peakflat == pytest.approx(2 * boundary)
    # No budget: nothing offloaded, and the bound is still 1 + prefetch boundaries.
    on = PeakflatConfig(sco=SCOConfig(enabled=True, budget=0))
    row = plan(TINY, run, on).stages[0].rows["sco"]
    assert row.peakflat == pytest.approx(4 * boundary) and row.bound == pytest.approx(2 * boundary)
    # Optimizer: 12 B/param over DPxCP (dense) and expert-DP (experts); OffloadStreamAdamW: 3 x bucket x 16 B.
    dense, expert = M.stage_params(TINY, run, 1, 3, True, True)
    opt = st.rows["optimizer"]
    assert opt.baseline == pytest.approx(12 * (dense / (run.dp * run.cp) + expert / run.expert_dp))
    assert run.expert_dp == 2  # TPxCPxDP / EP = 4 / 2
    assert opt.peakflat == opt.baseline  # the optimizer component is off in this config
    on = PeakflatConfig(optimizer=OptimizerConfig(impl="offload-stream"))
    opt = plan(TINY, run, on).stages[0].rows["optimizer"]
    # one OffloadStreamAdamW per chained optimizer (dense over DP x CP, experts over expert-DP), each with
    # 3 slots of its largest bucket, or one per bucket when it has fewer (a tiny model: one bucket each)
    assert dense / 2 < 50_000_000 and expert / 2 < 50_000_000
    assert opt.peakflat == pytest.approx((dense / 2 + expert / 2) * 16)
    big = PeakflatConfig(optimizer=OptimizerConfig(impl="offload-stream", bucket=int(dense / 2 / 2.5)))
    b = int(dense / 2 / 2.5)  # dense: 3 buckets, 3 slots; experts: as many buckets as fit, at most 3 slots
    assert plan(TINY, run, big).stages[0].rows["optimizer"].peakflat == pytest.approx(
        (3 * b + min(3, -(-expert / 2 // b)) * min(b, expert / 2)) * 16)
    assert opt.bound == pytest.approx(2 * 3 * 50_000_000 * 16)
    cpu_engine = PeakflatConfig(optimizer=OptimizerConfig(impl="offload-stream", engine="cpu"))
    assert plan(TINY, run, cpu_engine).stages[0].rows["optimizer"].peakflat == 0
    # pinned host: fp32 master and moments, plus the host kernel's slot per bucket (4 B in + bf16 out) unless
    # the engine is 'gpu'; the optimizer's own promise (optimizer/api.py _host_need) counts the same bytes
    assert opt.host_peakflat == pytest.approx((12 + 4 + 2) * (dense / 2 + expert / 2))
    gpu_engine = PeakflatConfig(optimizer=OptimizerConfig(impl="offload-stream", engine="gpu"))
    assert plan(TINY, run, gpu_engine).stages[0].rows["optimizer"].host_peakflat == pytest.approx(12 * (dense / 2 + expert / 2))


def test_llep_bound_and_chunk_growth_by_hand():
    run = RunConfig(seq_len=4096, ep=4, dp=4)
    pf = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=1024))
    assert M.llep_chunks(TINY, run, pf) == (8, 1024)  # 512 tokens x top-2 per chunk, 4096 tokens
    bound_rows, expected_rows = M.llep_rows(TINY, run, pf)
    assert bound_rows == 4 * (1024 + 2) and expected_rows == 4096 * 2 / 8
    per_row = 2 * (12 * 64 + 3 * 64 + 4 * 32) + 64  # dispatch/api.py working_set_bound
    per_token = 2 * 64 * 2 + 4 * 8 + 64 + 28 * 2  # ... + 28 B per token-expert pair (top-2)
    experts = 2 * 3 * 64 * 32 * 2
    # Moved experts: 'auto' hosts all 6 foreign experts (a quarter of 4 x 1024 rows of 12 x 64 bf16 elements
    # would hold 42 of 6144 x (2 + 4) B); a rank sends at most min(3 x 2, 3 + 2) = 5 weight copies.
    moved = 6 * 6144 * (2 + 4) + 5 * 6144 * 2
    assert M.llep_working_set(TINY, run, bound_rows) == 4096 * per_token + 2 * experts + moved + bound_rows * per_row
    # K would be 512 > max_chunks 4: the chunk grows to 1024 tokens x 2.
    assert M.llep_chunks(TINY, run, PeakflatConfig(dispatch=DispatchConfig(chunk_cap=16, max_chunks=4))) == (4, 2048)
    # The baseline grows with skew; PipelinedLLEP rebalances skew >= lambda to alpha x mean.
    a = plan(TINY, run, pf).stages[0].rows["dispatch"]
    b = plan(TINY, dataclasses.replace(run, routing_skew=3.0), pf).stages[0].rows["dispatch"]
    assert b.baseline == pytest.approx(3 * a.baseline) and b.peakflat == a.peakflat and b.bound == a.bound
    assert a.peakflat <= a.bound


def test_llep_working_set_matches_component_bound():
    from megatron_peakflat.dispatch import api
    run = RunConfig(seq_len=4096, ep=4, dp=4)
    rows = 4104
    moved = dict(expert_numel=3 * 64 * 32, hosted=6, sent=5)  # every foreign expert; min(3 x 2, 3 + 2) copies
    theirs = api.working_set_bound(num_tokens=4096, hidden=64, ffn=32, num_experts=8, topk=TINY.topk, chunk_rows=rows,
                                   expert_param_bytes=2 * 3 * 64 * 32 * 2, dtype_bytes=2, glu=True, ep=4, **moved)
    assert M.llep_working_set(TINY, run, rows) == theirs
    theirs = api.working_set_bound(num_tokens=4096, hidden=64, ffn=32, num_experts=8, topk=TINY.topk, chunk_rows=rows,
                                   expert_param_bytes=2 * 3 * 64 * 32 * 2, dtype_bytes=2, glu=True, ep=4, overlap=True,
                                   **moved)
    assert M.llep_working_set(TINY, run, rows, overlap=True) == theirs == M.llep_working_set(TINY, run, rows) + rows * 16 * 64


def test_llep_expected_working_set_by_hand():
    """The peakflat column: per token 2Hw + E w + 28k; per chunk row the larger moment of the grouped
    backward (or the per-expert path's), no expert-gradient term (DDP's buffer holds those)."""
    s = ModelShape(name="h200", hidden=4096, layers=1, heads=32, kv_heads=32, head_dim=128, ffn=16384, vocab=1024,
                   experts=64, topk=8, moe_ffn=1536)
    pf = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=32768))
    H, F, f1, E, k, w, R = 4096, 1536, 3072, 64, 8, 2, 32768
    per_token = 2 * H * w + E * w + 28 * k
    rows = 2 * H * w + f1 * w + 2 * w  # dispatched rows and their output gradient, fc1 output, prob + gradient

    # Megatron's SwiGLU unfused (as the CPU traces run it): its saved tensors (3F) and the activation output, its
    # gradient and two products (4F); fused (the GPU's default): the activation output, its gradient and fc1's
    # output gradient (4F), the function saving only fc1's output, which ``rows`` holds
    for fusion, act in ((False, 3 * F + 4 * F), (True, 4 * F)):
        def moments(rows: int, act: int = act) -> list[int]:
            return [R * (rows + w * act), R * (rows + H * w)]  # activation backward; dX

        plain = moments(rows)
        assert plain.index(max(plain)) == 0  # at these shapes the activation's backward is the peak moment
        fused = moments(rows + H * w)  # fused recompute (full recompute, the default flag): the chunk's output too
        for recompute, chunk in (("none", max(plain)), ("full", max(fused))):
            for T in (16384, 65536):
                run = RunConfig(seq_len=T, recompute=recompute, activation_fusion=fusion)
                assert M.llep_chunks(s, run, pf) == (T // 4096, R)
                assert M.llep_fused(run, pf) == (recompute == "full")
                got = M.llep_expected_working_set(s, run, pf, R)
                assert got == T * per_token + chunk
                row = plan(s, run, pf).stages[0].rows["dispatch"]
                assert row.peakflat == got and row.peakflat < row.bound  # the expected value sits under the guarantee
        no_fuse = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", fuse_recompute=False, chunk_cap=32768))
        run = RunConfig(seq_len=16384, activation_fusion=fusion)
        assert M.llep_expected_working_set(s, run, no_fuse, R) == 16384 * per_token + max(plain)
        # the per-expert path (grouped GEMMs off, or not bf16): every row's saved activation (unfused 4F, fused F)
        # and the largest of the forward's end (fc2 outputs, their concatenation: 2H), the first segment's backward
        # (the concatenation, and R / 64 experts rows' transients) and the end (the segments' dX and their
        # concatenation beside the input, output gradient and output rows: 5H)
        off = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", grouped_gemm=False))
        saved = (1 if fusion else 4) * F
        moments = [R * (rows + w * (saved + 2 * H)),
                   R * (rows + w * (saved + H)) + R // 64 * w * ((3 if fusion else 7) * F + H),
                   R * (rows - f1 * w + 3 * H * w)]
        assert M.llep_expected_working_set(s, run, off, R) == 16384 * per_token + max(moments)
    # growth with tokens is the per-token term only: the chunk is capped
    a, b = (M.llep_expected_working_set(s, RunConfig(seq_len=T), pf, R) for T in (16384, 65536))
    assert b - a == (65536 - 16384) * per_token
    off = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", grouped_gemm=False))
    assert not M.llep_grouped(RunConfig(seq_len=16384), off) and not M.llep_grouped(RunConfig(16384, precision="fp32"), pf)
    # a command line's fusion: Megatron's default is fused; --no-bias-swiglu-fusion unfuses it
    line = "--num-layers 1 --hidden-size 64 --num-attention-heads 1 --seq-length 64 --swiglu"
    assert build(["--megatron-args", line, "--gpus", "1"])[1].activation_fusion
    assert not build(["--megatron-args", line + " --no-bias-swiglu-fusion", "--gpus", "1"])[1].activation_fusion
    # a small expert: the block is every local expert's gradient, not 256 MiB
    tiny = ModelShape(name="t", hidden=64, layers=1, heads=1, kv_heads=1, head_dim=64, ffn=64, vocab=10, experts=4,
                      topk=2, moe_ffn=32)
    got = M.llep_expected_working_set(tiny, RunConfig(seq_len=10, recompute="none", activation_fusion=False), pf, 4)
    r = 2 * 64 * 2 + 64 * 2 + 4
    assert got == 10 * (2 * 64 * 2 + 4 * 2 + 56) + max(4 * (r + 2 * 7 * 32), 4 * (r + 128))


def _moe_layer_working_set(rank, world_size, hidden, experts, topk, ffn, tokens, chunk_cap, grouped=True,
                           regimes=("none", "full"), one_expert=False, unsplit=False):
    """Peak LiveBytes of one Megatron MoELayer forward + backward with PipelinedLLEP (bf16 with grouped GEMMs, or
    fp32 on the per-expert path; DDP with the distributed optimizer's buffers), as bench/planner.py measures it on
    the GPU: as is, and inside Megatron's checkpoint (full recompute, chunks fused into the recompute).
    ``one_expert``: the router sends every token to expert 0 (its other picks tie). ``unsplit``: the per-expert
    path runs each expert's rows as one call, as before ``segment_piece_rows``. {(regime, T): bytes}."""
    import gc

    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    import megatron_peakflat
    from bench.dispatch import build_layer
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.testing import megatron_cpu

    megatron_cpu.init_megatron_parallel(ep=1, cpu=True)
    pf = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=chunk_cap, grouped_gemm=grouped),
                        general=GeneralConfig(attention="local"))
    megatron_peakflat.apply(pf)
    if unsplit:
        from megatron_peakflat.integration import dispatch as integration_dispatch

        integration_dispatch.segment_piece_rows = lambda rows, experts: max(1, rows)
    dtype = torch.bfloat16 if grouped else torch.float32
    _, layer = build_layer(hidden, experts, topk, ffn, True, ddp=False, dtype=dtype)
    if one_expert:  # logits: 1000 for expert 0 on every token (its input's first feature is 10), 0 elsewhere
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[0, 0] = 100.0
    ddp = DistributedDataParallel(layer.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), layer)
    layer.moe_layer_recompute = False
    out = {}
    for regime in regimes:
        for T in tokens:
            x = torch.randn(T, 1, hidden, dtype=dtype)
            if one_expert:
                x[..., 0] = 10.0
            x.requires_grad_(True)
            gout = torch.randn(T, 1, hidden, dtype=dtype)

            def step(x=x, gout=gout, regime=regime):
                y = tensor_parallel.checkpoint(lambda h: ddp(h)[0], False, x) if regime == "full" else ddp(x)[0]
                y.backward(gout)

            step()  # warm-up
            for steady in ((False, True) if regime == "full" else (False,)):
                # A run's first recompute of each layer computes the MoE output and confirms the assumed
                # gradient (what the planner counts: its peak); later ones skip the output.
                layer.token_dispatcher._bank.assumed_grad_confirmed = steady
                ddp.zero_grad_buffer()
                x.grad = None
                gc.collect()
                stats.reset()
                with LiveBytesMeter() as m:
                    step()
                out[regime + ("-steady" if steady else ""), T] = m.peak
                snap = stats.snapshot()["dispatch"]
                assert snap.get("dispatch_recompute_calls", 0) == (regime == "full")
                assert snap.get("dispatch_recompute_output_skipped", 0) == steady
                assert snap.get("experts") == ("grouped" if grouped else "per-expert")
                out["calls_split", T] = snap.get("expert_calls_split", 0)
    megatron_peakflat.remove()
    return out


@pytest.mark.parametrize("H,E,k,F", [(256, 8, 2, 896), (384, 64, 8, 64)], ids=["wide-experts", "many-experts"])
def test_llep_per_expert_path_against_a_megatron_moe_layer(H, E, k, F):
    """The per-expert path (fp32; grouped GEMMs off) against LiveBytesMeter on a Megatron MoELayer (CPU, its SwiGLU
    unfused), at a shape whose experts are wide (the activations bind) and one with many narrow experts (the
    segments' dX binds), with one chunk and with four: within 10%, and under the bound."""
    from megatron_peakflat.testing.distributed import run_distributed

    cap, tokens = 4096, (2048 if k == 8 else 8192,) + ((2048,) if k == 2 else ())
    measured = run_distributed(_moe_layer_working_set, 1, H, E, k, F, tokens, cap, False, ("none",))[0]
    s = ModelShape(name="moe", hidden=H, layers=1, heads=2, kv_heads=2, head_dim=128, ffn=4 * H, vocab=1024,
                   experts=E, topk=k, moe_ffn=F)
    pf = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=cap, grouped_gemm=False))
    for (regime, T), got in measured.items():
        if regime == "calls_split":
            continue
        run = RunConfig(seq_len=T, recompute="none", precision="fp32", activation_fusion=False)
        row = plan(s, run, pf).stages[0].rows["dispatch"]
        assert abs(got - row.peakflat) / row.peakflat < 0.10, (T, got, row.peakflat)
        assert got <= row.bound, (T, got, row.bound)


def test_llep_per_expert_path_is_bounded_when_every_token_picks_one_expert():
    """Adversarial routing on the per-expert path: every token's first pick is expert 0, so that expert holds half
    of each chunk's rows (top-2). Its rows run in pieces of ``segment_piece_rows``, and the peak stays within the
    plan, which holds whatever the routing; one call per expert (``unsplit``) exceeds it by the heavy expert's
    activation gradients."""
    from megatron_peakflat.testing.distributed import run_distributed

    H, E, k, F, cap, T = 256, 8, 2, 896, 4096, 8192
    s = ModelShape(name="moe", hidden=H, layers=1, heads=2, kv_heads=2, head_dim=128, ffn=4 * H, vocab=1024,
                   experts=E, topk=k, moe_ffn=F)
    pf = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=cap, grouped_gemm=False))
    planned = plan(s, RunConfig(seq_len=T, recompute="none", precision="fp32", activation_fusion=False),
                   pf).stages[0].rows["dispatch"].peakflat
    split = run_distributed(_moe_layer_working_set, 1, H, E, k, F, (T,), cap, False, ("none",), True)[0]
    whole = run_distributed(_moe_layer_working_set, 1, H, E, k, F, (T,), cap, False, ("none",), True, True)[0]
    assert split["calls_split", T] > 0 and whole["calls_split", T] == 0
    assert split["none", T] <= planned * 1.02, (split["none", T], planned)
    assert whole["none", T] > planned * 1.10, (whole["none", T], planned)


def test_llep_expected_working_set_against_a_megatron_moe_layer():
    """The planner's dispatch row (peakflat column) against LiveBytesMeter on a Megatron MoELayer (CPU, bf16, its
    SwiGLU unfused: LiveBytesMeter runs torch.compile'd functions as plain ops):
    within 10% at two token counts, with and without full recompute (a layer's first recompute, the
    run's peak), and under the bound; the later recomputes, which skip the MoE output, hold less."""
    from megatron_peakflat.testing.distributed import run_distributed

    H, E, k, F, cap = 256, 16, 4, 96, 8192
    tokens = (2048, 8192)
    measured = run_distributed(_moe_layer_working_set, 1, H, E, k, F, tokens, cap)[0]
    s = ModelShape(name="moe", hidden=H, layers=1, heads=2, kv_heads=2, head_dim=128, ffn=4 * H, vocab=1024,
                   experts=E, topk=k, moe_ffn=F)
    pf = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=cap))
    for T in tokens:
        assert measured["full-steady", T] < measured["full", T]
    for (regime, T), got in measured.items():
        if regime in ("full-steady", "calls_split"):
            continue
        rows = plan(s, RunConfig(seq_len=T, recompute=regime, activation_fusion=False), pf).stages[0].rows
        held = rows["sco"].baseline  # full recompute: the layer's no-grad output is alive in its recompute
        predicted, bound = rows["dispatch"].peakflat + held, rows["dispatch"].bound + held
        assert abs(got - predicted) / predicted < 0.10, (regime, T, got, predicted)
        assert got <= bound, (regime, T, got, bound)


def test_dispatch_rows_measured_on_a_gpu_are_planned():
    """bench/results/planner.json's dispatch rows (one H200; one H100 with Megatron's SwiGLU unfused and fused,
    ``,fused_act``), replanned, with the router's [T, E] tensors that the measurement holds: the grouped GEMMs (bf16)
    within -2% to +3%, the per-expert path (fp32) within -3% to +20% (over where one chunk takes the layer's rows
    and its backward peaks below the planned moment)."""
    import json
    import re

    from bench.planner import moe_layer_shape

    rows = json.loads((Path(__file__).resolve().parent.parent / "bench/results/planner.json").read_text())["rows"]
    checked = {"grouped": 0, "per-expert": 0}
    for r in rows:
        m = re.fullmatch(r"recompute=(\w+),N=(\d+),H=(\d+),E=(\d+),k=(\d+),F=(\d+),ep=1,(\w+)(,fused_act)?", r["case"])
        if r["extra"].get("term") != "dispatch" or not m:
            continue
        regime, prec, fused = m.group(1), m.group(7), bool(m.group(8))
        T, H, E, k, F = (int(m.group(i)) for i in range(2, 7))
        shape = moe_layer_shape(H, E, k, F)
        pf = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=r["extra"]["chunk_cap"]))
        run = RunConfig(seq_len=T, precision=prec, recompute=regime, activation_fusion=fused)
        planned = plan(shape, run, pf).stages[0].rows
        held = planned["sco"].baseline if regime == "full" else 0.0
        router = T * E * 9  # the router's [T, E] tensors, which the measurement holds (the plan's layer row)
        ratio = (planned["dispatch"].peakflat + held + router) / GIB / r["peak_gib"]
        path = r["extra"]["experts_path"]
        low, high = (0.98, 1.03) if path == "grouped" else (0.97, 1.20)
        assert low <= ratio <= high, (r["case"], ratio)
        checked[path] += 1
    assert checked["grouped"] >= 8 and checked["per-expert"] >= 16


def test_dispatch_baseline_matches_h200_anchor():
    """An H200 anchor that no results file of this repository holds (it stands here as a number):
    the MoE layer alone under Megatron's alltoall, EP=1, H=4096, 64 experts top-8, F=1536 -> 5.1 / 10.3 / 20.6 GiB.
    (bench/dispatch.py's megatron-alltoall rows, 6.1 / 12.3 / 24.6 GiB, are the whole transformer layer.)"""
    shape = ModelShape(name="anchor", hidden=4096, layers=1, heads=32, kv_heads=32, head_dim=128, ffn=1536,
                       vocab=1024, experts=64, topk=8, moe_ffn=1536)
    for tokens, gib in ((16384, 5.1), (32768, 10.3), (65536, 20.6)):
        got = M.dispatch_working_set(shape, RunConfig(seq_len=tokens), M.routed_pairs(shape, RunConfig(seq_len=tokens)))
        assert abs(got / GIB - gib) / gib < 0.05, (tokens, got / GIB)


def test_dispatch_baseline_grows_by_the_receive_buffer_at_ep2():
    """bench/results/dispatch.json (H200s, the whole transformer layer under full recompute, balanced routing,
    64 experts top-8, F=1536): Megatron's alltoall peak at EP=2 less its peak at EP=1, against the planner's
    dispatch row at EP=2 less at EP=1 (the all-to-all's receive buffer), within 5%."""
    import json

    rows = json.loads((Path(__file__).resolve().parent.parent / "bench/results/dispatch.json").read_text())["rows"]
    peak = {r["case"]: r["peak_gib"] for r in rows if r["method"] == "megatron-alltoall"}
    checked = 0
    for tokens, hidden in ((16384, 4096), (32768, 4096), (32768, 7168), (65536, 4096), (65536, 7168)):
        case = f"recompute=full,N={tokens},H={hidden},ep={{}},skew=0%@4"
        measured = peak[case.format(2)] - peak[case.format(1)]
        shape = ModelShape(name="bench", hidden=hidden, layers=1, heads=hidden // 128, kv_heads=hidden // 128,
                           head_dim=128, ffn=4 * hidden, vocab=1024, experts=64, topk=8, moe_ffn=1536)
        ep1, ep2 = RunConfig(seq_len=tokens), RunConfig(seq_len=tokens, ep=2)
        predicted = (M.dispatch_working_set(shape, ep2, M.routed_pairs(shape, ep2))
                     - M.dispatch_working_set(shape, ep1, M.routed_pairs(shape, ep1))) / GIB
        assert abs(predicted - measured) / measured < 0.05, (tokens, hidden, predicted, measured)
        checked += 1
    assert checked == 5


def test_vocab_baseline_matches_h200_anchor():
    """N=32768, V=201088, H=7168: native 36.8 GiB, fused 61.4 GiB, as measured on one H200 (bench/results/vocab.json:
    36.82 and 61.37 GiB)."""
    shape = ModelShape(name="anchor", hidden=7168, layers=1, heads=56, kv_heads=8, head_dim=128, ffn=1,
                       vocab=201088)
    native = M.vocab_baseline(shape, RunConfig(seq_len=32768))
    fused = M.vocab_baseline(shape, RunConfig(seq_len=32768, cross_entropy_fusion=True))
    assert abs(native / GIB - 36.8) / 36.8 < 0.05
    assert abs(fused / GIB - 61.4) / 61.4 < 0.05
    # Ring-DTP at P=1, bf16 dX accumulation, plain-PyTorch kernel: 3 fp32 blocks + dW + dX, the
    # gradient floor (dW + dX in bf16: 2.68 + 0.44 = 3.12 GiB) plus the blocks; the automatic block is 128 MiB / (32768 x 2 B)
    # = 2048 rows.
    # (main_grad=False: dW is returned, as in the benchmark, which gives the weight no main_grad.)
    pf = PeakflatConfig()
    pf.vocab = dataclasses.replace(pf.vocab, block_size=8192, accumulate="input", kernel="torch")
    ring = M.vocab_ring_dtp(shape, RunConfig(seq_len=32768), pf, main_grad=False)
    assert ring == pytest.approx(3 * 32768 * 8192 * 4 + 201088 * 7168 * 2 + 32768 * 7168 * 2)
    # Default (Triton on CUDA, fp32 dX accumulator): dW + fp32 dX + max(one bf16 block, the bf16 dX cast),
    # which is the 3.9991 GiB measured on the H200 (bench/results/vocab.json) to 0.1%.
    default = M.vocab_ring_dtp(shape, RunConfig(seq_len=32768), PeakflatConfig(), main_grad=False)
    assert default == 201088 * 7168 * 2 + 32768 * 7168 * 4 + max(32768 * 2048 * 2, 32768 * 7168 * 2)
    assert abs(default / GIB - 3.9991) / 3.9991 < 0.001
    # In training (dW into DDP's main_grad), recomputed: the blocks without dW (autograd's placeholder is
    # main_grad's storage).
    pf = PeakflatConfig()
    pf.vocab = dataclasses.replace(pf.vocab, grad="recompute")
    untied = M.vocab_ring_dtp(shape, RunConfig(seq_len=32768), pf)
    assert untied == 32768 * 7168 * 4 + max(32768 * 2048 * 2, 32768 * 7168 * 2)
    # In training by default: in-forward, dX and one automatic chunk (4096 tokens: 1/8 of them), which is the
    # 1.9727 GiB measured on the H200 (bench/results/vocab.json, peakflat-fwd-main-grad, tp=1) to 0.1%.
    in_fwd = M.vocab_ring_dtp(shape, RunConfig(seq_len=32768), PeakflatConfig())
    assert in_fwd == 32768 * 7168 * 2 + 4096 * 201088 * 2
    assert abs(in_fwd / GIB - 1.9727) / 1.9727 < 0.001
    assert M.vocab_block(32768, 2, 0) == 2048 and M.vocab_block(10**7, 2, 0) == 256
    assert abs((201088 * 7168 * 2 + 32768 * 7168 * 2) / GIB - 3.12) < 0.02


def test_vocab_baseline_splits_the_vocabulary_over_tp():
    """Megatron's output layer gathers the whole sequence and writes [T, V/tp] logits: at TP=2 a rank holds all
    T tokens' logits and fp32 softmax (w + 4 = 6 B per element in bf16) for half the vocabulary."""
    shape = ModelShape(name="anchor", hidden=7168, layers=1, heads=56, kv_heads=8, head_dim=128, ffn=1,
                       vocab=201088)
    assert M.vocab_baseline(shape, RunConfig(seq_len=32768, tp=2)) == 32768 * 201088 // 2 * 6


@pytest.mark.parametrize("seq", [32768, 131072])
def test_attention_backward_against_the_h200_measurement(seq):
    """torch SDPA's causal backward on one H200 (docs/evidence/probes/attention_backward_peak.txt, 32 heads of 128):
    dq, dk, dv and flash's fp32 dQ accumulator came to 5.02 units of [s, hidden] bf16 beside the inputs, and
    13.02 under deterministic algorithms (ceil(132 SMs / 32 heads) = 5 accumulators). The planner's transient
    adds dO and the rotated q and k (3 units) to those, so it is 8 and 16 units."""
    shape = ModelShape(name="h200", hidden=4096, layers=1, heads=32, kv_heads=32, head_dim=128, ffn=16384, vocab=1024)
    unit = seq * 4096 * 2
    run = RunConfig(seq_len=seq, transformer_impl="local")  # torch's SDPA, as measured
    assert M.flash_dq_splits(shape, run) == 1
    assert M.attention_backward_transient(shape, run) == pytest.approx((5 + 3) * unit)
    det = replace(run, deterministic=True)
    assert M.flash_dq_splits(shape, det) == 5
    assert M.attention_backward_transient(shape, det) == pytest.approx((13 + 3) * unit)
    assert M.flash_dq_splits(shape, replace(det, micro_batch=8)) == 1  # 8 x 32 programs cover 132 SMs
    assert M.flash_dq_splits(shape, replace(det, tp=4)) == 17  # 8 heads per rank
    # cuDNN's deterministic backward (TE's layers) keeps dP in its workspace and no fp32 dQ accumulator:
    # docs/evidence/gpu_tile_te_h100.txt, 16.197 GiB beyond the inputs at 16K = 16 GiB of dP plus dQ, dK, dV and
    # the expanded dK/dV, where the non-deterministic backward adds its accumulator to those
    te = replace(det, transformer_impl="transformer_engine")
    assert M.attention_backward_transient(shape, te) == pytest.approx((3 + 3) * unit)


def test_layer_backward_meets_attention_or_moe_never_both():
    """The recomputed layer's saved tensors are alive through its backward; attention's backward and the
    MoE's (the dispatch) come one after the other, so the larger of the two counts, not their sum."""
    run = RunConfig(seq_len=131072, recompute="full")
    st = plan(PRESETS["gpt-oss-20b"], run).stages[0]
    per = st._phases("baseline")
    assert st.rows["dispatch"].phase == "moe" and st.rows["tile"].phase == "attention"
    assert st.training("baseline") == pytest.approx(
        per["persistent"] + max(per["layer"] + max(per["attention"], per["moe"]), per["loss"]))
    assert per["attention"] > 0 and per["moe"] > 0


def test_layer_saved_tensors_count_beside_attention_backward():
    """Where attention's backward alone is below the loss but the recomputed layer's saved tensors with it are
    above, the training peak is persistent + layer + attention, not the loss and not attention alone."""
    shape = ModelShape(name="dense", hidden=64, layers=2, heads=4, kv_heads=4, head_dim=16, ffn=128, vocab=256)
    st = plan(shape, RunConfig(seq_len=1024, recompute="full")).stages[0]
    per = st._phases("baseline")
    assert per["attention"] < per["loss"] < per["layer"] + per["attention"]
    assert st.live_phases("baseline") == {"persistent", "layer", "attention"}
    assert st.training("baseline") == pytest.approx(per["persistent"] + per["layer"] + per["attention"])


def test_total_is_persistent_plus_max_phase():
    pl = plan(PRESETS["gpt-oss-120b"], RunConfig(seq_len=1048576, ep=16, cp=8, dp=2))
    st = pl.stages[0]
    pers = sum(r.baseline for r in st.rows.values() if r.phase == "persistent")
    layer = sum(r.baseline for r in st.rows.values() if r.phase == "layer")
    inner = max(sum(r.baseline for r in st.rows.values() if r.phase == p) for p in ("attention", "moe"))
    loss = sum(r.baseline for r in st.rows.values() if r.phase == "loss")
    assert st.training("baseline") == pytest.approx(pers + max(layer + inner, loss))
    assert st.total("baseline") == pytest.approx(max(st.phase_totals("baseline").values()))
    assert st.binding("baseline") == "vocab"  # T x V x 6 B dominates at 131K tokens per rank


def test_pipeline_stages_split_layers_and_inflight():
    """DeepSeek-V3's 61 layers over PP=4 with 16 on the last stage (--decoder-last-pipeline-num-layers): the first
    stage's 3 leading dense layers leave it 12 MoE layers, so the second stage (15 MoE, 3 micro-batches in
    flight) is planned too; the third (15 MoE, 2 in flight) is bounded by it."""
    s = PRESETS["deepseek-v3"]
    pl = plan(s, RunConfig(seq_len=4096, pp=4, ep=8, dp=8, last_stage_layers=16))
    assert [(st.stage, st.layers, st.moe_layers, st.inflight) for st in pl.stages] == [
        ("first", 15, 12, 4), ("middle 1", 15, 15, 3), ("last", 16, 16, 1)]
    assert pl.stage_of == ("first", "middle 1", "middle 1", "last")
    first, mid, last = pl.stages
    assert "vocab" in last.rows and "vocab" not in first.rows and "vocab" not in mid.rows
    assert mid.rows["parameters"].baseline > first.rows["parameters"].baseline - s.vocab * s.hidden * 2


@pytest.mark.parametrize("kw, split", [
    ({}, (6, 6, 6, 6)),
    ({"first_stage_layers": 3}, (3, 7, 7, 7)),
    ({"last_stage_layers": 0, "first_stage_layers": 6}, (6, 9, 9, 0)),
    ({"embedding_in_split": True, "loss_in_split": True, "layers": 22}, (5, 6, 6, 5)),
    ({"embedding_in_split": True, "layers": 23}, (5, 6, 6, 6)),
    ({"stage_layout": (5, 7, 7, 5)}, (5, 7, 7, 5)),
    ({"stage_layout": (2, 3, 3, 3, 4, 3, 3, 3)}, (6, 6, 6, 6)),  # two virtual stages per rank, summed
])
def test_pipeline_split_follows_megatron(kw, split):
    """Each pipeline rank builds the layers Megatron's get_num_layers_to_build gives it: an even split, the uneven
    first/last stages with the rest even, the embedding and loss counted as layers, or the layout's stages."""
    kw = dict(kw)
    layers = kw.pop("layers", 24)
    assert M.pipeline_split(layers, RunConfig(seq_len=4096, pp=4, **kw)) == split


@pytest.mark.parametrize("layers, kw, flag", [
    (25, {}, "--pipeline-model-parallel-size"),
    (24, {"embedding_in_split": True}, "--pipeline-model-parallel-size"),
    (24, {"first_stage_layers": 5}, "--decoder-first-pipeline-num-layers"),
    (24, {"last_stage_layers": 30}, "--decoder-last-pipeline-num-layers"),
    (24, {"first_stage_layers": 6, "loss_in_split": True}, "--decoder-first-pipeline-num-layers"),
    (24, {"stage_layout": (6, 6, 6)}, "--pipeline-model-parallel-layout"),
    (24, {"stage_layout": (6, 6, 6, 5)}, "--pipeline-model-parallel-layout"),
])
def test_a_pipeline_split_megatron_refuses_is_refused_naming_the_flag(layers, kw, flag):
    from megatron_peakflat.config_base import PeakflatConfigError

    with pytest.raises(PeakflatConfigError, match=flag):
        M.pipeline_split(layers, RunConfig(seq_len=4096, pp=4, **kw))


def test_layout_string_is_read_as_megatron_reads_it():
    from megatron_peakflat.planner.megatron_args import layout_stage_layers, parse_megatron_args, run_fields_from_namespace

    assert layout_stage_layers("Ettt|(tt|)*3,m|L") == (3, 2, 2, 2, 0, 0)
    assert layout_stage_layers("Et*3|t*4|tttL") == (3, 4, 3)
    ns, ignored = parse_megatron_args("--pipeline-model-parallel-layout 'E(t|)*4L' --decoder-last-pipeline-num-layers 3 "
                                      "--account-for-loss-in-pipeline-split --make-vocab-size-divisible-by 64")
    fields = run_fields_from_namespace(ns)
    assert not ignored
    assert fields["stage_layout"] == (1, 1, 1, 1, 0) and fields["last_stage_layers"] == 3
    assert fields["loss_in_split"] is True and fields["vocab_divisible_by"] == 64


@pytest.mark.parametrize("vocab, tp, divisible_by, padded", [
    (201088, 1, 128, 201088), (201088, 8, 128, 201728), (50257, 1, 128, 50304), (50257, 2, 64, 50304),
    (1000, 4, 1, 1000),
])
def test_the_vocabulary_is_padded_as_megatron_pads_it(vocab, tp, divisible_by, padded):
    """Megatron builds the output layer with the vocabulary padded to a multiple of --make-vocab-size-divisible-by
    x TP; the plan's vocabulary rows count that size, and a note on the last stage says so."""
    run = RunConfig(seq_len=4096, tp=tp, vocab_divisible_by=divisible_by)
    assert M.padded_vocab(vocab, run) == padded
    assert M.padded_vocab(padded, run) == padded
    shape = TINY.with_(vocab=vocab, heads=8, kv_heads=8)
    pl = plan(shape, run)
    assert pl.shape.vocab == padded
    noted = any("vocabulary padded" in n for n in pl.stages[-1].notes)
    assert noted == (padded != vocab)


def test_a_middle_stage_with_more_moe_layers_than_either_end_is_planned():
    """A MoE pattern that puts MoE layers in the middle of the model (dense at both ends) gives the middle
    pipeline stages more expert parameters than the first or last: the plan holds the heaviest of them, and
    a uniform pattern adds none."""
    base = PRESETS["gpt-oss-20b"]
    middle_heavy = tuple([False] * 6 + [True] * 12 + [False] * 6)
    s = base.with_(layers=24, moe_pattern=middle_heavy, dense_layers=12)
    pl = plan(s, RunConfig(seq_len=4096, pp=4, ep=1, dp=1))
    assert [(st.stage, st.layers, st.moe_layers) for st in pl.stages] == [
        ("first", 6, 0), ("middle 1", 6, 6), ("last", 6, 0)]
    mid = pl.stages[1]
    assert mid.inflight == 3 and "vocab" not in mid.rows
    assert mid.total("baseline") > pl.stages[0].total("baseline")
    uniform = plan(base.with_(layers=24, moe_pattern=(True,) * 24, dense_layers=0), RunConfig(seq_len=4096, pp=4))
    assert [st.stage for st in uniform.stages] == ["first", "last"]


def test_pipeline_inflight_is_capped_by_the_micro_batches():
    """1F1B keeps at most the step's micro-batches in flight: PP=4 with a global batch of 2 (DP 1, micro-batch
    1) holds 2 on the first stage, not PP=4, and its checkpoint boundaries count 2 micro-batches."""
    run = RunConfig(seq_len=4096, pp=4, global_batch=2, dp=1, micro_batch=1, recompute="full")
    first, last = plan(TINY, run).stages[0], plan(TINY, run).stages[-1]
    assert run.num_micro == 2 and first.layers == 1
    assert first.inflight == 2 and last.inflight == 1
    assert first.rows["sco"].baseline == pytest.approx(2 * 4096 * 64 * 2)


def test_last_stage_holds_its_copy_of_tied_embeddings():
    """With PP > 1 and tied embeddings the last stage keeps its own copy of the word embeddings as the output
    layer (V x H / tp, beside the final norm's H); the first stage holds the embedding."""
    tied = ModelShape(name="tied", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=1024,
                      tied_embeddings=True)
    first, last = plan(tied, RunConfig(seq_len=128, tp=2, pp=2)).stages
    attn = (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64) / 2 + 2 * 64
    mlp = 3 * 64 * 128 / 2
    vocab = 1024 * 64 / 2
    assert last.rows["parameters"].baseline == pytest.approx((attn + mlp + vocab + 64) * 2)
    assert first.rows["parameters"].baseline == pytest.approx((vocab + attn + mlp) * 2)
    (whole,) = plan(tied, RunConfig(seq_len=128, tp=2)).stages  # one stage: one copy, and the final norm
    assert whole.rows["parameters"].baseline == pytest.approx((vocab + 2 * (attn + mlp) + 64) * 2)


def test_attention_activations_by_hand():
    """One attention block's saved tensors at TP=2 with SP, bf16, 128 tokens (r = 64 rows per rank): the norm's
    input and output (r x H x 2w) and its fp32 rstd (r x 4), this rank's q, k, v and output, and the fp32
    logsumexp of its heads."""
    run = RunConfig(seq_len=128, tp=2)
    norm = 64 * 64 * 2 * 2 + 64 * 4
    qkvo = 128 / 2 * ((4 + 2 * 2) * 16 + 4 * 16) * 2
    lse = 128 / 2 * 4 * 4
    assert M.attention_activations(TINY, run) == norm + qkvo + lse == 42240


# ---- LiveBytesMeter on CPU ------------------------------------------------------------------

SMALL = ModelShape(name="small", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=512,
                   experts=4, topk=2, moe_ffn=48, dense_layers=1)


class _Layer(nn.Module):
    """The weights the planner counts for one layer of SMALL (Megatron local spec shapes)."""

    def __init__(self, s: ModelShape, moe: bool) -> None:
        super().__init__()
        h = s.hidden
        self.ln1, self.ln2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.proj = nn.Linear(s.heads * s.head_dim, h, bias=False)
        if moe:
            self.router = nn.Linear(h, s.experts, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * s.moe_ffn, bias=False),
                                                       nn.Linear(s.moe_ffn, h, bias=False)) for _ in range(s.experts))
        else:
            self.fc1, self.fc2 = nn.Linear(h, 2 * s.ffn, bias=False), nn.Linear(s.ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, x.shape[-1:], self.ln1)
        q = self.qkv(y)[..., : self.proj.in_features]
        x = x + self.proj(q)
        y = F.rms_norm(x, x.shape[-1:], self.ln2)
        if hasattr(self, "router"):
            out = 0
            for i, e in enumerate(self.experts):
                a, b = e[0](y).chunk(2, -1)
                out = out + e[1](F.silu(a) * b) * torch.softmax(self.router(y), -1)[..., i:i + 1]
            return x + out
        a, b = self.fc1(y).chunk(2, -1)
        return x + self.fc2(F.silu(a) * b)


class _Model(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.emb = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(_Layer(s, i >= s.dense_layers) for i in range(s.layers))
        self.out = nn.Linear(s.hidden, s.vocab, bias=False)
        self.ln = nn.Parameter(torch.ones(s.hidden))


def test_params_grads_optimizer_state_against_live_bytes():
    run = RunConfig(seq_len=32, precision="fp32", distributed_optimizer=False)
    with LiveBytesMeter() as m:
        model = _Model(SMALL)
        after_params = m.live
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        after_grads = m.live
        opt = torch.optim.Adam(model.parameters(), foreach=False)
        opt.step()
        after_opt = m.live
    row = plan(SMALL, run).stages[0].rows
    n = sum(p.numel() for p in model.parameters())
    assert n == pytest.approx(sum(M.stage_params(SMALL, run, 1, 2, True, True)))  # exact count
    assert abs(after_params - row["parameters"].baseline) / row["parameters"].baseline < 0.10
    assert abs((after_grads - after_params) - row["gradients"].baseline) / row["gradients"].baseline < 0.10
    # fp32 params: Adam keeps exp_avg + exp_avg_sq (8 B/param), no separate master copy.
    assert abs((after_opt - after_grads) - row["optimizer"].baseline) / row["optimizer"].baseline < 0.10


def test_checkpoint_boundaries_against_live_bytes():
    """Full recompute of every layer: only each layer's input survives the forward."""
    from torch.utils.checkpoint import checkpoint

    s, b, h, L = 256, 2, 64, 6
    shape = ModelShape(name="ckpt", hidden=h, layers=L, heads=4, kv_heads=4, head_dim=16, ffn=4 * h, vocab=128,
                       gated=False)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)) for _ in range(L))
    x = torch.randn(s, b, h, requires_grad=True)
    with LiveBytesMeter() as m:
        y = x
        for blk in blocks:
            y = checkpoint(blk, y, use_reentrant=False)
        live_after_forward = m.live
        y.sum().backward()
    run = RunConfig(seq_len=s, micro_batch=b, precision="fp32", recompute="full")
    predicted = plan(shape, run).stages[0].rows["sco"].baseline
    assert abs(live_after_forward - predicted) / predicted < 0.10, (live_after_forward, predicted)
    # Without recompute the same blocks keep far more: the model says so too.
    assert plan(shape, dataclasses.replace(run, recompute="none")).stages[0].rows["activations"].baseline > 2 * predicted


def test_native_cross_entropy_against_live_bytes():
    """Logits + the saved softmax: T x V x (w + 4) bytes; fp32 torch logits + log_softmax = 8 B/elem."""
    n, h, v = 512, 32, 4096
    shape = ModelShape(name="ce", hidden=h, layers=1, heads=2, kv_heads=2, head_dim=16, ffn=h, vocab=v)
    hidden = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    with LiveBytesMeter() as m:
        loss = F.cross_entropy(hidden @ w.t(), labels)
        forward_peak = m.peak  # logits and their log-softmax are alive together
        loss.backward()
    predicted = M.vocab_baseline(shape, RunConfig(seq_len=n, precision="fp32"))
    assert abs(forward_peak - predicted) / predicted < 0.10, (forward_peak, predicted)


def test_ring_dtp_single_rank_within_bound():
    from megatron_peakflat.vocab import api
    n, h, v, block = 1024, 64, 8192, 512
    # dW returned (no main_grad here): the planner's standalone case (main_grad=False)
    shape = ModelShape(name="ce", hidden=h, layers=1, heads=2, kv_heads=2, head_dim=32, ffn=h, vocab=v)
    hidden = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    pf = PeakflatConfig()
    pf.vocab = dataclasses.replace(pf.vocab, block_size=block, kernel="torch")
    with LiveBytesMeter() as m:
        loss = api.ring_linear_cross_entropy(hidden, w, labels, block_size=block, kernel="torch", reduction="sum")
        loss.backward()
    bound = M.vocab_ring_dtp(shape, RunConfig(seq_len=n, precision="fp32"), pf, main_grad=False)
    baseline = M.vocab_baseline(shape, RunConfig(seq_len=n, precision="fp32"))
    assert abs(m.peak - bound) / bound < 0.10, (m.peak, bound)
    assert m.peak < baseline / 2  # and far under the logits it never builds
    # The bound follows the vocabulary: double it and the prediction still holds (tokens growing: test_vocab.py).
    w2 = torch.randn(2 * v, h, requires_grad=True)
    with LiveBytesMeter() as m2:
        api.ring_linear_cross_entropy(hidden, w2, labels, block_size=block, kernel="torch", reduction="sum").backward()
    bound2 = M.vocab_ring_dtp(dataclasses.replace(shape, vocab=2 * v), RunConfig(seq_len=n, precision="fp32"), pf,
                              main_grad=False)
    assert abs(m2.peak - bound2) / bound2 < 0.10, (m2.peak, bound2)
    # With Megatron DDP's main_grad (allocated before, as DDP's buffer is): dW goes there.
    w3 = torch.randn(v, h, requires_grad=True)
    w3.main_grad, w3.grad_added_to_main_grad = torch.zeros(v, h), False
    with LiveBytesMeter() as m3:
        api.ring_linear_cross_entropy(hidden, w3, labels, block_size=block, kernel="torch", reduction="sum",
                                      dw_into_main_grad=True).backward()
    recompute = dataclasses.replace(pf, vocab=dataclasses.replace(pf.vocab, grad="recompute"))
    untied = M.vocab_ring_dtp(shape, RunConfig(seq_len=n, precision="fp32"), recompute)
    assert w3.grad_added_to_main_grad and abs(m3.peak - untied) / untied < 0.10, (m3.peak, untied)
    assert untied < bound  # no dW of its own during the blocks
    # With main_grad, gradients computed with the loss (the default there): dX and one [chunk, V] block.
    in_fwd = dataclasses.replace(pf, vocab=dataclasses.replace(pf.vocab, chunk_tokens=128))
    w3.main_grad.zero_()
    with LiveBytesMeter() as m4:
        api.ring_linear_cross_entropy(hidden, w3, labels, kernel="torch", reduction="sum", dw_into_main_grad=True,
                                      grad="in-forward", chunk_tokens=128).backward()
    predicted = M.vocab_ring_dtp(shape, RunConfig(seq_len=n, precision="fp32"), in_fwd)
    assert abs(m4.peak - predicted) / predicted < 0.10, (m4.peak, predicted)


# ---- no torch on the planner path -----------------------------------------------------------

def test_planner_modules_do_not_import_torch_at_top_level():
    root = Path(__file__).resolve().parents[1] / "megatron_peakflat"
    for rel in ("planner/model.py", "planner/shapes.py", "planner/recommend.py", "planner/megatron_args.py",
                "planner/build.py", "planner/report.py", "cli/plan.py", "runtime/meter.py", "runtime/machine.py",
                "plan.py", "dispatch/bound.py", "vocab/sizes.py"):
        tree = ast.parse((root / rel).read_text())
        for node in tree.body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "torch" for n in names), f"{rel} imports torch at top level"


def test_ring_dtp_tp2_prediction_against_the_committed_h200_rows():
    """The planner's Ring-DTP term on a ring (TP=2, SP) against the rows measured on 2 H200s
    (bench/results/vocab.json, N=32768, H=7168): standalone (dW returned), dW into DDP's main_grad
    (recomputed or computed with the loss) and accumulate=input, each within 10%."""
    import json
    from pathlib import Path

    from megatron_peakflat.vocab.config import VocabConfig

    rows = {r["method"]: r for r in json.loads((Path(__file__).resolve().parents[1] / "bench/results/vocab.json")
                                               .read_text())["rows"] if r["case"] == "N=32768,H=7168,V=201088,tp=2"}
    run = RunConfig(seq_len=32768, tp=2, sequence_parallel=True)
    for method, main_grad, accumulate, grad in (("peakflat", False, "fp32", "auto"),
                                                ("peakflat-main-grad", True, "fp32", "recompute"),
                                                ("peakflat-fwd-main-grad", True, "fp32", "auto"),
                                                ("peakflat-input", False, "input", "auto")):
        s = ModelShape(name="v", hidden=7168, layers=1, heads=56, kv_heads=8, head_dim=128, ffn=1024, vocab=201088)
        vc = VocabConfig(impl="ring-dtp", accumulate=accumulate, grad=grad)
        got = M.vocab_ring_dtp(s, run, PeakflatConfig(vocab=vc), main_grad=main_grad)
        measured = rows[method]["peak_gib"] * 2**30
        assert abs(got - measured) / measured < 0.10, (method, got / 2**30, rows[method]["peak_gib"])
    # the in-forward default at N=16384, H=4096 (another chunk size: 1/8 of the tokens)
    small = {r["method"]: r for r in json.loads((Path(__file__).resolve().parents[1] / "bench/results/vocab.json")
                                                .read_text())["rows"] if r["case"] == "N=16384,H=4096,V=201088,tp=2"}
    s = ModelShape(name="v", hidden=4096, layers=1, heads=32, kv_heads=8, head_dim=128, ffn=1024, vocab=201088)
    got = M.vocab_ring_dtp(s, RunConfig(seq_len=16384, tp=2, sequence_parallel=True), PeakflatConfig())
    assert abs(got / 2**30 - small["peakflat-fwd-main-grad"]["peak_gib"]) / small["peakflat-fwd-main-grad"]["peak_gib"] < 0.05


def test_mtp_layers_sit_on_the_last_stage_with_their_losses():
    """--mtp-num-layers D: the last stage holds D more layers of the last decoder layer's kind, their eh_proj
    [H, 2H] and norms, and (untied, PP > 1) the word embeddings they read; Megatron's vocab row holds each MTP
    loss's saved fp32 softmax beside the main loss, while Ring-DTP's MTP losses keep O(T) state (its row is the
    larger of its two schedules' working sets)."""
    s = TINY.with_(tied_embeddings=False)
    run = RunConfig(seq_len=4096, pp=2, tp=1)
    base, mtp = plan(s, run), plan(s.with_(mtp_layers=2), run)
    assert [(st.layers, st.moe_layers) for st in base.stages] == [(2, 1), (2, 2)]
    assert [(st.layers, st.moe_layers) for st in mtp.stages] == [(2, 1), (4, 4)]
    assert mtp.stages[0].rows["parameters"].baseline == base.stages[0].rows["parameters"].baseline
    dense, expert = M.stage_params(s, run, 0, 2, False, True)
    dense2, expert2 = M.stage_params(s, run, 0, 4, True, True, mtp=2)
    assert expert2 == pytest.approx(2 * expert)
    assert dense2 - dense == pytest.approx(2 * (dense - s.hidden - s.vocab * s.hidden) / 2
                                           + 2 * (2 * s.hidden * s.hidden + 3 * s.hidden) + s.vocab * s.hidden)
    saved = 4096 * s.vocab * 4
    assert mtp.stages[1].rows["vocab"].baseline == pytest.approx(base.stages[1].rows["vocab"].baseline + 2 * saved)
    from megatron_peakflat.vocab.config import VocabConfig

    for grad in ("in-forward", "recompute"):
        pf = PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", grad=grad))
        rings = [M.vocab_ring_dtp(s, run, replace(pf, vocab=replace(pf.vocab, grad=g))) for g in ("in-forward", "recompute")]
        assert plan(s.with_(mtp_layers=2), run, pf).stages[1].rows["vocab"].peakflat == pytest.approx(max(rings))
        assert plan(s, run, pf).stages[1].rows["vocab"].peakflat == pytest.approx(M.vocab_ring_dtp(s, run, pf))
    assert any("2 MTP layer(s)" in n for n in mtp.stages[1].notes)
    lay = RunConfig(seq_len=4096, pp=2, stage_layout=(2, 2), stage_layout_mtp=(1, 0))
    assert M.mtp_split(s.with_(mtp_layers=1), lay) == (1, 0)


@pytest.mark.parametrize("shape_kw,run_kw", [
    ({}, {}),
    ({"mtp_layers": 1}, {}),
    ({"mtp_layers": 2, "tied_embeddings": False}, {"pp": 2}),
    ({"mtp_layers": 1}, {"pp": 2, "dp": 2, "ep": 2}),
    ({"mtp_layers": 1}, {"recompute": "selective", "recompute_modules": ("moe",)}),
])
def test_every_component_off_leaves_each_row_at_megatrons_value(shape_kw, run_kw):
    """With no component on, the peakflat column is Megatron's path, so every row of every stage equals its
    baseline, on the GPU and on the host. (The optimizer row computes its peakflat column apart, to count the
    output layer's EP shard: it once left out an MTP layer's eh_proj and a later stage's embeddings.)"""
    s = TINY.with_(**shape_kw)
    run = RunConfig(seq_len=4096, **run_kw)
    for st in plan(s, run, PeakflatConfig()).stages:
        for name, row in st.rows.items():
            assert row.peakflat == pytest.approx(row.baseline, rel=1e-12, abs=0), (st.stage, name)
            assert row.host_peakflat == pytest.approx(row.host_baseline, rel=1e-12, abs=0), (st.stage, name)


def test_embedding_gradient_row_follows_the_uses():
    """The word embeddings' gradient that autograd holds through the layers' backward (``embedding_grad_held``,
    checked against Megatron in test_planner_megatron.py): V/tp x H x w bytes, in the 'layer' phase, where the
    stage uses the embeddings twice with layers between; Ring-DTP's output layer returns no gradient for them."""
    from megatron_peakflat.vocab.config import VocabConfig

    ring = PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))
    run = RunConfig(seq_len=4096, tp=2)
    size = M.padded_vocab(TINY.vocab, run) / 2 * TINY.hidden * run.w

    def row(s: ModelShape, r: RunConfig, stage: int = 0) -> tuple[float, float] | None:
        got = plan(s, r, ring).stages[stage].rows.get("embedding gradient")
        assert got is None or got.phase == "layer"
        return None if got is None else (got.baseline, got.peakflat)

    assert row(TINY.with_(tied_embeddings=False), run) is None
    assert row(TINY.with_(tied_embeddings=True), run) == (size, 0.0)  # Megatron's tied output layer
    assert row(TINY.with_(tied_embeddings=False, mtp_layers=1), run) == (size, size)
    pp2 = RunConfig(seq_len=4096, tp=2, pp=2)
    assert row(TINY.with_(tied_embeddings=False, mtp_layers=1), pp2, -1) is None  # the last stage's copy: one use
    assert row(TINY.with_(tied_embeddings=True, mtp_layers=1), pp2, -1) == (size, 0.0)  # held through the MTP layer
    base = plan(TINY.with_(tied_embeddings=False, mtp_layers=1), run, ring).stages[0]
    layer = base._phases("baseline")["layer"]
    held = base.rows["dispatcher probs"].baseline
    assert layer == pytest.approx(base.rows["layer working set"].baseline + size + held)


@pytest.mark.parametrize("heads, units", [(8, 37), (16, 21), (32, 13), (64, 9)])
def test_flash_dq_accumulators_follow_the_head_count(heads, units):
    """Under deterministic algorithms flash's backward keeps ceil(132 SMs / heads) fp32 dQ accumulators: measured
    on one H200 at 32K tokens, 37.02 / 21.02 / 13.02 / 9.02 units of [s, hidden] bf16 for 8 / 16 / 32 / 64 heads of
    128 (docs/evidence/probes/attention_backward_heads.txt and probes/attention_backward_peak.txt), which is dq, dk, dv (3)
    plus 2 units per accumulator; without them, 5.02 at every head count. The planner adds dO and the rotated
    q and k (3 units)."""
    shape = ModelShape(name="h", hidden=heads * 128, layers=1, heads=heads, kv_heads=heads, head_dim=128, ffn=1,
                       vocab=1024)
    run = RunConfig(seq_len=32768, deterministic=True, transformer_impl="local")  # torch's SDPA, as measured
    assert 3 + 2 * M.flash_dq_splits(shape, run) == units
    unit = 32768 * heads * 128 * 2
    assert M.attention_backward_transient(shape, run) == pytest.approx((units + 3) * unit)
    assert M.attention_backward_transient(shape, replace(run, deterministic=False)) == pytest.approx((5 + 3) * unit)


def test_dispatcher_probs_rows_count_what_megatron_keeps_and_peakflat_drops():
    """TINY's layers are dense, MoE, MoE, MoE; under full recompute Megatron's dispatcher keeps the three MoE
    checkpoints' inputs (counted by the boundaries row already) and two of their gradients at layer 0's backward,
    and all six through the step (``dispatcher_held``, checked against Megatron in test_planner_megatron.py).
    Any peakflat component brings moe-release, which drops them; with none on, the column stays Megatron's."""
    from megatron_peakflat.vocab.config import VocabConfig

    run = RunConfig(seq_len=4096)
    boundary = run.layer_rows * TINY.hidden * run.w
    assert M.dispatcher_held(TINY.layer_is_moe, (), run) == (3, 2, 6)
    on = plan(TINY, run, PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))).stages[0].rows
    off = plan(TINY, run, PeakflatConfig()).stages[0].rows
    for name, count, phase in (("dispatcher probs", 2, "layer"), ("probs at step", 6, "step")):
        assert (on[name].baseline, on[name].peakflat, on[name].phase) == (count * boundary, 0.0, phase)
        assert off[name].peakflat == off[name].baseline == count * boundary
    state = on["dispatcher state"]
    assert (state.baseline, state.peakflat, state.phase) == (3 * M.dispatcher_state(TINY, run), 0.0, "persistent")
    assert off["dispatcher state"].peakflat == state.baseline > 0
    # an MTP layer's second input is beyond the boundaries row's one per checkpoint
    mtp = plan(TINY.with_(mtp_layers=1), run, PeakflatConfig()).stages[0].rows["dispatcher probs"]
    assert M.dispatcher_held(TINY.layer_is_moe, (True,), run) == (5, 4, 10)
    assert mtp.baseline == (4 + 1) * boundary
    for other in (replace(run, recompute="selective"), replace(run, recompute="none")):
        assert "dispatcher probs" not in plan(TINY, other, PeakflatConfig()).stages[0].rows


def test_selective_moe_recompute_moves_the_dispatch_into_the_moe_phase():
    """``--recompute-granularity selective --recompute-modules moe``: Megatron's MoE layers keep only their input, so
    the dispatch row is one layer's working set in the MoE's backward (as under full recompute), not every layer's
    saved tensors; its dispatcher keeps one input and its gradient per MoE layer through the step. ``moe_act``
    saves each expert's activation output no more. A module the planner does not model is named in a note."""
    none = replace(RunConfig(seq_len=4096), recompute="selective")
    moe = replace(none, recompute_modules=("moe",))
    act = replace(none, recompute_modules=("moe_act",))
    boundary = none.layer_rows * TINY.hidden * none.w
    p_none, p_moe, p_act = (plan(TINY, r, PeakflatConfig()).stages[0].rows for r in (none, moe, act))
    pairs = M.routed_pairs(TINY, none)
    assert p_moe["dispatch"].phase == "moe" and p_none["dispatch"].phase == "persistent"
    assert p_moe["dispatch"].baseline == M.dispatch_working_set(TINY, moe, pairs) < p_none["dispatch"].baseline
    assert p_none["dispatch"].baseline - p_act["dispatch"].baseline == pytest.approx(
        (TINY.moe_layers - 1) * pairs * TINY.moe_ffn * none.w)
    assert p_moe["activations"].baseline < p_none["activations"].baseline
    assert p_moe["probs at step"].baseline == 2 * TINY.moe_layers * boundary
    assert "probs at step" not in p_none and "dispatcher probs" not in p_moe
    noted = plan(TINY, replace(none, recompute_modules=("moe", "layernorm")), PeakflatConfig()).stages[0].notes
    assert any("--recompute-modules layernorm: not modelled" in n for n in noted), noted


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_without_full_recompute_no_layer_is_counted_twice(recompute):
    """Every layer keeps its saved tensors in the 'activations' row; no 'layer working set' adds one of them again,
    as it does under full recompute, where one checkpointed layer is re-materialised at a time."""
    s = ModelShape(name="dense", hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, ffn=1536, vocab=32000,
                   experts=0, topk=1, moe_ffn=0)
    rows = plan(s, RunConfig(seq_len=4096, recompute=recompute), PeakflatConfig()).stages[0].rows
    assert rows["layer working set"].baseline == 0 and rows["activations"].baseline > 0
    full = plan(s, RunConfig(seq_len=4096, recompute="full"), PeakflatConfig()).stages[0].rows
    assert full["layer working set"].baseline > 0 and full["activations"].baseline == 0
    one_layer = rows["activations"].baseline / s.layers
    assert full["layer working set"].baseline == pytest.approx(one_layer)  # the same layer, re-materialised
