"""Transformer Engine's limits (planner/te_limits.py): the 32-bit offsets of the fused RoPE kernel and of the norm
kernels, the fused router's tokens x experts check, the fused permutation's row-id map, and the unfused attention
backend's s x s scores, each decision on CPU, and how the planner, ``--peakflat auto``, peakflat-check and start-up
act on them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_peakflat.cli import check
from megatron_peakflat.config_base import PeakflatConfigError
from megatron_peakflat.planner import te_limits
from megatron_peakflat.cli.plan import main as plan_main
from megatron_peakflat.planner.build import build
from megatron_peakflat.planner.model import GIB, RunConfig, plan
from megatron_peakflat.planner.shapes import PRESETS

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
    # the local spec rotates through the same rope_utils.apply_rotary_pos_emb, TE's kernel while fusion is on
    (dict(position_embedding_type="rope", transformer_impl="local"), True),
    (dict(position_embedding_type="rope", transformer_impl="local", apply_rope_fusion=False), False),
    (dict(position_embedding_type="rope", multi_latent_attention=True), False),
])
def test_which_lines_run_the_fused_rope_kernel(flags, applies):
    assert te_limits.rope_fusion_applies(ns(**flags)) is applies


def test_megatrons_attention_rotates_with_tes_kernel_on_either_spec_while_fusion_is_on(monkeypatch):
    """Why the local spec counts as running TE's fused RoPE: Megatron's Attention (both specs build it) rotates
    through rope_utils.apply_rotary_pos_emb, which calls TE's fused function whenever the config's fusion is on
    (recorded here in its place), and torch's only with --no-rope-fusion."""
    import types

    import torch
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention as attention_module

    assert attention_module.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb",
                        lambda t, freqs, interleaved=False: calls.append(tuple(t.shape)) or t)
    t, freqs = torch.randn(8, 1, 2, 4), torch.randn(8, 1, 1, 4)
    for fusion in (True, False):
        config = types.SimpleNamespace(apply_rope_fusion=fusion, multi_latent_attention=False, mrope_section=None,
                                       rotary_interleaved=False)
        rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=object())
    assert calls == [(8, 1, 2, 4)]  # fusion on: TE's kernel; off: torch's


@pytest.mark.parametrize("cp, micro_batch, percent", [(1, 1, 1.0), (2, 2, 1.0), (1, 1, 0.5)])
def test_torch_rope_saves_a_cos_and_a_sin_table_for_each_of_q_and_k(cp, micro_batch, percent):
    """``rope_tables``, traced: Megatron's unfused rotation of q and k (rope_utils, fusion off) saves, beyond its
    inputs, four [s / CP, 1, 1, rotated dims] tables in the model's dtype, whatever the micro-batch; and the
    planner counts them exactly for a --no-rope-fusion line (none with fusion on)."""
    import types

    import torch
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_peakflat.planner import model

    seq, heads, kv_heads, head_dim = 512, 8, 2, 64
    s = seq // cp
    rot = int(head_dim * percent)
    q = torch.randn(s, micro_batch, heads, head_dim, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, micro_batch, kv_heads, head_dim, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.randn(s, 1, 1, rot)
    config = types.SimpleNamespace(apply_rope_fusion=False, multi_latent_attention=False, mrope_section=None,
                                   rotary_interleaved=False)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, freqs)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rotated = [rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=object()) for t in (q, k)]
    assert len(rotated) == 2 and len(saved) == 4 and sum(saved.values()) == 4 * s * rot * 2

    shape, run, _, _, _ = _gqa_plan(seq, "--no-rope-fusion", f"--rotary-percent {percent}",
                                    f"--context-parallel-size {cp}", f"--micro-batch-size {micro_batch}", cp=cp)
    assert (run.cp, run.micro_batch) == (cp, micro_batch)
    assert run.torch_rope_dim == rot and model.rope_tables(run) == sum(saved.values())
    fused = _gqa_plan(seq, f"--context-parallel-size {cp}", cp=cp)[1]
    assert fused.torch_rope_dim == 0 and model.rope_tables(fused) == 0


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


@pytest.mark.parametrize("spec", [[], ["--transformer-impl", "local"]], ids=["te", "local"])
def test_auto_adds_no_rope_fusion_past_the_limit_and_says_why(spec):
    from megatron_peakflat import auto

    line = ROPE_LINE.split() + spec + ["--seq-length", str(448 * 1024), "--peakflat", "auto"]
    choice = auto.resolve(line, gpus=1, gpus_per_node=1, hbm_bytes=141 * GIB, host_bytes_per_node=2048 * GIB)
    assert "--no-rope-fusion" in choice.added
    table = choice.table()
    assert "added --no-rope-fusion: Transformer Engine" in table and "fused_rope_forward_kernel" in table
    short = ROPE_LINE.split() + spec + ["--seq-length", str(384 * 1024), "--peakflat", "auto"]
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
    # torch's fp32 softmax: probabilities, their gradient and the softmax's input gradient, [1, 8, s, s] fp32 each
    assert row.peakflat == 3 * 8 * 8192 * 8192 * 4
    shape, run, pf, _, _ = build(["--megatron-args", fp32 + " --bf16", "--gpus", "1", "--hbm-gib", "80"])
    assert run.unfused_attention is None and "attention scores" not in plan(shape, run, pf).stages[0].rows
    a2a = te_limits.unfused_scores_bytes(micro_batch=1, heads=8, tp=1, seq_len=8192, cp=2, cp_comm=["a2a"],
                                         bytes_per_element=2)
    p2p = te_limits.unfused_scores_bytes(micro_batch=1, heads=8, tp=1, seq_len=8192, cp=2, cp_comm=["p2p"],
                                         bytes_per_element=2)
    assert a2a == 3 * 4 * 8192 * 8192 * 2 and p2p == 3 * 8 * 4096 * 4096 * 2  # bf16 through TE's fused softmax
    # past the fused kernel's 16K keys, torch's softmax in fp32 even for bf16 data: 12 bytes an element in backward,
    # and 4 + 2 saved (the fp32 probabilities and their bf16 cast)
    long = dict(micro_batch=1, heads=8, tp=1, seq_len=32768, cp=1, cp_comm=["p2p"], bytes_per_element=2)
    assert te_limits.unfused_scores_bytes(**long) == 12 * 8 * 32768 ** 2
    assert te_limits.unfused_scores_bytes(**long, saved=True) == 6 * 8 * 32768 ** 2
    assert te_limits.unfused_scores_bytes(**{**long, "bytes_per_element": 4}, saved=True) == 4 * 8 * 32768 ** 2


def test_check_and_start_up_refuse_unfused_scores_that_do_not_fit(capsys, monkeypatch):
    line = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 32768 --max-position-embeddings "
            "32768 --micro-batch-size 1 --vocab-size 32000 --lr 1e-4 --train-iters 10 "
            "--no-create-attention-mask-in-dataloader --peakflat-vocab ring-dtp").split()
    # does not fit (3), with the error naming what sends it past the GPU; the same status with auto
    assert check.main([*line, "--gpus", "1", "--hbm-gib", "40", "--host-gib", "2048"]) == check.DOES_NOT_FIT
    err = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: "))
    assert "unfused attention backend" in err and "add --bf16" in err
    assert check.main([*line, "--gpus", "1", "--hbm-gib", "40", "--host-gib", "2048", "--peakflat", "auto"]) \
        == check.DOES_NOT_FIT
    assert check.main([*line, "--bf16", "--gpus", "1", "--hbm-gib", "40", "--host-gib", "2048"]) == 0
    _start_up_refuses_then_admits(monkeypatch, line, 40, "unfused attention backend", bf16=True)


def _start_up_refuses_then_admits(monkeypatch, line: list[str], hbm_gib: int, match: str, **fixed: object) -> None:
    """Start-up's Transformer Engine check refuses ``line`` on a GPU of ``hbm_gib`` with an error matching
    ``match``, and admits it once the Megatron arguments in ``fixed`` are set."""
    from megatron_peakflat.integration import peaks
    from megatron_peakflat.planner.megatron_args import parse_megatron_args

    args, _ = parse_megatron_args(" ".join(line))
    monkeypatch.setattr(peaks, "_hbm_bytes", lambda: hbm_gib * GIB)
    monkeypatch.setattr(peaks, "_megatron_fused_adam", lambda: True)
    peaks._cache.clear()
    with pytest.raises(PeakflatConfigError, match=match):
        peaks.check_transformer_engine(args)
    for name, value in fixed.items():
        setattr(args, name, value)
    peaks._cache.clear()
    peaks.check_transformer_engine(args)
    peaks._cache.clear()


# ---- cuDNN's deterministic attention backward -----------------------------------------------------

# 32 heads of 64 over 2 K/V heads, 128 experts of 384 (planner_calibration's moe-e128-top8)
DET_LINE = ("--num-layers 2 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 2 "
            "--kv-channels 64 --ffn-hidden-size 4096 --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 384 "
            "--moe-token-dispatcher-type alltoall --vocab-size 151552 --bf16 --use-distributed-optimizer --micro-batch-size 1 "
            "--global-batch-size 1 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--hidden-dropout 0 --attention-dropout 0 --no-create-attention-mask-in-dataloader --lr 1e-4 "
            "--train-iters 10 --disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope")


def _det_plan(seq: int, *extra: str, cp: int = 1):
    line = f"{DET_LINE} --seq-length {seq} --max-position-embeddings {seq} {' '.join(extra)}"
    return build(["--megatron-args", line, "--gpus", str(cp), "--hbm-gib", "80", "--host-gib", "2048"])


def test_the_deterministic_workspace_is_dp_for_every_query_against_every_key():
    # 32 heads at 640K tokens: 32 x 655360^2 x 2 bytes = 25,600 GiB
    got = te_limits.deterministic_workspace_bytes(micro_batch=1, heads=32, tp=1, q_tokens=640 * 1024,
                                                  kv_tokens=640 * 1024)
    assert got == 25_600 * GIB
    assert te_limits.deterministic_workspace_bytes(micro_batch=1, heads=32, tp=2, q_tokens=100, kv_tokens=1) == \
        16 * 128 * 64 * 2  # padded to 64


@pytest.mark.parametrize("extra, cp, expect", [
    ((), 1, None),  # non-deterministic: cuDNN's fp32 dQ accumulator, linear in s
    (("--deterministic-mode",), 1, 32 * 65536 * 65536 * 2),
    (("--deterministic-mode", "--context-parallel-size 2"), 2, 32 * 32768 * 32768 * 2),  # p2p: s/CP x s/CP
    (("--deterministic-mode", "--context-parallel-size 2", "--cp-comm-type a2a"), 2, 16 * 65536 * 65536 * 2),
    (("--deterministic-mode", "--transformer-impl local"), 1, None),  # flash's deterministic backward
])
def test_the_plan_counts_the_deterministic_workspace_on_te_only(extra, cp, expect):
    shape, run, pf, _, _ = _det_plan(65536, *extra, cp=cp)
    rows = plan(shape, run, pf).stages[0].rows
    if expect is None:
        assert "attention scores" not in rows
    else:
        assert rows["attention scores"].baseline == expect
        assert "deterministic" in rows["attention scores"].source


def test_under_the_tile_the_workspace_is_one_tile_of_one_calls_heads_against_the_sequence():
    """The tiled sublayer runs TE's attention as one call per K/V head (2 here, model.te_tile_calls): each call's
    dP workspace is a tile of 16 of the 32 query heads against every key."""
    shape, run, pf, _, _ = _det_plan(65536, "--deterministic-mode", "--peakflat-tile", "--peakflat-tile-tokens 4096")
    row = plan(shape, run, pf).stages[0].rows["attention scores"]
    assert row.baseline == 32 * 65536 * 65536 * 2 and row.peakflat == 16 * 4096 * 65536 * 2


def test_auto_check_and_start_up_refuse_a_deterministic_workspace_that_does_not_fit(capsys, monkeypatch):
    from megatron_peakflat.auto import resolve

    seq = 1 << 20  # at 640K the tile's calls (2048 queries of 16 heads against every key) fit
    line = f"{DET_LINE} --seq-length {seq} --max-position-embeddings {seq} --no-rope-fusion".split()
    with pytest.raises(PeakflatConfigError, match="--deterministic-mode") as e:
        resolve([*line, "--deterministic-mode", "--peakflat", "auto"], gpus=1, gpus_per_node=1,
                hbm_bytes=80 * GIB, host_bytes_per_node=2048 * GIB)
    assert "cuDNN's deterministic attention backward" in str(e.value)
    resolve([*line, "--peakflat", "auto"], gpus=1, gpus_per_node=1, hbm_bytes=80 * GIB,
            host_bytes_per_node=2048 * GIB)  # the same line without it fits

    opts = ["--gpus", "1", "--hbm-gib", "80", "--host-gib", "2048"]
    assert check.main([*line, "--peakflat-vocab", "ring-dtp", "--deterministic-mode", *opts]) == check.DOES_NOT_FIT
    err = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: "))
    assert "--deterministic-mode" in err and "drop --deterministic-mode" in err
    # at 64K the tiled sublayer's calls (a tile against its prefix) fit: the line does not, the recommendation does
    short = f"{DET_LINE} --seq-length 65536 --max-position-embeddings 65536 --peakflat-vocab ring-dtp".split()
    assert check.main([*short, "--deterministic-mode", *opts]) == check.DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "--peakflat-tile" in out and "the 'recommended' flags above are the planner's way to fit" in out
    assert check.main([*short, *opts]) == 0
    _start_up_refuses_then_admits(monkeypatch, [*short, "--deterministic-mode"], 80, "dP workspace",
                                  deterministic_mode=False)


def test_the_header_names_the_deterministic_backend(capsys):
    line = f"{DET_LINE} --seq-length 8192 --max-position-embeddings 8192 --deterministic-mode"
    plan_main(["--megatron-args", line, "--gpus", "1", "--hbm-gib", "80"])
    assert "attention cuDNN deterministic" in capsys.readouterr().out


# ---- TE's norms: the arithmetic -----------------------------------------------------------------

OSS = PRESETS["gpt-oss-20b"]  # RMSNorm over 2880: no tuned kernel
QWEN = PRESETS["qwen3-235b-a22b"]  # hidden 4096 (tuned RMSNorm), 64 heads of 128, 128 experts
RMS = dict(normalization="RMSNorm")


def test_the_general_norm_kernels_take_2_31_elements():
    assert te_limits.norm_max_rows(2880, "RMSNorm", "bf16") == 745_654
    assert te_limits.norm_fits(745_654, 2880, "RMSNorm", "bf16")
    assert not te_limits.norm_fits(745_655, 2880, "RMSNorm", "bf16")
    assert te_limits.norm_fits(448 * 1024, 2880, "RMSNorm", "bf16")  # the 448K run got past its norms
    assert not te_limits.norm_fits(1 << 20, 2880, "RMSNorm", "bf16")  # 1M tokens: 3.0e9 elements
    assert "rmsnorm_fwd_general_kernel" in te_limits.norm_kernel("RMSNorm", "bf16", 2880, 1 << 20)
    assert te_limits.norm_offsets(1 << 20, 2880, "RMSNorm", "bf16") == 3_019_898_880


def test_a_tuned_hidden_size_counts_loads_where_the_rows_are_a_multiple_of_4():
    assert te_limits.norm_elements_per_offset("RMSNorm", "bf16", 4096, 1 << 20) == 8  # 16-byte loads
    assert te_limits.norm_fits(1 << 20, 4096, "RMSNorm", "bf16")  # 4.3e9 elements, 5.4e8 loads
    assert te_limits.norm_max_rows(4096, "RMSNorm", "bf16", tuned=True) == 4_194_300
    assert "rmsnorm_fwd_tuned_kernel" in te_limits.norm_kernel("RMSNorm", "bf16", 4096, 1 << 20)
    # rows not a multiple of 4: TE runs the general kernel (normalization/common.cpp is_tuned)
    assert te_limits.norm_elements_per_offset("RMSNorm", "bf16", 4096, (1 << 20) + 2) == 1
    assert not te_limits.norm_fits((1 << 20) + 2, 4096, "RMSNorm", "bf16")
    assert te_limits.norm_elements_per_offset("RMSNorm", "fp32", 4096, 4) == 4
    assert te_limits.norm_elements_per_offset("LayerNorm", "bf16", 2304, 4) == 2  # 4-byte loads in backward
    assert te_limits.norm_elements_per_offset("LayerNorm", "bf16", 5120, 4) == 8
    assert te_limits.norm_elements_per_offset("RMSNorm", "bf16", 5120, 4) == 1  # tuned for LayerNorm only


def test_the_tuned_kernels_are_taken_only_where_megatron_aligns_the_norm_weight():
    """TE's tuned kernels need 16-byte-aligned pointers; Megatron's parameter buffer starts each parameter on 64
    elements under --use-distributed-optimizer only, so without it the general kernel's limit is planned."""
    run = RunConfig(seq_len=1 << 20)  # 1M x 4096: 4.3e9 elements, 5.4e8 loads
    assert te_limits.norm_refusal(QWEN, run, ns(**RMS)) is None
    e = te_limits.norm_refusal(QWEN, dataclasses.replace(run, distributed_optimizer=False), ns(**RMS))
    assert "rmsnorm_fwd_general_kernel" in e.problem and e.fix.startswith("add --peakflat-tile")
    assert ", or add --use-distributed-optimizer" in e.fix
    assert te_limits.norm_elements_per_offset("RMSNorm", "bf16", 4096, 1 << 20, aligned=False) == 1


@pytest.mark.parametrize("run, rows", [
    (RunConfig(seq_len=1 << 20), 1 << 20),
    (RunConfig(seq_len=1 << 20, cp=2), 1 << 19),  # CP divides the rank's rows
    (RunConfig(seq_len=1 << 19, micro_batch=2), 1 << 20),  # the micro-batch multiplies them
    (RunConfig(seq_len=1 << 20, tp=2), 1 << 19),  # sequence parallel (the planner's default at TP > 1)
    (RunConfig(seq_len=1 << 20, tp=2, sequence_parallel=False), 1 << 20),
])
def test_the_whole_sequence_norms_run_over_the_ranks_tokens(run, rows):
    (what, got, hidden, name), = te_limits.norm_sites(OSS, run, ns())
    assert (got, hidden, name) == (rows, 2880, "hidden") and "pre-MLP and final norms" in what


def test_the_tile_runs_the_whole_sequence_norms_in_row_slices():
    """With --peakflat-tile the pre-MLP, final and MTP norms run in row slices (integration.norm_rows): no refusal;
    without it, the same line is refused."""
    tiled = ns(peakflat_tile_enabled=True, peakflat_tile_tokens=None, **RMS)
    assert te_limits.norm_refusal(OSS, RunConfig(seq_len=1 << 20), tiled) is None
    e = te_limits.norm_refusal(OSS, RunConfig(seq_len=1 << 20), ns(**RMS))
    assert e is not None and (e.flag, e.value) == ("--seq-length", 1 << 20)


def test_norm_slice_rows_is_the_rule_both_places_read():
    assert te_limits.norm_slice_rows(745_654, 2880, "RMSNorm", "bf16") is None
    assert te_limits.norm_slice_rows(1 << 20, 2880, "RMSNorm", "bf16") == 745_654
    # a tuned hidden size: the tuned count decides whether to slice, the general limit sizes the slice (it holds
    # for a last slice whose rows are no multiple of 4, which runs the general kernel)
    assert te_limits.norm_slice_rows(600_000, 5120, "LayerNorm", "bf16") is None
    assert te_limits.norm_slice_rows(600_001, 5120, "LayerNorm", "bf16") == te_limits.norm_max_rows(
        5120, "LayerNorm", "bf16") == 419_430


def test_the_norm_refusal_names_the_kernels_the_limit_and_the_fix():
    e = te_limits.norm_refusal(OSS, RunConfig(seq_len=1 << 20), ns(**RMS))
    assert "rmsnorm_fwd_general_kernel and rmsnorm_bwd_general_kernel" in e.problem
    assert "3,019,898,880 elements" in e.problem and "2**31 - 1" in e.problem and "745,654 rows" in e.problem
    # with the flags its own start-up check needs that the line (at Megatron's defaults) lacks, all at once
    assert e.fix.startswith("add --peakflat-tile --hidden-dropout 0 --attention-dropout 0 "
                            "--no-create-attention-mask-in-dataloader (the pre-MLP, final and MTP norms then run in "
                            "row slices of at most 745,654 rows), or raise --context-parallel-size to 2 or more")
    ready = ns(**RMS, hidden_dropout=0.0, attention_dropout=0.0, create_attention_mask_in_dataloader=False)
    assert te_limits.norm_refusal(OSS, RunConfig(seq_len=1 << 20), ready).fix.startswith("add --peakflat-tile (the")
    assert "or lower --micro-batch-size" in te_limits.norm_refusal(OSS, RunConfig(seq_len=1 << 19, micro_batch=2),
                                                                  ns(**RMS)).fix
    assert "or raise --context-parallel-size to 6 or more" in te_limits.norm_refusal(
        OSS, RunConfig(seq_len=4 << 20), ns(**RMS)).fix  # 4M / 6 = 699,050 rows
    assert "ln_fwd_general_kernel" in te_limits.norm_refusal(OSS, RunConfig(seq_len=1 << 20), ns()).problem
    assert te_limits.norm_refusal(OSS, RunConfig(seq_len=1 << 20), ns(transformer_impl="local")) is None


def test_a_command_line_is_layernorm_unless_it_says_and_a_preset_rmsnorm():
    wide, run = OSS.with_(hidden=5120), RunConfig(seq_len=600_000)  # 3.07e9 elements, rows a multiple of 4
    assert te_limits.norm_refusal(wide, run, ns()) is None  # Megatron's default LayerNorm: tuned, 16-byte loads
    assert te_limits.norm_refusal(wide, run, ns(), preset=True) is not None  # RMSNorm: the general kernel
    assert te_limits.norm_refusal(wide, run, ns(**RMS)) is not None


def test_the_qk_layernorm_query_norm_runs_over_heads_and_per_tile():
    qk = ns(qk_layernorm=True, **RMS)
    assert te_limits.norm_refusal(QWEN, RunConfig(seq_len=262_143), qk) is None  # x 64 heads x 128 < 2**31
    e = te_limits.norm_refusal(QWEN, RunConfig(seq_len=262_144), qk)
    assert (e.flag, e.value) == ("--qk-layernorm", True) and "x head dim 128" in e.problem
    assert e.fix.startswith("add --peakflat-tile")
    assert te_limits.norm_refusal(QWEN, RunConfig(seq_len=262_144), ns(**RMS)) is None  # no query norm
    tiled = ns(qk_layernorm=True, peakflat_tile_enabled=True, peakflat_tile_tokens=16384, **RMS)
    assert te_limits.norm_refusal(QWEN, RunConfig(seq_len=1 << 20), tiled) is None
    long_tiles = ns(**{**vars(tiled), "peakflat_tile_tokens": 1 << 19})
    assert te_limits.norm_refusal(QWEN, RunConfig(seq_len=1 << 20), long_tiles).fix == "lower --peakflat-tile-tokens"


# ---- TE's norms: planner, auto, check, start-up --------------------------------------------------

NORM_LINE = ROPE_LINE + " --normalization RMSNorm --no-rope-fusion --hidden-dropout 0 --attention-dropout 0"
"""Dropout 0: the tiled sublayer, which slices the norms, refuses dropout (Megatron's default is 0.1)."""
BIG = dict(hbm_bytes=4096 * GIB, host_bytes_per_node=65536 * GIB)


def test_the_planner_refuses_the_norms_past_the_limit(capsys):
    argv = ["--megatron-args", NORM_LINE, "--hbm-gib", "4096", "--host-gib", "65536"]
    assert plan_main([*argv, "--gpus", "1", "--seq-len", "1M"]) == 2
    captured = capsys.readouterr()
    assert "rmsnorm_fwd_general_kernel" in captured.err and "Fix: add --peakflat-tile" in captured.err
    assert "raise --context-parallel-size to 2" in captured.err
    assert plan_main([*argv[:1], NORM_LINE + " --peakflat-tile", *argv[2:], "--gpus", "1", "--seq-len", "1M"]) == 0
    assert plan_main([*argv, "--gpus", "1", "--seq-len", "720K"]) == 0
    assert plan_main(["--megatron-args", NORM_LINE + " --context-parallel-size 2", *argv[2:], "--gpus", "2",
                      "--seq-len", "1M"]) == 0
    assert "rmsnorm" not in capsys.readouterr().err
    # a preset: RMSNorm; the recommendation turns the tiled sublayer on, which slices the norms
    capsys.readouterr()
    assert plan_main(["--preset", "gpt-oss-20b", "--seq-len", "1M", "--gpus", "1", *argv[2:]]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm_fwd_general_kernel" in out and "--peakflat-tile" in out
    assert plan_main(["--preset", "gpt-oss-20b", "--seq-len", "720K", "--gpus", "1", *argv[2:]]) == 0


def test_auto_turns_the_tile_on_for_the_norms_past_the_limit_and_not_below_it():
    """1M tokens on one GPU, hidden 2880, TE's RMSNorm: auto adds --peakflat-tile (the norms then run in row
    slices) and says why in its table; at 720K (within the limit) the norms are no reason for it."""
    from megatron_peakflat import auto

    line = NORM_LINE.split() + ["--peakflat", "auto"]
    choice = auto.resolve([*line, "--seq-length", str(1 << 20)], gpus=1, gpus_per_node=1, **BIG)
    assert choice.recommendation.fits and "--peakflat-tile" in choice.added
    row = next(ln for ln in choice.table().splitlines() if ln.strip().startswith("TiledAttention"))
    assert "row slices" in row and "rmsnorm_fwd_general_kernel" in row and "1,048,576 rows" in row, row
    small = auto.resolve([*line, "--seq-length", str(720 * 1024)], gpus=1, gpus_per_node=1, **BIG)
    assert not any("row slices" in r for r in small.recommendation.reasons)
    choice = auto.resolve([*line, "--seq-length", str(720 * 1024)], gpus=1, gpus_per_node=1, **BIG)
    assert choice.recommendation.fits
    choice = auto.resolve([*line, "--seq-length", str(1 << 20), "--context-parallel-size", "2"], gpus=2,
                          gpus_per_node=2, **BIG)
    assert choice.recommendation.fits


def test_peakflat_check_and_start_up_refuse_the_norms_past_the_limit(capsys, monkeypatch):
    line = [*NORM_LINE.split(), "--seq-length", str(1 << 20), "--max-position-embeddings", str(1 << 20),
            "--lr", "1e-4", "--train-iters", "10", "--peakflat-vocab", "ring-dtp"]
    machine = ["--hbm-gib", "4096", "--host-gib", "65536", "--gpus", "1"]
    assert check.main([*line, *machine]) == check.REFUSED
    err = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: "))
    assert "--seq-length=1048576" in err and "rmsnorm_fwd_general_kernel" in err
    assert "Fix: add --peakflat-tile" in err and "raise --context-parallel-size to 2 or more" in err
    assert check.main([*line, "--peakflat-tile", "--hidden-dropout", "0", "--attention-dropout", "0",
                       *machine]) != check.REFUSED
    assert check.main([*line, "--seq-length", str(720 * 1024), "--max-position-embeddings", str(720 * 1024),
                       *machine]) != check.REFUSED
    _start_up_refuses(monkeypatch, " ".join(line), "rmsnorm_fwd_general_kernel",
                      " ".join(line).replace(str(1 << 20), str(720 * 1024)))


def _start_up_refuses(monkeypatch: pytest.MonkeyPatch, line: str, match: str, below: str) -> None:
    """Training start-up's check (integration/peaks.py) refuses ``line`` with ``match`` and passes ``below``."""
    from megatron_peakflat.integration import peaks
    from megatron_peakflat.planner.megatron_args import parse_megatron_args

    monkeypatch.setattr(peaks, "_hbm_bytes", lambda: 4096 * GIB)
    monkeypatch.setattr(peaks, "_megatron_fused_adam", lambda: True)
    peaks._cache.clear()
    try:
        with pytest.raises(PeakflatConfigError, match=match):
            peaks.check_transformer_engine(parse_megatron_args(line)[0])
        peaks._cache.clear()
        peaks.check_transformer_engine(parse_megatron_args(below)[0])
    finally:
        peaks._cache.clear()


# ---- the fused router and the fused permutation -------------------------------------------------

def test_the_fused_router_checks_tokens_x_experts():
    on = ns(moe_router_fusion=True)
    assert te_limits.router_fusion_refusal(QWEN, RunConfig(seq_len=16_777_215), on) is None  # x 128 <= INT_MAX
    e = te_limits.router_fusion_refusal(QWEN, RunConfig(seq_len=1 << 24), on)
    assert (e.flag, e.value) == ("--moe-router-fusion", True)
    assert "num_tokens x num_experts <= INT_MAX" in e.problem and "16,777,215 tokens" in e.problem
    assert e.fix.startswith("drop --moe-router-fusion")
    assert te_limits.router_fusion_refusal(QWEN, RunConfig(seq_len=1 << 24), ns()) is None  # Megatron's default
    assert te_limits.router_fusion_refusal(QWEN, RunConfig(seq_len=1 << 24, cp=2), on) is None
    assert te_limits.router_fusion_refusal(OSS.with_(experts=0), RunConfig(seq_len=1 << 30), on) is None


def test_the_fused_permutations_row_id_map_limits():
    assert te_limits.permute_row_id_map_width(1 << 20, 32) == 32768  # gpt-oss-20b at 1M: far from 2**20
    assert te_limits.permute_row_id_map_width(4096 * 1024, 256) == 1 << 20
    assert te_limits.permute_row_id_map_width(4096 * 1024 + 1, 256) == 1 << 21
    deepseek = PRESETS["deepseek-v3"]  # 256 experts
    a2a = dict(moe_permute_fusion=True, moe_token_dispatcher_type="alltoall")
    assert te_limits.permute_fusion_refusal(deepseek, RunConfig(seq_len=4096 * 1024), ns(**a2a)) is None
    e = te_limits.permute_fusion_refusal(deepseek, RunConfig(seq_len=4097 * 1024), ns(**a2a))
    assert (e.flag, e.value) == ("--moe-permute-fusion", True) and "2**20" in e.problem
    assert "4,194,304 tokens" in e.problem and e.fix.startswith("drop --moe-permute-fusion")
    assert "--peakflat-dispatch pipelined-llep" in e.fix
    # PipelinedLLEP permutes with its own code; the flag off; other dispatchers
    assert te_limits.permute_fusion_refusal(deepseek, RunConfig(seq_len=4097 * 1024),
                                            ns(peakflat_dispatch_impl="pipelined-llep", **a2a)) is None
    assert te_limits.permute_fusion_refusal(deepseek, RunConfig(seq_len=4097 * 1024),
                                            ns(moe_token_dispatcher_type="alltoall")) is None
    # the allgather dispatcher permutes the tokens gathered over TP x EP
    gather = ns(moe_permute_fusion=True, moe_token_dispatcher_type="allgather")
    assert te_limits.permute_fusion_refusal(deepseek, RunConfig(seq_len=1 << 20, ep=8), gather) is not None
    assert te_limits.permute_fusion_refusal(deepseek, RunConfig(seq_len=1 << 20, ep=8), ns(**a2a)) is None
    # few experts: the first pass's grid, ceil(tokens / 1024) blocks in y, binds first
    e = te_limits.permute_fusion_refusal(OSS.with_(experts=8), RunConfig(seq_len=65536 * 1024), ns(**a2a))
    assert e is not None and "65535" in e.problem and "67,107,840 tokens" in e.problem
    assert te_limits.permute_fusion_refusal(OSS.with_(experts=8), RunConfig(seq_len=65535 * 1024), ns(**a2a)) is None


# a line whose norms fit (RMSNorm 4096, tuned) where the router and the permutation do not
MOE_LINE = ("--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 4 "
            "--kv-channels 128 --num-experts 1024 --moe-router-topk 2 --moe-ffn-hidden-size 256 --ffn-hidden-size 4096 "
            "--vocab-size 32000 --bf16 --use-distributed-optimizer --micro-batch-size 1 --normalization RMSNorm "
            "--position-embedding-type rope --no-rope-fusion --no-create-attention-mask-in-dataloader "
            "--moe-token-dispatcher-type alltoall --disable-bias-linear")
LONG_MOE, SHORT_MOE = 4_000_000, 1_000_000  # x 1024 experts: past INT_MAX and 2**20 blocks; within both


def test_start_up_refuses_the_fused_router_and_permutation_and_auto_switches_the_permutation(monkeypatch):
    from megatron_peakflat import auto

    for flag, match in (("--moe-router-fusion", "fused_topk_with_score_function"),
                        ("--moe-permute-fusion", "make_row_id_map")):
        line = f"{MOE_LINE} {flag} --seq-length {LONG_MOE}"
        _start_up_refuses(monkeypatch, line, match, line.replace(str(LONG_MOE), str(SHORT_MOE)))
    # --peakflat auto turns PipelinedLLEP on, which never calls TE's permutation: the line runs
    line = f"{MOE_LINE} --moe-permute-fusion --seq-length {LONG_MOE} --peakflat auto".split()
    choice = auto.resolve(line, gpus=1, gpus_per_node=1, **BIG)
    assert "pipelined-llep" in choice.added
    with pytest.raises(PeakflatConfigError, match="--moe-permute-fusion"):  # the user's own dispatcher: refused
        auto.resolve([*line, "--peakflat-dispatch", "megatron"], gpus=1, gpus_per_node=1, **BIG)
    with pytest.raises(PeakflatConfigError, match="--moe-router-fusion"):  # no flag of auto's lifts it
        auto.resolve(f"{MOE_LINE} --moe-router-fusion --seq-length {LONG_MOE} --peakflat auto".split(), gpus=1,
                     gpus_per_node=1, **BIG)


def test_the_rope_limit_comes_first_and_is_the_only_one_recommend_switches():
    line = ns(position_embedding_type="rope", **RMS)
    run = RunConfig(seq_len=1 << 20)
    assert te_limits.line_refusal(OSS, run, line).flag == "--apply-rope-fusion"
    assert te_limits.rope_line_refusal(OSS, run, line).flag == "--apply-rope-fusion"
    assert te_limits.hard_refusal(OSS, run, line).flag == "--seq-length"
    assert te_limits.line_refusal(OSS, run, ns(apply_rope_fusion=False, **vars(line))).flag == "--seq-length"


# ---- cuDNN's backward with grouped K/V heads: dK and dV at the query heads ------------------------------------

def _te_1m_oom_row() -> dict:
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).resolve().parent.parent / "bench/results/e2e.json").read_text())["rows"]
    case = "seq=1048576,spec=te,one_te_call_per_tile"  # the run with one TE call per tile, before the split
    return next(r for r in rows if r["case"] == case and r["method"] == "peakflat-auto")


def test_the_gqa_expansion_is_the_workspace_a_1m_run_asked_for():
    """The 1M-token run on TE (one H100, TE 2.20.2) died asking cuDNN's backward for one 16.26 GiB workspace: a 16K
    tile of gpt-oss-20b's 64 query heads against 1M keys of 8 K/V heads. dK and dV at the query heads (16 GiB) and
    the tile's fp32 dQ accumulator (0.25 GiB) are that workspace."""
    import re

    row = _te_1m_oom_row()
    (attempt,) = row["extra"]["attempts"]
    asked = float(re.search(r"Tried to allocate ([\d.]+) GiB", attempt["oom"]["message"]).group(1))
    assert any("fused_attn_bwd" in w for w in attempt["oom"]["where"])
    keys, tile, heads, dim = 1 << 20, 16384, 64, 64
    expanded = te_limits.gqa_expansion_bytes(micro_batch=1, heads=heads, tp=1, kv_tokens=keys, head_dim=dim,
                                             bytes_per_element=2)
    assert expanded == 16 * GIB
    assert abs((expanded + tile * heads * dim * 4) / GIB - asked) < 0.02


def _gqa_plan(seq: int, *extra: str, cp: int = 1, groups: int = 8):
    line = (ROPE_LINE.replace("--num-query-groups 8", f"--num-query-groups {groups}")
            + f" --seq-length {seq} --max-position-embeddings {seq} --recompute-granularity full "
            f"--recompute-method uniform --recompute-num-layers 1 {' '.join(extra)}")
    return build(["--megatron-args", line, "--gpus", str(cp), "--hbm-gib", "80", "--host-gib", "2048"])


@pytest.mark.parametrize("extra, cp, groups, keys, heads", [
    ((), 1, 8, 65536, 64),  # one call over the whole sequence
    (("--context-parallel-size 2",), 2, 8, 32768, 64),  # p2p: each ring step's s/CP keys
    (("--context-parallel-size 2", "--cp-comm-type a2a"), 2, 8, 65536, 32),  # a2a: heads/CP, every key
    ((), 1, 64, 0, 64),  # no grouped heads: nothing to expand
    (("--transformer-impl local",), 1, 8, 0, 64),  # flash's own expansion (flash_gqa_expansion) instead
])
def test_the_attention_backward_counts_cudnns_expanded_dk_dv(extra, cp, groups, keys, heads, monkeypatch):
    from megatron_peakflat.planner import model

    shape, run, pf, _, _ = _gqa_plan(65536, *extra, cp=cp, groups=groups)
    with_it = plan(shape, run, pf).stages[0].rows["tile"].baseline
    monkeypatch.setattr(model, "te_gqa_expansion", lambda *a, **k: 0.0)
    without = plan(shape, run, pf).stages[0].rows["tile"].baseline
    assert with_it - without == 2 * heads * keys * 64 * 2


def test_under_the_tile_each_call_expands_its_heads_over_the_whole_prefix(monkeypatch):
    """The tiled sublayer runs TE's attention as one call per K/V head (integration/tile.py te_kv_head_calls): one
    call's 8 query heads expand over the prefix at a time, and the split holds the prefix's K and V copies (or
    their gradients) and the tile's output twice; at one call per tile, all 64 heads expand."""
    from megatron_peakflat.planner import model

    shape, run, pf, _, _ = _gqa_plan(65536, "--peakflat-tile", "--peakflat-tile-tokens 4096", "--hidden-dropout 0",
                                     "--attention-dropout 0")
    assert model.te_tile_calls(shape, run) == 8
    split = plan(shape, run, pf).stages[0].rows["tile"].peakflat
    monkeypatch.setattr(model, "te_tile_calls", lambda s, r: 1)
    one_call = plan(shape, run, pf).stages[0].rows["tile"].peakflat
    monkeypatch.setattr(model, "te_gqa_expansion", lambda *a, **k: 0.0)
    assert one_call - plan(shape, run, pf).stages[0].rows["tile"].peakflat == 2 * 64 * 65536 * 64 * 2
    assert split - one_call == (2 * 8 * 65536 * 64 * 2 - 2 * 64 * 65536 * 64 * 2  # one call's heads, not all
                                + 2 * 65536 * 8 * 64 * 2 + 2 * 4096 * 64 * 64 * 2)  # K and V copies; output twice


def test_the_1m_run_that_died_is_not_planned_to_fit_as_it_ran_and_fits_with_a_call_per_kv_head(monkeypatch):
    """The run's own flags: with the tile's one TE call per tile that ran it, auto finds nothing at 1M on the H100;
    with one call per K/V head (model.te_tile_calls) it admits the line."""
    import shlex

    from megatron_peakflat.auto import resolve
    from megatron_peakflat.planner import model

    row = _te_1m_oom_row()
    assert not row["extra"].get("te_tile_kv_head_calls")
    argv = shlex.split(row["extra"]["command"])
    flags = argv[argv.index("megatron_peakflat.pretrain") + 1:]
    hbm = int(79.18 * GIB)
    with monkeypatch.context() as m:
        m.setattr(model, "te_tile_calls", lambda s, r: 1)
        with pytest.raises(PeakflatConfigError):
            resolve(flags, gpus=1, gpus_per_node=1, hbm_bytes=hbm, host_bytes_per_node=128 * GIB)
    assert "--peakflat-tile" in resolve(flags, gpus=1, gpus_per_node=1, hbm_bytes=hbm,
                                        host_bytes_per_node=128 * GIB).added


def test_where_the_expansion_binds_the_refusal_names_the_local_specs_per_head_calls(capsys, monkeypatch):
    """The 1M line that died, planned with one TE call per tile as it ran: peakflat-check refuses it (exit 3), and
    the tile row's fix names the local spec's SDPA attention beside CP and TP, with both expansions; with the
    tile's call per K/V head the line fits, and no fix names the local spec; a line without grouped heads gets no
    such fix."""
    import shlex

    from megatron_peakflat.planner import model

    row = _te_1m_oom_row()
    argv = shlex.split(row["extra"]["command"])
    flags = argv[argv.index("megatron_peakflat.pretrain") + 1:]
    with monkeypatch.context() as m:
        m.setattr(model, "te_tile_calls", lambda s, r: 1)
        assert check.main([*flags, "--gpus", "1", "--hbm-gib", "79.18", "--host-gib", "128"]) == 3
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "--transformer-impl local --peakflat-attention sdpa" in text and "(16.00 GiB here)" in text
    assert "one call per K/V head (2.00 GiB)" in text
    assert check.main([*flags, "--gpus", "1", "--hbm-gib", "79.18", "--host-gib", "128"]) == 0
    out = capsys.readouterr()
    assert "--transformer-impl local" not in out.out + out.err
    mha = [f if f != "8" or flags[i - 1] != "--num-query-groups" else "64" for i, f in enumerate(flags)]
    check.main([*mha, "--gpus", "1", "--hbm-gib", "79.18", "--host-gib", "128"])
    out = capsys.readouterr()
    assert "holds dK and dV at every query head" not in out.out + out.err


def _saved_by_local_attention(rank: int, world: int, min_keys: int, copies: bool) -> dict[str, int]:
    """Bytes a Megatron self-attention layer (local spec, peakflat's SDPA attention, torch's RoPE) saves for backward
    in the packed QKV projection output's storage and in the rotated q's and k's; ``copies=False`` takes out the
    attention's copy of views (``own_storage``)."""
    import torch

    import megatron_peakflat
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import attention as attention_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.attention import calls
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.testing import megatron_cpu as mc

    calls.GROUPED_CALL_MIN_KEYS = min_keys
    if not copies:
        from megatron_peakflat.integration import attention as sdpa_attention

        sdpa_attention.own_storage = lambda t: t
    with mc.megatron_on_cpu(rank, tp=1):
        megatron_peakflat.apply(PeakflatConfig(general=GeneralConfig(attention="sdpa")))
        cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=8, num_query_groups=2,
                                kv_channels=16, ffn_hidden_size=256, add_bias_linear=False, hidden_dropout=0.0,
                                attention_dropout=0.0, use_cpu_initialization=True, normalization="RMSNorm",
                                apply_rope_fusion=False)
        attn = mc.build_tiny_gpt(cfg, vocab_size=64, seq_len=256, moe=False).decoder.layers[0].self_attention
        made: dict[str, int] = {}
        split = attn.get_query_key_value_tensors

        def spied(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            q, k, v = split(*args, **kwargs)
            made["packed"] = v.untyped_storage().data_ptr()
            return q, k, v

        attn.get_query_key_value_tensors = spied
        rotated: list[int] = []
        rope = attention_module.apply_rotary_pos_emb

        def rotating(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = rope(*args, **kwargs)
            rotated.append(out.untyped_storage().data_ptr())
            return out

        attention_module.apply_rotary_pos_emb = rotating
        rotary = RotaryEmbedding(kv_channels=16, rotary_percent=1.0)(256)
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(256, 1, 128, requires_grad=True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                attn(x, attention_mask=None, rotary_pos_emb=rotary)
        finally:
            attention_module.apply_rotary_pos_emb = rope
        megatron_peakflat.remove()
    return {"packed": storages.get(made["packed"], 0), "rotated": sum(storages.get(p, 0) for p in set(rotated))}


@pytest.mark.parametrize("min_keys", [1 << 30, 1], ids=["one-call", "per-kv-head-calls"])
@pytest.mark.parametrize("copies", [True, False], ids=["as-run", "views-kept"])
def test_the_local_spec_saves_no_view_of_the_packed_qkv_buffer(min_keys, copies):
    """The local half of ``qkv_buffer_freed``, traced with saved-tensor hooks: peakflat's SDPA attention copies v out
    of the packed QKV output before attending, so what it saves is the rotated q and k and that copy, one SDPA call
    or one per K/V head. Without the copy, v's view keeps the whole buffer (q, k and v) alive beside them."""
    from megatron_peakflat.testing import run_distributed

    got = run_distributed(_saved_by_local_attention, 1, min_keys, copies)[0]
    q, k, v = 256 * 8 * 16 * 4, 256 * 2 * 16 * 4, 256 * 2 * 16 * 4
    assert got == {"packed": 0 if copies else q + k + v, "rotated": q + k}, got


@pytest.mark.parametrize("extra, seq, freed", [
    ((), 65536, True),  # TE's fused RoPE over the whole sequence
    (("--no-rope-fusion",), 65536, True),  # torch's RoPE on TE's layers: TE's layout detection still copies v
    ((), 1 << 20, True),  # past the kernel's 32-bit limit the line runs --no-rope-fusion (recommend, auto)
    (("--transformer-impl local",), 65536, True),  # peakflat's SDPA attention copies v out of the packed buffer
    (("--transformer-impl local", "--peakflat-attention local"), 65536, False),  # Megatron's own keeps the views
    (("--position-embedding-type learned_absolute",), 65536, False),  # TE without RoPE: not measured, counted
])
def test_no_packed_qkv_buffer_in_attentions_backward_where_nothing_saved_views_it(extra, seq, freed):
    """Planned against TE's reach rows (tests/test_planner_measured.py): with the packed buffer's q and k counted,
    the untiled rows read +1.4% to +5.6% at 48K-384K (fused RoPE) and +5.8% at 512K (--no-rope-fusion); without
    them -0.5% to +0.8% and -0.7%, as Megatron's own column reads."""
    from megatron_peakflat.planner import model

    shape, run, _, _, _ = _gqa_plan(seq, *extra)
    assert run.qkv_buffer_freed is freed
    copies = run.tokens * (shape.heads + shape.kv_heads) * shape.head_dim * run.w
    kept = dataclasses.replace(run, qkv_buffer_freed=False)
    assert model.attention_backward_transient(shape, kept) - model.attention_backward_transient(shape, run) == \
        (copies if freed else 0)


@pytest.mark.parametrize("extra, fix", [
    ("--kv-channels 100", "choose --kv-channels a multiple of 8"),
    ("--fp32-placeholder", "add --bf16"),
])
def test_a_line_only_the_unfused_backend_takes_is_refused_under_context_parallelism(capsys, extra, fix):
    """TE's unfused backend does not support context parallelism (get_attention_backend disables it), and flash and
    fused attention do not take the line: TE has no backend for it, so the check and auto refuse it at start-up,
    naming --context-parallel-size and the condition's fix (both had said it fits)."""
    line = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 16384 --max-position-embeddings "
            "16384 --micro-batch-size 1 --vocab-size 32000 --lr 1e-4 --train-iters 10 --bf16 "
            "--no-create-attention-mask-in-dataloader --context-parallel-size 2 " + extra).split()
    if "--fp32-placeholder" in line:
        line = [a for a in line if a not in ("--fp32-placeholder", "--bf16")]
    machine = ["--gpus", "2", "--hbm-gib", "80", "--host-gib", "2048"]
    for auto in ([], ["--peakflat", "auto"]):
        assert check.main([*line, *machine, *auto]) == check.REFUSED
        err = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: "))
        assert "--context-parallel-size=2" in err and "does not support context parallelism" in err and fix in err
    cp1 = [a if a != "2" or line[i - 1] != "--context-parallel-size" else "1" for i, a in enumerate(line)]
    assert check.main([*cp1, "--gpus", "1", "--hbm-gib", "80", "--host-gib", "2048"]) != check.REFUSED
