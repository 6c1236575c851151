"""What the planner assumes Megatron runs is a flag shown in the plan's header, not what the planning machine has
installed: ``--transformer-impl`` from the training line (default Megatron's, transformer_engine) and ``--adam``
(default fused for TE, torch for local). ``--peakflat auto`` runs on the training machine and plans what is
installed there, and says so."""

from __future__ import annotations

import pytest

from megatron_peakflat.planner import megatron_args
from megatron_peakflat.cli.plan import main
from megatron_peakflat.planner.build import build
from megatron_peakflat.planner.model import GIB, plan

OSS120 = ["--preset", "gpt-oss-120b", "--seq-len", "128K", "--gpus", "16", "--hbm-gib", "80", "--host-gib", "2048"]


@pytest.mark.parametrize("installed", [False, True])
def test_the_optimizer_step_does_not_depend_on_what_the_planning_machine_has(monkeypatch, installed):
    monkeypatch.setattr(megatron_args, "fused_adam_importable", lambda: installed)
    shape, run, pf, _, _ = build(OSS120)
    assert run.fused_adam and run.transformer_impl == "transformer_engine"
    assert plan(shape, run, pf).stages[0].rows["optimizer step"].baseline == 0
    shape, run, pf, _, _ = build([*OSS120, "--adam", "torch"])
    assert not run.fused_adam
    assert plan(shape, run, pf).stages[0].rows["optimizer step"].baseline > 20 * GIB  # the fp32 temporary


def test_a_local_line_defaults_to_torch_adam():
    line = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 4096 --vocab-size 32000 --bf16 "
            "--transformer-impl local")
    _, run, _, _, _ = build(["--megatron-args", line, "--gpus", "1"])
    assert run.transformer_impl == "local" and not run.fused_adam
    _, run, _, _, _ = build(["--megatron-args", line, "--gpus", "1", "--adam", "fused"])
    assert run.fused_adam


def test_the_header_shows_the_assumptions(capsys):
    assert main([*OSS120, "--adam", "torch"]) in (0, 3)
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("assumed: --transformer-impl transformer_engine, Adam torch (--adam)"), out[1]


def test_auto_plans_the_adam_installed_on_the_training_machine_and_shows_it(monkeypatch):
    from megatron_peakflat import auto

    line = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 4096 --vocab-size 32000 --bf16 "
            "--num-experts 8 --moe-router-topk 2 --peakflat auto").split()
    for installed, word in ((False, "torch"), (True, "fused")):
        monkeypatch.setattr(megatron_args, "fused_adam_importable", lambda: installed)
        choice = auto.resolve(line, gpus=8, gpus_per_node=8, hbm_bytes=80 * GIB, host_bytes_per_node=2048 * GIB,
                              installed_adam=True)
        assert choice.recommendation.plan.run.fused_adam is installed
        header = choice.table().splitlines()[0]
        assert f"Adam {word} (installed here" in header, header
