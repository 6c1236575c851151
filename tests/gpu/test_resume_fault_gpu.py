"""Resume after a fault on one GPU, every component on: ``tests/test_resume_fault.py``'s runs through
``python -m megatron_peakflat.pretrain`` (with the test hooks of ``testing.pretrain_hooks``), one rank.

40 iterations straight; the same command with ``--save --save-interval 20`` SIGKILLed inside the forward of
iteration 25 (``PEAKFLAT_TEST_KILL_AT``); the same command with ``--load``. Iterations 21-40 must equal the
uninterrupted run bit for bit: the loss and grad norm Megatron's ``train_step`` returned (``float.hex``),
the batches read, the samples consumed, and the RNG states Megatron restores, here including the CUDA
generator that dropout draws from (torch's CPU generator is one DataLoader base-seed draw ahead after any
Megatron resume: not compared; ``tests/test_resume_fault.py`` says why).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_peakflat.testing.pretrain_hooks import read_trace
from megatron_peakflat.testing.subproc import TINY_GPT_ARGS
from tests._helpers import run_to_kill_or_end

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GLOBAL_BATCH = 8
ARGS = [*TINY_GPT_ARGS, "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", "40",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
        "--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
        "--peakflat-dispatch", "pipelined-llep", "--peakflat-vocab", "ring-dtp", "--peakflat-sco",
        "--peakflat-optimizer", "offload-stream"]
SAVED_AT, KILLED_AT, LAST = 20, 25, 40
COMPARED_RNG = ("python", "numpy", "cuda", "tracker:model-parallel-rng", "tracker:data-parallel-rng",
                "tracker:expert-parallel-rng")


def _run(monkeypatch: pytest.MonkeyPatch, trace: str, *extra: str, kill_at: int | None = None) -> str:
    return run_to_kill_or_end(monkeypatch, "megatron_peakflat.testing.pretrain_hooks", *ARGS, *extra, trace=trace,
                              kill_at=kill_at, launcher=True, timeout=400)


def test_sigkill_mid_iteration_then_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    save = ("--save", ckpt, "--save-interval", str(SAVED_AT))
    _run(monkeypatch, str(tmp_path / "straight"))
    killed_text = _run(monkeypatch, str(tmp_path / "killed"), *save, kill_at=KILLED_AT)
    assert "Signal 9 (SIGKILL)" in killed_text, killed_text[-4000:]
    with open(tmp_path / "killed" / "killed.rank0") as f:
        assert f.read().startswith(f"iteration {KILLED_AT}, in the forward")
    assert sorted(read_trace(str(tmp_path / "killed"))) == list(range(1, KILLED_AT))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(SAVED_AT)
    _run(monkeypatch, str(tmp_path / "resumed"), *save, "--load", ckpt)

    straight, resumed = read_trace(str(tmp_path / "straight")), read_trace(str(tmp_path / "resumed"))
    assert sorted(straight) == list(range(1, LAST + 1)) and sorted(resumed) == list(range(SAVED_AT + 1, LAST + 1))
    for it in range(SAVED_AT + 1, LAST + 1):
        a, b = straight[it], resumed[it]
        print(it, a["loss"], b["loss"], a["grad_norm"], b["grad_norm"])  # shown by pytest -rP
        assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"], (it, a, b)
        assert b["batches"] == a["batches"] and b["consumed_before"] == a["consumed_before"] == (it - 1) * GLOBAL_BATCH
        assert {k: b["rng"][k] for k in COMPARED_RNG} == {k: a["rng"][k] for k in COMPARED_RNG}, it
