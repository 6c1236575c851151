"""What a user meets first with the planner, peakflat-check and --peakflat auto: the figures follow the training
line (its tokenizer, its implementation), flags beside a preset keep the preset's settings, the exit status is
the same with and without auto, and every line the tools print says what it is."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_peakflat.planner.cli import build


def _run(argv: list[str]):
    shape, run, pf, ns, _ = build(argv)
    return shape, run


@pytest.mark.parametrize("override, field, value", [
    ("--num-layers 4", "layers", 4),
    ("--num-experts 64", "experts", 64),
    ("--hidden-size 2048 --num-attention-heads 32", "hidden", 2048),
])
def test_a_model_flag_beside_a_preset_keeps_the_presets_other_settings(override, field, value):
    base = ["--preset", "gpt-oss-20b", "--seq-len", "32K", "--gpus", "8", "--hbm-gib", "80", "--host-gib", "2048"]
    shape0, run0 = _run(base)
    shape, run = _run(base + ["--megatron-args", override])
    assert getattr(shape, field) == value
    assert dataclasses.replace(run, fused_adam=run0.fused_adam) == run0  # precision, recompute, optimizer, batches
    assert run.precision == "bf16" and run.recompute == "full" and run.distributed_optimizer
