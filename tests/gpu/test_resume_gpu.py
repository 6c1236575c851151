"""OffloadStreamAdamW through Megatron's distributed checkpoint on one GPU, through Megatron's own pretrain loop.

A tiny MoE GPT with Megatron's DistributedOptimizer under CPU offload (``--peakflat-optimizer
offload-stream``), ``--deterministic-mode``: six iterations straight, then three saved at iteration 3 and
three more after loading it. The first resumed iteration sees the loaded weights, the last one every
moment, master and the step count: both must equal the uninterrupted run's. Megatron logs the middle one
as the mean of the first two resumed iterations (``training_log`` does not reset its loss sums after a
run's first report), which a run that trains exactly reproduces too.

On one H200 (``docs/evidence/resume_gpu.txt``, ``pytest -rP`` prints the losses): straight
5.553538 .. 5.262894; resumed 5.401217, 5.343194 = (5.401217 + 5.285172) / 2, 5.262894.

With Transformer Engine importable the model builds on TE's spec and Megatron's DistributedOptimizer keeps
Adam's step only in its param groups; this test caught the resumed step restarting at 0 there (2x H200 with
TE 2.20.2 built) and passed after the fix (``docs/evidence/te_same_loss.txt``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing.subproc import TINY_GPT_ARGS, logged, run_module, second_resumed_log

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ARGS = [*TINY_GPT_ARGS, "--train-iters", "6", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
        "--deterministic-mode", "--peakflat-optimizer", "offload-stream"]


def _losses(*argv: str) -> list[float]:
    out = run_module("megatron_peakflat.pretrain", *ARGS, *argv, launcher=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return logged(text, "lm loss")


def test_offloaded_optimizer_resumes_on_the_uninterrupted_run(tmp_path):
    straight = _losses()
    _losses("--save", str(tmp_path), "--save-interval", "3", "--exit-interval", "3")
    resumed = _losses("--load", str(tmp_path))
    print(f"straight {straight}\nresumed {resumed}")  # shown by pytest -rP, the figures README cites
    assert len(straight) == 6 and len(resumed) == 3
    assert resumed[0] == straight[3] and resumed[-1] == straight[-1], (straight, resumed)
    assert resumed[1] == pytest.approx(second_resumed_log(straight, 3), abs=2e-6), (straight, resumed)


EVERY = ["--peakflat-dispatch", "pipelined-llep", "--peakflat-vocab", "ring-dtp", "--peakflat-sco"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # the later flags win over ARGS' zeros


def test_every_component_with_dropout_resumes_on_the_uninterrupted_run(tmp_path):
    """All four components and dropout: the resumed iterations draw their masks from the RNG state Megatron's
    checkpoint restored and read the data from the saved position, so the first and the last resumed losses
    equal the uninterrupted run's exactly (the CPU shim cannot show this: its resume redraws other masks)."""
    straight = _losses(*EVERY, *DROPOUT)
    _losses(*EVERY, *DROPOUT, "--save", str(tmp_path), "--save-interval", "3", "--exit-interval", "3")
    resumed = _losses(*EVERY, *DROPOUT, "--load", str(tmp_path))
    print(f"straight {straight}\nresumed {resumed}")  # shown by pytest -rP, the figures README cites
    assert len(straight) == 6 and len(resumed) == 3
    assert resumed[0] == straight[3] and resumed[-1] == straight[-1], (straight, resumed)
