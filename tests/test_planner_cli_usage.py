"""The planner's command line as a user meets it: lengths with units, exit statuses, --plot without matplotlib,
a closed pipe, and short usage on argument errors."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from megatron_peakflat.cli import plan as cli
from megatron_peakflat.cli.plan import NOTHING_FITS, main
from megatron_peakflat.planner import report
from megatron_peakflat.planner.build import build, token_count

FIXED = ["--hbm-gib", "80", "--host-gib", "2048"]  # no dependence on this machine's GPU or RAM


@pytest.mark.parametrize("text, tokens", [("131072", 131072), ("128K", 131072), ("128k", 131072), ("1M", 1 << 20),
                                          ("1m", 1 << 20), ("0.5M", 1 << 19), ("2G", 2 << 30), (" 64K ", 65536)])
def test_token_counts_take_binary_units(text, tokens):
    assert token_count(text) == tokens


@pytest.mark.parametrize("text", ["1X", "K", "1.3K", "--4K", "1MiB", "", "1e6"])
def test_a_token_count_that_is_not_one_is_refused_with_the_accepted_forms(text):
    with pytest.raises(argparse.ArgumentTypeError, match="128K or 1M"):
        token_count(text)


def test_a_count_below_one_is_refused_by_the_planner_with_the_fix(capsys):
    assert main(["--preset", "gpt-oss-120b", "--seq-len=-4K", *FIXED]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--seq-len" in err and "-4096" in err and "Fix:" in err


def test_seq_len_with_units_plans_the_same_run_as_the_integer():
    _, run_units, *_ = build(["--preset", "gpt-oss-120b", "--seq-len", "1M", "--gpus", "16", *FIXED])
    _, run_int, *_ = build(["--preset", "gpt-oss-120b", "--seq-len", "1048576", "--gpus", "16", *FIXED])
    assert run_units == run_int and run_units.seq_len == 1048576


def test_megatron_args_keep_megatrons_own_integer_spelling(capsys):
    """--megatron-args holds Megatron's flags, parsed as Megatron parses them: --seq-length 1M is not a number there."""
    flags = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 1M"
    with pytest.raises(SystemExit) as e:
        build(["--megatron-args", flags, "--gpus", "1", *FIXED])
    assert e.value.code == 2 and "--seq-length" in capsys.readouterr().err


def test_exit_status_says_whether_anything_fits(capsys):
    fits = main(["--preset", "gpt-oss-120b", "--seq-len", "1M", "--gpus", "16", *FIXED])
    assert fits == 0 and "does NOT fit" not in capsys.readouterr().out.split("recommended")[1].splitlines()[0]
    assert main(["--preset", "deepseek-v3", "--seq-len", "1M", "--gpus", "8", "--hbm-gib", "80",
                 "--host-gib", "256"]) == NOTHING_FITS == 3
    assert "recommended: nothing fits" in capsys.readouterr().out
    # --json says the same through the status
    assert main(["--preset", "deepseek-v3", "--seq-len", "1M", "--gpus", "8", "--hbm-gib", "80", "--host-gib", "256",
                 "--json"]) == 3


def test_argument_errors_give_a_short_usage_not_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        build(["--preset", "gpt-oss-120b", "--seq-len", "lots"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "error: argument --seq-len: 'lots' is not a number of tokens" in err
    assert len(err.splitlines()) <= 4, err  # argparse's own usage listed every flag: 50 lines
    assert "--help" in err and "--peakflat-dispatch-chunk-cap" not in err
    with pytest.raises(SystemExit):
        build(["--preset", "gpt-oss-120b", "--no-such-flag"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err and len(err.splitlines()) <= 4


def test_help_still_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        build(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--seq-len" in out and "--peakflat-dispatch-chunk-cap" in out


def test_plot_without_matplotlib_is_refused_before_planning(monkeypatch, capsys, tmp_path):
    planned = []
    monkeypatch.setattr(cli, "plot_available", lambda: False)
    monkeypatch.setattr(cli, "plan", lambda *a, **k: planned.append(a))
    out = tmp_path / "peaks.png"
    assert main(["--preset", "gpt-oss-20b", "--seq-len", "64K", "--plot", str(out), *FIXED]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not planned and not out.exists()
    assert captured.err.startswith("error: ") and "--plot" in captured.err and "matplotlib" in captured.err
    assert "pip install 'megatron-peakflat[plot]'" in captured.err


def test_plot_availability_is_read_without_importing_matplotlib():
    code = ("import sys; from megatron_peakflat.planner import report; "
            "print(report.plot_available(), 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    have = __import__("importlib").util.find_spec("matplotlib") is not None
    assert out.stdout.split() == [str(have), "False"]


def test_the_figure_shows_each_columns_total(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    shown: dict[str, list] = {"ticks": [], "labels": [], "bars": []}
    real_ticks, real_annotate, real_bar = (matplotlib.axes.Axes.set_xticks, matplotlib.axes.Axes.annotate,
                                           matplotlib.axes.Axes.bar)

    def set_xticks(self, ticks, labels=None, **kw):
        shown["ticks"].append(list(labels or []))
        return real_ticks(self, ticks, labels, **kw)

    def annotate(self, text, *a, **kw):
        shown["labels"].append(text)
        return real_annotate(self, text, *a, **kw)

    def bar(self, x, height, *a, **kw):
        shown["bars"].append(list(height))
        return real_bar(self, x, height, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", set_xticks)
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", annotate)
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    shape, run, pf, _, _ = build(["--preset", "gpt-oss-120b", "--seq-len", "1M", "--gpus", "16", *FIXED])
    pl = cli.plan(shape, run, pf)
    st = pl.worst("baseline")
    out = tmp_path / "peaks.png"
    report.plot(pl, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shown["ticks"][-1][-1] == "total (peak)"
    totals = (st.total("baseline") / report.GIB, st.total("peakflat") / report.GIB)
    assert [b[-1] for b in shown["bars"]] == pytest.approx(list(totals))
    assert shown["labels"] == [f"{t:.1f}" for t in totals]


def _shell(command: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("reader, lines", [("true", 0), ("head -1", 1)])
def test_a_closed_pipe_ends_the_output_without_a_traceback(unbuffered, reader, lines):
    """``true`` closes the pipe before the planner (a second of start-up) writes anything, so every write meets a
    closed pipe: the failure, with either buffering, was a BrokenPipeError traceback or 'Exception ignored'."""
    prefix = "PYTHONUNBUFFERED=1 " if unbuffered else ""
    for fmt in ("", "--json"):
        out = _shell(f"{prefix}{sys.executable} -m megatron_peakflat.plan --preset gpt-oss-120b --seq-len 1M "
                     f"--gpus 16 --hbm-gib 80 --host-gib 2048 {fmt} | {reader}; echo \"status ${{PIPESTATUS[0]}}\"")
        assert out.stdout.count("\n") == lines + 1 and out.stdout.endswith("status 0\n"), out.stdout
        assert out.stderr == "", out.stderr


@pytest.mark.parametrize("extra, named", [
    ("--num-attention-heads 0", "--num-attention-heads: 0 is not an integer >= 1"),
    ("--make-vocab-size-divisible-by 0", "--make-vocab-size-divisible-by: 0 is not an integer >= 1"),
    ("--moe-shared-expert-intermediate-size -5", "--moe-shared-expert-intermediate-size: -5 is not an integer >= 0"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
     "--num-layers-per-virtual-pipeline-stage=3: does not divide the 4 layers of a pipeline stage"),
])
def test_a_size_the_model_cannot_have_exits_2_naming_the_flag(capsys, extra, named):
    """Zero or negative sizes, and a layout refused only once the layers are laid out, are refused (exit 2) by
    name, never a traceback."""
    from megatron_peakflat.cli.plan import main

    line = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --num-experts 8 --moe-router-topk 2 "
            "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --bf16 " + extra)
    try:
        rc = main(["--megatron-args", line, "--gpus", "2"])
    except SystemExit as e:  # argparse's refusal of the value
        rc = e.code
    assert rc == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("layout, gpus", [
    ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 "
     "--expert-model-parallel-size 8", 8),  # DP 8 for EP 8
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 1 "
     "--expert-model-parallel-size 4", 16),  # EP 4 x ETP 2 (ETP is TP unless given) divides TP 2 x DP 4
    ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --context-parallel-size 1", 4),
])
def test_without_gpus_the_world_is_the_smallest_the_lines_layout_takes(layout, gpus):
    """The planner and peakflat-check take the same world for a line without --gpus: the fewest GPUs that its
    TP, PP and CP and a data-parallel size that EP x ETP divides make."""
    from megatron_peakflat.cli.check import _smallest_world
    from megatron_peakflat.planner.megatron_args import megatron_parser

    line = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --num-experts 8 --moe-router-topk 2 "
            "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --bf16 --sequence-parallel " + layout)
    _, run, _, _, _ = build(["--megatron-args", line])
    assert run.tp * run.pp * run.cp * run.dp == gpus == _smallest_world(megatron_parser().parse_known_args(line.split())[0])


def test_a_fix_never_asks_for_more_expert_parallelism_than_experts(capsys):
    """Where EP already equals the expert count, the fixes for the weight rows name PP and ETP, not EP."""
    line = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
            "--kv-channels 128 --ffn-hidden-size 14336 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 14336 "
            "--swiglu --vocab-size 32000 --untie-embeddings-and-output-weights --seq-length 32768 "
            "--max-position-embeddings 32768 --micro-batch-size 1 --bf16 --expert-model-parallel-size {ep} "
            "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1 --disable-bias-linear")
    for ep, raise_ep in ((8, False), (4, True)):
        assert main(["--megatron-args", line.format(ep=ep), "--gpus", "8", "--hbm-gib", "40"]) == NOTHING_FITS
        fixes = [ln for ln in capsys.readouterr().out.splitlines() if ln.lstrip().startswith("why: gradients")]
        assert fixes and all(("--expert-model-parallel-size" in ln) is raise_ep for ln in fixes), fixes
        assert raise_ep or all("EP is already the 8 experts" in ln for ln in fixes)


def test_the_json_block_size_is_the_one_in_the_flags(capsys):
    """The recommendation's JSON names Ring-DTP's block as its flags do (the planner's own where none is set)."""
    import json

    assert main(["--preset", "gpt-oss-20b", "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommended"]
    flags = rec["flags"]
    assert rec["vocab_block_size"] == int(flags[flags.index("--peakflat-vocab-block-size") + 1]) > 0


def test_an_error_about_a_megatron_args_value_names_the_megatron_flag(capsys):
    """A value read from --megatron-args is refused under the flag the user wrote (--expert-model-parallel-size),
    a planner flag passed as such under its own name (--ep)."""
    line = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --num-experts 8 --moe-router-topk 2 "
            "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --bf16 ")
    assert main(["--megatron-args", line + "--expert-model-parallel-size 3", "--gpus", "6"]) == 2
    err = capsys.readouterr().err
    assert "error: --expert-model-parallel-size=3: does not divide the 8 experts" in err and "--ep" not in err
    assert main(["--megatron-args", line, "--ep", "3", "--gpus", "6"]) == 2
    assert "error: --ep=3: does not divide the 8 experts" in capsys.readouterr().err


def _dense_line(layers: int, extra: str) -> str:
    """A small dense bf16 model's Megatron line at 4K tokens, with ``extra`` appended."""
    return (f"--num-layers {layers} --hidden-size 1024 --num-attention-heads 8 --seq-length 4096 "
            f"--max-position-embeddings 4096 --micro-batch-size 1 --bf16 {extra}")


@pytest.mark.parametrize("flags, source", [
    ("", "GPT-2's vocabulary (Megatron's default tokenizer, GPT2BPETokenizer)"),
    ("--tokenizer-type NullTokenizer --vocab-size 32000", "the tokenizer (NullTokenizer)"),
    ("--padded-vocab-size 65536", "--padded-vocab-size"),
])
def test_the_header_says_where_the_vocabulary_came_from(capsys, flags, source):
    """The vocabulary term grows with the vocabulary, so the header names its source (never silent)."""
    line = _dense_line(2, flags)
    assert main(["--megatron-args", line, "--gpus", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.startswith("assumed: ") and header.endswith(f"as padded (from {source})"), header


@pytest.mark.parametrize("extra, named", [
    ("--fp16", "--fp16=True: is given with --bf16"),
    ("--global-batch-size 3", "--global-batch-size=3: is not a multiple of micro-batch 1 x DP 2"),
])
def test_a_line_megatron_would_refuse_is_refused_by_the_planner_too(capsys, extra, named):
    """The planner no longer plans (or recommends a layout for) a line whose Megatron run would stop at start-up."""
    line = _dense_line(8, extra)
    assert main(["--megatron-args", line, "--gpus", "2"]) == 2
    assert named in capsys.readouterr().err
    assert main(["--megatron-args", line.replace(extra, ""), "--gpus", "2"]) == 0


def test_a_preset_recommendation_says_what_a_default_megatron_line_also_needs(capsys):
    """A preset's model has no biases, no dropout and the alltoall dispatcher; the recommendation names what the user's own line needs for
    each recommended component to start where it keeps Megatron's defaults, and a line that already says so
    (a command line, not a preset) is told nothing."""
    assert main(["--preset", "gpt-oss-20b", "--seq-len", "1M", "--gpus", "1", "--megatron-args", "--num-layers 2"]) == 0
    why = [ln for ln in capsys.readouterr().out.splitlines() if "on your own line" in ln]
    assert any(ln.strip().startswith("why: PipelinedLLEP") and "--disable-bias-linear" in ln
               and "--moe-token-dispatcher-type alltoall" in ln for ln in why), why
    assert any(ln.strip().startswith("why: TiledAttention") and "--hidden-dropout 0 --attention-dropout 0" in ln
               for ln in why), why
    line = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --num-experts 8 --moe-router-topk 2 "
            "--seq-length 65536 --max-position-embeddings 65536 --micro-batch-size 1 --bf16 --disable-bias-linear")
    assert main(["--megatron-args", line, "--gpus", "1"]) == 0
    assert "on your own line" not in capsys.readouterr().out


def test_a_length_planned_over_the_lines_own_is_among_the_flags_to_add(capsys):
    """--seq-len over a line's --seq-length: the recommended flags carry the planned length (and a
    --max-position-embeddings that admits it), so that the line they complete runs the length planned; a line
    whose --max-position-embeddings is below its own --seq-length is refused, as Megatron refuses it."""
    import json

    line = _dense_line(2, "")
    assert main(["--megatron-args", line, "--seq-len", "64K", "--gpus", "1", "--json"]) == 0
    flags = json.loads(capsys.readouterr().out)["recommended"]["flags"]
    assert flags[flags.index("--seq-length") + 1] == flags[flags.index("--max-position-embeddings") + 1] == "65536"
    assert main(["--megatron-args", line, "--gpus", "1", "--json"]) == 0
    assert "--seq-length" not in json.loads(capsys.readouterr().out)["recommended"]["flags"]
    assert main(["--megatron-args", line.replace("--max-position-embeddings 4096", "--max-position-embeddings 2048"),
                 "--gpus", "1"]) == 2
    assert "--max-position-embeddings=2048: is below --seq-length 4096" in capsys.readouterr().err


def test_heads_that_do_not_divide_the_hidden_size_are_refused_without_kv_channels(capsys):
    """Megatron takes the head dim as hidden / heads unless --kv-channels sets it, and refuses a remainder."""
    line = _dense_line(2, "").replace("--num-attention-heads 8", "--num-attention-heads 7")
    assert main(["--megatron-args", line, "--gpus", "1"]) == 2
    assert "--num-attention-heads=7: does not divide --hidden-size 1024" in capsys.readouterr().err
    assert main(["--megatron-args", line + " --kv-channels 128", "--gpus", "1"]) == 0


def test_sequence_parallelism_is_the_lines_own_and_megatrons_moe_refusal_without_it_is_the_planners():
    """A Megatron line at TP > 1 runs sequence parallelism only where it says --sequence-parallel (Megatron's default
    is off): without it each TP rank holds every token's activations, and a MoE line is refused as Megatron's MoE
    layer refuses it at its first training step."""
    dense = ("--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 14336 --seq-length 131072 "
             "--max-position-embeddings 131072 --micro-batch-size 1 --bf16 --vocab-size 32000 "
             "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
             "--tensor-model-parallel-size 4")
    _, off, _, _, _ = build(["--megatron-args", dense, "--gpus", "4"])
    _, on, _, _, _ = build(["--megatron-args", dense + " --sequence-parallel", "--gpus", "4"])
    assert not off.sp and on.sp and off.layer_rows == 4 * on.layer_rows
    moe = dense + " --num-experts 8 --moe-router-topk 2"
    assert main(["--megatron-args", moe, "--gpus", "4"]) == 2
    with pytest.raises(Exception) as e:
        build(["--megatron-args", moe, "--gpus", "4"])
    assert "add --sequence-parallel" in str(e.value) and "--tensor-model-parallel-size" in str(e.value)
    assert main(["--megatron-args", moe + " --sequence-parallel", "--gpus", "4"]) in (0, 3)
