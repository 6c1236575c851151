"""``python -m megatron_peakflat.check``: the one-screen report, and a training command line checked on CPU
(Megatron's own parser and checks, then peakflat's, then the planner), with its exit statuses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_peakflat import _ext
from megatron_peakflat.cli import check
from megatron_peakflat.integration.registry import CHECKED_ON

MODEL = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 8192 --max-position-embeddings 8192 "
         "--micro-batch-size 1 --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 --bf16 "
         "--use-distributed-optimizer --moe-token-dispatcher-type alltoall --disable-bias-linear --lr 1e-4 "
         "--train-iters 10 --no-create-attention-mask-in-dataloader").split()
PEAKFLAT = ["--peakflat-dispatch", "pipelined-llep", "--peakflat-vocab", "ring-dtp"]
FIXED = ["--hbm-gib", "80", "--host-gib", "2048"]


def _error(err: str) -> str:
    """The check's error line (torch may log a notice of its own to stderr first, on its first import)."""
    return next((line for line in err.splitlines() if line.startswith("error: ")), err)


def test_report_fits_one_screen_and_names_each_part(capsys):
    assert check.main([]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 30, out
    for label in ("extension", "Transformer Engine", "apex", "triton", "megatron-core", "GPUs", "host RAM",
                  "PipelinedLLEP", "Ring-DTP", "SCO", "OffloadStream", "attention"):
        assert any(line.lstrip().startswith(label) for line in lines), (label, out)
    mcore = next(line for line in lines if line.startswith("megatron-core"))
    import megatron.core

    installed = megatron.core.__version__.split("+")[0]
    assert installed in mcore
    assert ("checked;" in mcore) == (installed in CHECKED_ON), mcore
    assert "symbols peakflat replaces found" in mcore
    ext = next(line for line in lines if line.startswith("extension"))
    module = _ext.load()
    if module is None:
        assert "MISSING" in ext
    else:
        assert "C++ parts yes" in ext and f"CUDA parts {'yes' if module.with_cuda else 'no'}" in ext


def test_report_says_what_falls_back_when_the_extension_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(_ext, "_state", {"module": None, "source": "missing", "build_log": "x.cpp:1: error: boom",
                                         "reason": "compiling megatron_peakflat._C failed: error: boom"})
    assert check.main([]) == 0
    out = capsys.readouterr().out
    assert "extension          MISSING: compiling megatron_peakflat._C failed: error: boom" in out
    assert _ext.FALLBACKS in out and "x.cpp:1: error: boom" in out
    assert "host Adam step PyTorch" in out


def test_an_accepted_command_line_prints_the_plan_and_fits(capsys):
    assert check.main([*MODEL, *PEAKFLAT, *FIXED]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "validated by Megatron's parse_args and validate_args" in out and "8 GPUs" in out
    assert "components on: dispatch, vocab" in out
    assert "peakflat plan: custom  seq 8,192  GPUs 8 (TP1 PP1 CP1 DP8 EP8)" in out  # the planner's table
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("this command line (dispatch, vocab on):") and verdict.endswith("-> fits"), verdict
    assert "Could not determine rank" not in captured.err  # validate_args's note on the missing process group


def test_the_same_line_on_a_smaller_gpu_does_not_fit(capsys):
    assert check.main([*MODEL, *PEAKFLAT, "--hbm-gib", "4", "--host-gib", "2048"]) == check.DOES_NOT_FIT == 3
    out = capsys.readouterr().out
    assert "of 4 GiB" in out and "-> does NOT fit" in out


def test_a_peakflat_flag_that_start_up_would_refuse_is_refused(capsys):
    assert check.main([*MODEL, *PEAKFLAT, "--peakflat-dispatch-chunk-cap", "0", *FIXED]) == check.REFUSED == 2
    captured = capsys.readouterr()
    assert _error(captured.err).startswith("error: --peakflat-dispatch-chunk-cap=0") and "Fix:" in captured.err
    assert "peakflat plan:" not in captured.out


def test_a_peakflat_flag_is_checked_against_the_megatron_flags(capsys):
    dense = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 8192 --max-position-embeddings "
             "8192 --micro-batch-size 1 --bf16 --lr 1e-4 --train-iters 10").split()
    assert check.main([*dense, "--peakflat-dispatch", "pipelined-llep", *FIXED]) == 2
    err = capsys.readouterr().err
    assert "--peakflat-dispatch" in err and "no MoE layers" in err


def test_megatrons_argument_errors_come_through_with_a_short_usage(capsys):
    assert check.main([*MODEL, "--no-such-flag", *FIXED]) == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: --no-such-flag" in err
    assert "usage: python -m megatron_peakflat.check <Megatron flags>" in err
    assert len(err.strip().splitlines()) <= 3 and "--num-layers" not in err, err  # not every flag of Megatron's


def test_megatrons_own_checks_come_through_as_they_are(capsys):
    # 3 GPUs do not divide into TP 2: Megatron's validate_args refuses it with its own words
    assert check.main([*MODEL, "--tensor-model-parallel-size", "2", "--gpus", "3", *FIXED]) == 2
    err = capsys.readouterr().err
    assert _error(err).startswith("error: Megatron refused the command line: AssertionError: ")
    assert "world size (3) is not divisible by" in err


def test_a_line_without_components_says_what_still_changes(capsys, monkeypatch):
    """Without Transformer Engine, --peakflat-attention auto puts SDPA in Megatron's local spec: the check says so
    rather than 'Megatron runs unchanged', and says 'unchanged' where it is."""
    from megatron_peakflat.integration import attention

    for te, words in ((False, "components on: none (Megatron runs with its local spec's core attention on torch's "
                              "SDPA"), (True, "components on: none (Megatron runs unchanged)")):
        monkeypatch.setattr(attention, "transformer_engine_available", lambda te=te: te)
        assert check.main([*MODEL, "--transformer-impl", "local", *FIXED]) == 0
        assert words in capsys.readouterr().out


def test_a_bare_megatron_assert_names_its_line(capsys):
    # Megatron asserts args.micro_batch_size with no message: the error says which check it was
    line = [a for a in MODEL if a not in ("--micro-batch-size", "1")]
    assert line == MODEL[:10] + MODEL[12:]
    assert check.main([*line, *FIXED]) == 2
    err = _error(capsys.readouterr().err)
    assert "micro_batch_size is not None (arguments.py:" in err, err


@pytest.mark.parametrize("flag, value", [("--gpus", "0"), ("--gpus", "-8"), ("--gpus-per-node", "0"),
                                         ("--hbm-gib", "nan"), ("--host-gib", "-1")])
def test_the_checks_own_sizes_are_refused_when_not_positive(capsys, flag, value):
    fixed = [a for i, a in enumerate(FIXED) if flag not in (a, FIXED[i - 1] if i else None)]
    assert check.main([*MODEL, *fixed, flag, value]) == 2
    err = _error(capsys.readouterr().err)
    assert err.startswith(f"error: {flag}=") and "must be a positive number" in err, err


def test_a_check_that_reads_the_ranks_per_host_sees_gpus_per_node(capsys):
    # the copy engines need an EP group on one host: start-up refuses EP 16 over nodes of 8 (LOCAL_WORLD_SIZE)
    line = [*MODEL, "--expert-model-parallel-size", "16", "--num-experts", "16", *PEAKFLAT,
            "--peakflat-dispatch-transport", "copy-engine", *FIXED]
    assert check.main([*line, "--gpus", "16", "--gpus-per-node", "8"]) == 2
    assert "is more than the 8 ranks per host" in _error(capsys.readouterr().err)
    assert check.main([*line, "--gpus", "16", "--gpus-per-node", "16"]) in (0, 3)


def test_tensor_parallel_lines_validate_without_a_gpu(capsys):
    """validate_args asks a GPU's architecture (and the job's CUDA_DEVICE_MAX_CONNECTIONS) at TP > 1: answered as
    on a Hopper GPU for the call, then restored."""
    import os

    import torch

    before = (torch.cuda.get_device_capability, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    line = [*MODEL, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--gpus", "16", *FIXED]
    assert check.main(line) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "TP2" in out and "16 GPUs" in out
    assert (torch.cuda.get_device_capability, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")) == before


def test_without_megatron_training_the_planners_parser_checks_the_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", None)  # import fails
    assert check.main([*MODEL, *PEAKFLAT, *FIXED]) == 0
    out = capsys.readouterr().out
    assert "megatron.training is not importable here" in out
    unknown = out.split("unknown flags: ")[1].split(";")[0].split()
    assert "--lr" in unknown and "--train-iters" in unknown and "--num-layers" not in unknown
    assert out.strip().splitlines()[-1].endswith("-> fits")
    assert check.main([*MODEL, *PEAKFLAT, "--peakflat-dispatch-chunk-cap", "0", *FIXED]) == 2


def test_the_smallest_world_lets_ep_divide_the_data_parallel_ranks():
    from argparse import Namespace

    assert check._smallest_world(Namespace(expert_model_parallel_size=8)) == 8
    assert check._smallest_world(Namespace(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                                           expert_tensor_parallel_size=1, pipeline_model_parallel_size=2)) == 8
    assert check._smallest_world(Namespace(context_parallel_size=4)) == 4


def test_the_module_and_its_exit_status_from_a_shell():
    out = subprocess.run([sys.executable, "-m", "megatron_peakflat.check", *MODEL, *PEAKFLAT, "--hbm-gib", "4",
                          "--host-gib", "2048"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, (out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "-> does NOT fit" in out.stdout


def test_peakflat_auto_is_resolved_for_the_gpus_given_then_checked(capsys, monkeypatch):
    from megatron_peakflat import auto

    monkeypatch.setattr(auto, "_resolved", [])
    assert check.main([*MODEL, "--peakflat", "auto", "--hbm-gib", "40", "--host-gib", "2048"]) == 0
    out = capsys.readouterr().out
    assert "peakflat auto: planned for 8 GPU(s) of 40.0 GiB" in out
    added = next(line for line in out.splitlines() if line.startswith("  added: "))
    assert "--peakflat-dispatch pipelined-llep" in added  # what training start-up would add, then checked
    assert "components on: dispatch" in out and out.strip().splitlines()[-1].endswith("-> fits")
    # where nothing fits, auto refuses at start-up: so does the check, with the status of a line that does not fit
    assert check.main([*MODEL, "--peakflat", "auto", "--hbm-gib", "1", "--host-gib", "2048"]) == check.DOES_NOT_FIT
    assert _error(capsys.readouterr().err).startswith("error: --peakflat='auto': nothing fits")


@pytest.mark.parametrize("refused, named", [(["--fp16"], "--fp16"), (["--global-batch-size", "3"], "global")],
                         ids=["fp16-and-bf16", "batch"])
def test_a_line_megatron_refuses_exits_2_with_auto_too_even_where_nothing_fits(capsys, refused, named):
    """Exit statuses do not depend on --peakflat auto: a line that Megatron's own checks refuse is refused (2),
    not 'does not fit' (3), though auto, which runs first, would find nothing that fits on 1 GiB; the error names
    the flag (Megatron's check without auto, the planner's with it, which reads the line first)."""
    tight = [*MODEL, *refused, "--hbm-gib", "1", "--host-gib", "2048"]
    assert check.main(tight) == check.REFUSED
    assert "Megatron refused the command line" in capsys.readouterr().err
    assert check.main([*tight, "--peakflat", "auto"]) == check.REFUSED
    assert named in capsys.readouterr().err
    assert check.main([*MODEL, "--peakflat", "auto", "--hbm-gib", "1", "--host-gib", "2048"]) == check.DOES_NOT_FIT


# ---- what the planner recommends passes the check -----------------------------------------------

def _preset_line(name: str, seq: int) -> list[str]:
    """A Megatron command line of a preset's model with the settings it assumes (bf16, full recompute, the
    distributed optimizer), RoPE, and the alltoall dispatcher."""
    from megatron_peakflat.planner.shapes import preset

    s = preset(name)
    return (f"--num-layers {s.layers} --hidden-size {s.hidden} --num-attention-heads {s.heads} --group-query-attention "
            f"--num-query-groups {s.kv_heads} --kv-channels {s.head_dim} --ffn-hidden-size {s.ffn} "
            f"--num-experts {s.experts} --moe-router-topk {s.topk} --moe-ffn-hidden-size {s.moe_ffn} "
            f"--vocab-size {s.vocab} --swiglu {'' if s.tied_embeddings else '--untie-embeddings-and-output-weights'} "
            f"--position-embedding-type rope --bf16 --micro-batch-size 1 --seq-length {seq} "
            f"--max-position-embeddings {seq} --lr 1e-4 --train-iters 10 --use-distributed-optimizer "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--moe-token-dispatcher-type alltoall --disable-bias-linear").split()


@pytest.mark.parametrize("name, seq, gpus, hbm, extra", [
    ("gpt-oss-20b", 32768, 8, 80, []),
    ("gpt-oss-20b", 131072, 8, 80, []),  # the README's quick start: the dataloader's mask
    ("gpt-oss-20b", 458752, 8, 141, ["--cp", "1"]),  # past TE's fused RoPE limit
    ("gpt-oss-120b", 131072, 16, 80, []),
])
def test_a_recommended_line_passes_the_check(capsys, name, seq, gpus, hbm, extra):
    from megatron_peakflat.planner.build import build
    from megatron_peakflat.planner.recommend import recommend

    machine = ["--gpus", str(gpus), "--hbm-gib", str(hbm), "--host-gib", "2048"]
    shape, run, pf, ns, _ = build(["--preset", name, "--seq-len", str(seq), *machine, *extra])
    rec = recommend(shape, run, pf, ns.megatron_namespace)
    assert rec.fits
    assert check.main([*_preset_line(name, seq), *rec.layout_flags, *rec.flags, *machine]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("-> fits")


def test_a_recommendation_that_counts_full_recompute_says_so_and_passes_the_check(capsys):
    """A line without recompute, planned with ``--recompute full``: where SCO stays off, the recompute flags are
    still among the flags to add (Megatron's default keeps every layer's activations), and the line with them fits
    in the check as it did in the plan."""
    from megatron_peakflat.planner.build import build
    from megatron_peakflat.planner.recommend import recommend

    line = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 1024 --num-experts 64 "
            "--moe-router-topk 8 --moe-ffn-hidden-size 1024 --swiglu --normalization RMSNorm "
            "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
            "--vocab-size 50304 --seq-length 131072 --max-position-embeddings 131072 --micro-batch-size 1 "
            "--global-batch-size 8 --bf16 --expert-model-parallel-size 8 --use-distributed-optimizer "
            "--moe-token-dispatcher-type alltoall --lr 1e-4 --train-iters 10")
    machine = ["--gpus", "8", "--hbm-gib", "80", "--host-gib", "2048"]
    shape, run, pf, ns, _ = build(["--megatron-args", line, "--recompute", "full", "--layout", "given", *machine])
    rec = recommend(shape, run, pf, ns.megatron_namespace)
    assert rec.fits and not rec.config.sco.enabled and run.recompute == "full"
    i = rec.flags.index("--recompute-granularity")
    assert rec.flags[i:i + 6] == ["--recompute-granularity", "full", "--recompute-method", run.recompute_method,
                                  "--recompute-num-layers", str(run.recompute_num_layers)]
    assert any(r.startswith("--recompute-granularity full:") for r in rec.reasons)
    assert check.main([*line.split(), *rec.layout_flags, *rec.flags, *machine]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("-> fits")
    # without them the same line keeps every layer's activations: the check says it does not fit
    without = [f for f in rec.flags[:i]] + rec.flags[i + 6:]
    assert check.main([*line.split(), *rec.layout_flags, *without, *machine]) == check.DOES_NOT_FIT


def test_auto_completes_a_long_line_so_that_it_passes_the_check(capsys, monkeypatch):
    from megatron_peakflat import auto

    monkeypatch.setattr(auto, "_resolved", [])
    line = _preset_line("gpt-oss-20b", 131072)  # Megatron's dataloader mask left on, as it is by default
    machine = ["--gpus", "8", "--hbm-gib", "80", "--host-gib", "2048", "--expert-model-parallel-size", "8"]
    assert check.main([*line, "--peakflat", "auto", *machine]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    added = next(ln for ln in out.splitlines() if ln.startswith("  added: "))
    assert "--no-create-attention-mask-in-dataloader" in added


def test_the_closing_line_agrees_with_the_fixes_offered(capsys):
    """Where the line does not fit without recompute and does with full recompute on the same GPUs, the check
    says so and gives the flags, never that more GPUs are needed; those flags pass the check."""
    line = ("--num-layers 16 --hidden-size 1024 --num-attention-heads 8 --seq-length 32768 --max-position-embeddings "
            "32768 --micro-batch-size 1 --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 --bf16 "
            "--use-distributed-optimizer --moe-token-dispatcher-type alltoall --disable-bias-linear --lr 1e-4 "
            "--train-iters 10 --no-create-attention-mask-in-dataloader --peakflat-dispatch pipelined-llep").split()
    machine = ["--hbm-gib", "8", "--host-gib", "2048"]
    assert check.main([*line, *machine]) == check.DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "fix: turn on --recompute-granularity full" in out
    closing = out.strip().splitlines()[-1]
    assert "more GPUs, or more memory per GPU, are needed" not in out
    prefix = "  nothing fits with this line's recompute; with --recompute-granularity full it fits on the same GPUs: "
    assert closing.startswith(prefix), closing
    flags = closing[len(prefix):].split()
    assert check.main([*[w for w in line if w != "--peakflat-dispatch" and w != "pipelined-llep"], *flags,
                       *machine]) == 0
    # where full recompute does not fit either, the closing line points at the fixes that change the GPUs
    assert check.main([*line, "--hbm-gib", "2", "--host-gib", "2048"]) == check.DOES_NOT_FIT
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert "full recompute included" in closing and "'why' lines" in closing
