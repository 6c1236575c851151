"""Transformer Engine's limits (planner/te_limits.py): the fused RoPE kernel's 32-bit offsets and the unfused
attention backend's s x s scores, each decision on CPU, and how the planner, ``--peakflat auto``, peakflat-check and
start-up act on them."""

from __future__ import annotations

import argparse

import pytest

from megatron_peakflat.cli import check
from megatron_peakflat.config_base import PeakflatConfigError
from megatron_peakflat.planner import te_limits
from megatron_peakflat.cli.plan import main as plan_main
from megatron_peakflat.planner.build import build
from megatron_peakflat.planner.model import GIB, plan

# gpt-oss-20b's attention: 64 heads, 8 kv heads of 64 -> (64 + 16) x 64 = 5120 elements a token
OSS20 = dict(heads=64, kv_heads=8, head_dim=64)
ROPE_LINE = ("--num-layers 2 --hidden-size 2880 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
             "--kv-channels 64 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 --ffn-hidden-size 2880 "
             "--vocab-size 32000 --bf16 --use-distributed-optimizer --micro-batch-size 1 "
             "--position-embedding-type rope --no-create-attention-mask-in-dataloader")


def ns(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**kw)


# ---- fused RoPE: the arithmetic -----------------------------------------------------------------

def test_the_fused_rope_limit_is_2_31_elements_of_the_key_view():
    assert te_limits.fused_rope_max_tokens(1, **OSS20, tp=1) == 419_430
    assert te_limits.fused_rope_fits(419_430, 1, **OSS20, tp=1)
    assert not te_limits.fused_rope_fits(419_431, 1, **OSS20, tp=1)
    assert te_limits.fused_rope_fits(384 * 1024, 1, **OSS20, tp=1)  # trained
    assert not te_limits.fused_rope_fits(448 * 1024, 1, **OSS20, tp=1)  # crashed in fused_rope.cu
    assert te_limits.fused_rope_fits(448 * 1024, 1, **OSS20, tp=2)  # TP divides the stride
    assert not te_limits.fused_rope_fits(256 * 1024, 2, **OSS20, tp=1)  # the micro-batch multiplies it


@pytest.mark.parametrize("flags, applies", [
    (dict(position_embedding_type="rope"), True),  # Megatron's default: fusion on, TE's layers
    (dict(position_embedding_type="rope", apply_rope_fusion=False), False),  # --no-rope-fusion
    (dict(use_rotary_position_embeddings=True), True),  # the legacy flag
    (dict(), False),  # learned_absolute, Megatron's default position embedding: no RoPE
    (dict(position_embedding_type="yarn"), False),  # validate_args turns fusion off for every type but rope
    (dict(position_embedding_type="rope", transformer_impl="local"), False),
    (dict(position_embedding_type="rope", multi_latent_attention=True), False),
])
def test_which_lines_run_the_fused_rope_kernel(flags, applies):
    assert te_limits.rope_fusion_applies(ns(**flags)) is applies


def test_a_preset_is_a_rope_model_unless_its_flags_say_otherwise():
    assert te_limits.rope_fusion_applies(ns(), preset=True)
    assert not te_limits.rope_fusion_applies(ns(apply_rope_fusion=False), preset=True)


def test_the_tile_length_is_what_the_kernel_sees_where_the_tiled_layer_is_on():
    line = ns(position_embedding_type="rope")
    kw = dict(seq_len=448 * 1024, cp=1, micro_batch=1, **OSS20, tp=1)
    assert te_limits.fused_rope_refusal(line, **kw) is not None
    tiled = ns(position_embedding_type="rope", peakflat_tile_enabled=True, peakflat_tile_tokens=65536)
    assert te_limits.rope_kernel_tokens(448 * 1024, 1, tiled) == 65536
    assert te_limits.fused_rope_refusal(tiled, **kw) is None
    assert te_limits.fused_rope_refusal(line, **{**kw, "cp": 2}) is None  # seq / CP
    auto = ns(position_embedding_type="rope", peakflat_tile_enabled=True, peakflat_tile_tokens=None)
    assert te_limits.rope_kernel_tokens(1 << 20, 1, auto) == 16384  # --peakflat-tile-tokens auto at 1M
    assert te_limits.fused_rope_refusal(auto, **{**kw, "seq_len": 1 << 20}) is None


def test_the_refusal_names_the_kernel_the_limit_and_the_fix():
    e = te_limits.fused_rope_refusal(ns(position_embedding_type="rope"), seq_len=448 * 1024, cp=1, micro_batch=1,
                                     **OSS20, tp=1)
    assert isinstance(e, PeakflatConfigError)
    assert "fused_rope_forward_kernel" in e.problem and "2**31 - 1" in e.problem and "419,430 tokens" in e.problem
    assert e.fix.startswith("add --no-rope-fusion")


# ---- fused RoPE: planner, auto, check -----------------------------------------------------------

def test_the_planner_refuses_a_line_past_the_limit_and_takes_it_with_no_rope_fusion(capsys):
    argv = ["--megatron-args", ROPE_LINE, "--gpus", "1", "--hbm-gib", "141", "--host-gib", "2048"]
    assert plan_main([*argv, "--seq-len", "448K"]) == 2
    captured = capsys.readouterr()
    assert "fused_rope_forward_kernel" in captured.err and "--no-rope-fusion" in captured.err
    assert "fits" not in captured.out
    argv_off = ["--megatron-args", ROPE_LINE + " --no-rope-fusion", *argv[2:]]
    assert plan_main([*argv_off, "--seq-len", "448K"]) != 2
    assert plan_main([*argv, "--seq-len", "384K"]) != 2
    assert "fused_rope_forward_kernel" not in capsys.readouterr().err


def test_a_preset_past_the_limit_is_recommended_no_rope_fusion(capsys):
    from megatron_peakflat.planner.recommend import recommend

    shape, run, pf, ns_, _ = build(["--preset", "gpt-oss-20b", "--seq-len", "448K", "--gpus", "8", "--cp", "1"])
    rec = recommend(shape, run, pf, ns_.megatron_namespace)
    assert "--no-rope-fusion" in rec.flags
    assert any(r.startswith("--no-rope-fusion: ") and "fused_rope_forward_kernel" in r for r in rec.reasons)
    shape, run, pf, ns_, _ = build(["--preset", "gpt-oss-20b", "--seq-len", "384K", "--gpus", "8", "--cp", "1"])
    assert "--no-rope-fusion" not in recommend(shape, run, pf, ns_.megatron_namespace).flags


def test_auto_adds_no_rope_fusion_past_the_limit_and_says_why():
    from megatron_peakflat import auto

    line = ROPE_LINE.split() + ["--seq-length", str(448 * 1024), "--peakflat", "auto"]
    choice = auto.resolve(line, gpus=1, gpus_per_node=1, hbm_bytes=141 * GIB, host_bytes_per_node=2048 * GIB)
    assert "--no-rope-fusion" in choice.added
    table = choice.table()
    assert "added --no-rope-fusion: Transformer Engine" in table and "fused_rope_forward_kernel" in table
    short = ROPE_LINE.split() + ["--seq-length", str(384 * 1024), "--peakflat", "auto"]
    choice = auto.resolve(short, gpus=1, gpus_per_node=1, hbm_bytes=141 * GIB, host_bytes_per_node=2048 * GIB)
    assert "--no-rope-fusion" not in choice.added


def test_peakflat_check_refuses_the_line_past_the_limit(capsys):
    line = [*ROPE_LINE.split(), "--seq-length", str(448 * 1024), "--max-position-embeddings", str(448 * 1024),
            "--lr", "1e-4", "--train-iters", "10", "--peakflat-vocab", "ring-dtp",
            "--hbm-gib", "141", "--host-gib", "2048", "--gpus", "1"]
    assert check.main(line) == check.REFUSED
    captured = capsys.readouterr()
    err = next(ln for ln in captured.err.splitlines() if ln.startswith("error: "))
    assert "fused_rope_forward_kernel" in err and "add --no-rope-fusion" in err
    assert "fits" not in captured.out
    assert check.main([*line, "--no-rope-fusion"]) != check.REFUSED


# ---- the unfused attention backend ---------------------------------------------------------------

@pytest.mark.parametrize("flags, precision, head_dim, cp, why", [
    (dict(), "bf16", 64, 1, None),
    (dict(), "fp32", 64, 1, "fp32 data"),
    (dict(), "bf16", 100, 1, "not a multiple of 8"),
    (dict(), "bf16", 320, 1, "above 256"),
    (dict(softmax_type="off-by-one", deterministic_mode=True), "bf16", 64, 1, "--deterministic-mode"),
    (dict(softmax_type="learnable"), "bf16", 64, 1, None),
    (dict(softmax_type="learnable"), "bf16", 64, 2, "--cp-comm-type a2a"),
    (dict(softmax_type="learnable", cp_comm_type=["a2a"]), "bf16", 64, 2, None),
    (dict(transformer_impl="local"), "fp32", 64, 1, None),  # not TE's attention
])
def test_when_te_runs_its_unfused_backend(flags, precision, head_dim, cp, why):
    got = te_limits.unfused_attention_condition(ns(**flags), precision=precision, head_dim=head_dim, cp=cp)
    assert (got is None) if why is None else (why in got), got


def test_the_unfused_scores_are_planned():
    fp32 = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 8192 --micro-batch-size 1 "
            "--vocab-size 32000")
    shape, run, pf, _, _ = build(["--megatron-args", fp32, "--gpus", "1", "--hbm-gib", "80"])
    assert run.unfused_attention and "fp32" in run.unfused_attention
    row = plan(shape, run, pf).stages[0].rows["attention scores"]
    assert row.peakflat == 2 * 8 * 8192 * 8192 * 4  # scores and softmax, [1, 8, s, s] fp32
    shape, run, pf, _, _ = build(["--megatron-args", fp32 + " --bf16", "--gpus", "1", "--hbm-gib", "80"])
    assert run.unfused_attention is None and "attention scores" not in plan(shape, run, pf).stages[0].rows
    a2a = te_limits.unfused_scores_bytes(micro_batch=1, heads=8, tp=1, seq_len=8192, cp=2, cp_comm=["a2a"],
                                         bytes_per_element=2)
    p2p = te_limits.unfused_scores_bytes(micro_batch=1, heads=8, tp=1, seq_len=8192, cp=2, cp_comm=["p2p"],
                                         bytes_per_element=2)
    assert a2a == 2 * 4 * 8192 * 8192 * 2 and p2p == 2 * 8 * 4096 * 4096 * 2


def test_check_and_start_up_refuse_unfused_scores_that_do_not_fit(capsys, monkeypatch):
    line = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 32768 --max-position-embeddings "
            "32768 --micro-batch-size 1 --vocab-size 32000 --lr 1e-4 --train-iters 10 "
            "--no-create-attention-mask-in-dataloader --peakflat-vocab ring-dtp").split()
    assert check.main([*line, "--gpus", "1", "--hbm-gib", "40", "--host-gib", "2048"]) == check.REFUSED
    err = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: "))
    assert "unfused attention backend" in err and "add --bf16" in err
    assert check.main([*line, "--bf16", "--gpus", "1", "--hbm-gib", "40", "--host-gib", "2048"]) == 0

    from megatron_peakflat.integration import peaks
    from megatron_peakflat.planner.megatron_args import parse_megatron_args

    args, _ = parse_megatron_args(" ".join(line))
    monkeypatch.setattr(peaks, "_hbm_bytes", lambda: 40 * GIB)
    monkeypatch.setattr(peaks, "_megatron_fused_adam", lambda: True)
    peaks._cache.clear()
    with pytest.raises(PeakflatConfigError, match="unfused attention backend"):
        peaks.check_transformer_engine(args)
    args.bf16 = True
    peaks._cache.clear()
    peaks.check_transformer_engine(args)
    peaks._cache.clear()
