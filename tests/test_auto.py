"""``--peakflat auto``: the planner's recommendation for the command line, turned into flags at start-up."""

from __future__ import annotations

import json
import logging
import shlex

import pytest

from megatron_peakflat import auto
from megatron_peakflat.config_base import PeakflatConfigError
from megatron_peakflat.cli.plan import main as plan_main

GIB = 2**30
MODEL = ("--num-layers 2 --hidden-size 2880 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
         "--kv-channels 64 --ffn-hidden-size 2880 --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880 "
         "--swiglu --vocab-size 201088 --untie-embeddings-and-output-weights --micro-batch-size 1 --global-batch-size 1 "
         "--bf16 --moe-token-dispatcher-type alltoall --disable-bias-linear --use-distributed-optimizer "
         "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
OFFLOAD = " --optimizer-cpu-offload --use-precision-aware-optimizer --overlap-cpu-optimizer-d2h-h2d"
LINES = [
    MODEL + " --seq-length 8192",
    MODEL + " --seq-length 131072",
    MODEL + " --seq-length 131072" + OFFLOAD,
    MODEL + " --seq-length 524288" + OFFLOAD,
    MODEL.replace("--num-layers 2", "--num-layers 8") + " --seq-length 65536",
]
MACHINE = {"gpus": 1, "gpus_per_node": 1, "hbm_bytes": 79 * GIB, "host_bytes_per_node": 128 * GIB}


def _groups(flags: list[str]) -> list[tuple[str, ...]]:
    return auto._flag_groups(flags)


def _cli_recommendation(capsys, planner_args: list[str]) -> list[str]:
    rc = plan_main([*planner_args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["recommended"]["fits"]
    return doc["recommended"]["flags"]


@pytest.mark.parametrize("line", LINES, ids=["8K", "128K", "128K-offload", "512K-offload", "8-layers-64K"])
def test_the_choice_is_what_the_planner_cli_recommends_for_that_line(capsys, line):
    argv = shlex.split(line) + ["--peakflat", "auto"]
    choice = auto.resolve(argv, **MACHINE)
    cli_flags = _cli_recommendation(capsys, choice.planner_args)
    # every recommended flag is either added or already on the line as the user wrote it; nothing else is added
    assert sorted(_groups(choice.added) + _groups(choice.kept)) == sorted(_groups(cli_flags))
    given = {a for a in argv if a.startswith("--")}
    assert not {g[0] for g in _groups(choice.added)} & given
    # the planner read the line as written: its --megatron-args is the line without --peakflat auto
    assert choice.planner_args[0].startswith("--megatron-args=")
    assert shlex.split(choice.planner_args[0].split("=", 1)[1]) == shlex.split(line)
    assert choice.planner_args[1:] == ["--gpus", "1", "--gpus-per-node", "1", "--hbm-gib", "79.0", "--host-gib", "128.0",
                                       "--layout", "given"]


def test_a_long_context_turns_on_the_dispatch_and_vocabulary_components():
    choice = auto.resolve(shlex.split(MODEL + " --seq-length 131072"), **MACHINE)
    added = dict((g[0], g[1:]) for g in _groups(choice.added))
    assert added["--peakflat-dispatch"] == ("pipelined-llep",) and added["--peakflat-vocab"] == ("ring-dtp",)
    assert not choice.recommendation.plan.fits("baseline")  # Megatron alone does not fit at 128K on 79 GiB


def test_megatrons_offloaded_optimizer_is_replaced_by_offload_stream_and_its_flags_kept():
    choice = auto.resolve(shlex.split(MODEL + " --seq-length 131072" + OFFLOAD), **MACHINE)
    added = dict((g[0], g[1:]) for g in _groups(choice.added))
    assert added["--peakflat-optimizer"] == ("offload-stream",)
    assert {"--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--use-distributed-optimizer"} <= set(choice.kept)
    assert any("in place of Megatron's offloaded optimizer" in r for r in choice.recommendation.reasons)
    without = auto.resolve(shlex.split(MODEL + " --seq-length 131072"), **MACHINE)
    assert without.recommendation.config.optimizer.impl == "megatron"  # fits with the optimizer on the GPU


def test_explicit_flags_win_over_the_choice():
    line = MODEL + " --seq-length 131072 --peakflat-vocab-block-size 1024 --peakflat-dispatch megatron"
    choice = auto.resolve(shlex.split(line), **MACHINE)
    added = [g[0] for g in _groups(choice.added)]
    assert "--peakflat-vocab-block-size" not in added and "--peakflat-vocab" in added
    assert not any(f.startswith("--peakflat-dispatch") for f in added)  # the user switched PipelinedLLEP off
    assert "--peakflat-dispatch" in choice.kept and "--peakflat-vocab-block-size" in choice.kept
    assert "set on the command line (--peakflat-dispatch megatron)" in choice.table()


@pytest.mark.parametrize("spelling", ["--peakflat-optimizer-bucket", "--peakflat-opt-bucket"])
def test_a_knob_the_line_sets_is_kept_in_its_current_or_former_spelling(spelling):
    """The user's --peakflat-optimizer-bucket, or its former spelling --peakflat-opt-bucket, is the user's own
    setting: auto adds no bucket of its own (which, coming after it, would override it) and reports it kept as
    written."""
    choice = auto.resolve(shlex.split(MODEL + " --seq-length 131072" + OFFLOAD + f" {spelling} 20M"), **MACHINE)
    added = dict((g[0], g[1:]) for g in _groups(choice.added))
    assert added["--peakflat-optimizer"] == ("offload-stream",)
    assert not any("bucket" in f for f in added), added
    assert "--peakflat-optimizer-bucket" in choice.kept
    assert choice.final_config().optimizer.bucket == 20_000_000
    kept = next(ln for ln in choice.table().splitlines() if "(kept as given):" in ln)
    assert kept.endswith(f" {spelling} 20M"), kept


LONG = MODEL.replace("--num-layers 2", "--num-layers 24").replace(" --global-batch-size 1", "") + " --seq-length 524288"
NODE = {"gpus": 8, "gpus_per_node": 8, "hbm_bytes": 80 * GIB, "host_bytes_per_node": 2048 * GIB}


def test_the_plan_is_in_the_lines_own_layout_and_a_layout_that_fits_is_the_fix():
    """auto adds no parallel sizes: it plans the layout Megatron will run, its defaults where the line sets none.
    Where that does not fit and the planner's own layout for these GPUs would, the refusal names that layout."""
    with pytest.raises(PeakflatConfigError) as e:
        auto.resolve(shlex.split(LONG), **NODE)
    assert "nothing fits in this command line's layout (TP1 PP1 CP1 DP8 EP1)" in e.value.problem
    layout = "--tensor-model-parallel-size 1 --context-parallel-size 4 --expert-model-parallel-size 8"
    assert f"or train in a layout that fits on these GPUs: {layout}" in e.value.fix
    with pytest.raises(PeakflatConfigError) as e:  # CP 4 does not divide this sequence: no layout to offer
        auto.resolve(shlex.split(LONG.replace("524288", "524290")), **NODE)
    assert "nothing fits in this command line's layout" in e.value.problem and "layout that fits" not in e.value.fix
    choice = auto.resolve(shlex.split(LONG + " --context-parallel-size 4 --expert-model-parallel-size 8"), **NODE)
    run = choice.recommendation.plan.run
    assert (run.tp, run.pp, run.cp, run.dp, run.ep) == (1, 1, 4, 2, 8) and choice.recommendation.fits
    assert "(TP1 PP1 CP4 DP2 EP8)" in choice.table()
    assert not any(f.endswith("-parallel-size") for f in choice.added)


def test_an_off_switch_on_the_line_wins():
    line = LONG + " --context-parallel-size 4 --expert-model-parallel-size 8"
    assert "--peakflat-sco" in auto.resolve(shlex.split(line), **NODE).added  # the planner wants SCO here
    choice = auto.resolve(shlex.split(line + " --no-peakflat-sco"), **NODE)
    assert not any(f.startswith("--peakflat-sco") for f in choice.added)
    assert "set on the command line (--no-peakflat-sco)" in choice.table()


def test_a_component_switched_by_the_line_keeps_megatrons_flags_as_given():
    """The planner would offload the optimizer at 256K; the line keeps Megatron's optimizer on the GPU
    (``--peakflat-optimizer megatron``): auto adds neither OffloadStreamAdamW's knobs nor the Megatron flags that
    only it needs (``--optimizer-cpu-offload``), and says the line as given is predicted not to fit."""
    line = shlex.split(MODEL + " --seq-length 262144 --peakflat auto")
    assert "--optimizer-cpu-offload" in auto.resolve(line, **MACHINE).added  # the planner's own choice
    choice = auto.resolve([*line, "--peakflat-optimizer", "megatron"], **MACHINE)
    assert not {"--optimizer-cpu-offload", "--use-precision-aware-optimizer"} & set(choice.added), choice.added
    assert not any(f.startswith("--peakflat-optimizer") for f in choice.added)
    table = choice.table()
    assert "set on the command line (--peakflat-optimizer megatron)" in table and "predicted NOT to fit" in table


def test_nothing_fits_is_refused_with_the_planners_reason_and_fix():
    with pytest.raises(PeakflatConfigError) as e:
        auto.resolve(shlex.split(MODEL.replace("--num-layers 2", "--num-layers 24") + " --seq-length 8192"),
                     gpus=1, gpus_per_node=1, hbm_bytes=16 * GIB, host_bytes_per_node=64 * GIB)
    assert e.value.flag == "--peakflat" and e.value.value == "auto"
    assert "nothing fits" in e.value.problem and "fix:" in e.value.problem and "HBM is 16.00 GiB" in e.value.problem
    assert "python -m megatron_peakflat.plan" in e.value.fix


def test_a_line_the_planner_cannot_read_is_refused_naming_the_flag():
    with pytest.raises(PeakflatConfigError) as e:
        auto.resolve(["--num-layers", "2", "--peakflat", "auto"], **MACHINE)
    assert e.value.flag == "--peakflat" and "--hidden-size" in e.value.problem and "--preset" not in str(e.value)
    with pytest.raises(PeakflatConfigError) as e:  # the planner's --ep, in the training line's words
        auto.resolve(shlex.split(MODEL + " --seq-length 8192 --expert-model-parallel-size 8"),
                     **{**MACHINE, "gpus": 6, "gpus_per_node": 6})
    assert "--expert-model-parallel-size=8 EPxETP = 8 does not divide" in e.value.problem
    assert "--ep" not in str(e.value).replace("--ep-", "")


def test_auto_argv_adds_the_flags_and_logs_the_table_once_on_rank_zero(monkeypatch, caplog):
    argv = shlex.split(MODEL + " --seq-length 131072") + ["--peakflat=auto"]
    monkeypatch.setattr(auto, "_machine", lambda: (1, 1, 79 * GIB, 128 * GIB))
    assert auto.auto_argv(argv[:-1]) == argv[:-1]  # no --peakflat auto: unchanged, nothing logged
    for rank, logged in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_peakflat"):
            out = auto.auto_argv(argv)
        assert out[:len(argv)] == argv and "--peakflat-vocab" in out[len(argv):]
        tables = [r.getMessage() for r in caplog.records if r.getMessage().startswith("peakflat auto:")]
        assert len(tables) == int(logged), (rank, tables)
    table = tables[0]
    for name in ("PipelinedLLEP", "Ring-DTP", "SCO", "OffloadStreamAdamW", "predicted peak", "added: "):
        assert name in table
    assert auto.resolved_in_this_process()


def test_wants_auto_reads_the_last_value():
    assert auto.wants_auto(["--peakflat", "auto"]) and auto.wants_auto(["--peakflat=auto"])
    assert not auto.wants_auto(["--peakflat", "auto", "--peakflat", "manual"])
    assert not auto.wants_auto(["--peakflat-sco"])


def test_apply_refuses_an_auto_that_nothing_resolved(monkeypatch):
    import argparse

    import megatron_peakflat

    monkeypatch.setattr(auto, "_resolved", [])
    ns = megatron_peakflat.add_args(argparse.ArgumentParser()).parse_args(["--peakflat", "auto"])
    with pytest.raises(PeakflatConfigError) as e:
        megatron_peakflat.apply(ns)
    assert e.value.flag == "--peakflat" and "auto_argv" in e.value.fix


def test_the_reason_says_when_the_bound_costs_more_than_megatrons_balanced_term():
    from types import SimpleNamespace

    choice = auto.resolve(shlex.split(MODEL + " --seq-length 131072"), **MACHINE)
    rec = choice.recommendation
    assert rec.config.enabled["dispatch"]
    larger, smaller = SimpleNamespace(baseline=0.09, peakflat=0.16), SimpleNamespace(baseline=2.0, peakflat=0.5)
    assert "Megatron's is smaller here with balanced routing" in auto._why("dispatch", rec, None, larger)
    assert auto._why("dispatch", rec, None, smaller) == "bounds this peak at no loss of exactness"


def test_the_tile_is_never_recommended_where_start_up_would_refuse_it():
    """At 896K tokens on one 79 GiB card only the tiled sublayer fits; with Megatron's default dropout (0.1) start-up
    refuses it, so auto refuses the line naming the dropout fix rather than adding a flag that fails at start-up."""
    line = MODEL + " --seq-length 917504" + OFFLOAD
    with pytest.raises(auto.NothingFits) as e:
        auto.resolve(shlex.split(line), **MACHINE)
    assert "--peakflat-tile" in e.value.problem and "--hidden-dropout 0" in e.value.problem
    choice = auto.resolve(shlex.split(line + " --hidden-dropout 0 --attention-dropout 0"), **MACHINE)
    assert "--peakflat-tile" in choice.added
