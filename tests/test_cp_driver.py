"""The two-GPU context-parallel runs' driver (``tests/_cp_driver.py``, run on two GPUs by ``tests/gpu/test_cp_gpu.py``)
on two gloo ranks on CPU, tiny shapes, the local spec with the SDPA attention: every component at CP 2 against
Megatron at CP 1 in fp32 and, in bf16, against an fp32 reference no worse than Megatron's own CP 2 path; CP 2 x EP 2
with every token on one expert; and the resume after SIGKILL at CP 2 through the pretrain entry's CPU dry run.
What differs on the GPUs is the device, NCCL and, where it imports, Transformer Engine's layers."""

from __future__ import annotations

import pytest

from megatron_peakflat.testing import run_distributed
from tests import _cp_driver as driver
from tests.conftest import needs_pretrain_entry

CASES = [driver.Case("fp32-local"), driver.Case("bf16-local", dtype="bf16"),
         driver.Case("fp32-cp2xep2-all-tokens-on-one-expert", ep=2, skew=8.0)]


def test_the_cp2_driver_runs_every_component_on_two_gloo_ranks():
    results = run_distributed(driver.rank_main, 2, CASES, True, timeout=600)
    driver.check(results, CASES)


@needs_pretrain_entry
def test_the_cp2_resume_driver_after_sigkill_on_two_gloo_ranks(tmp_path, monkeypatch):
    driver.sigkill_then_resume(tmp_path, monkeypatch, "megatron_peakflat.testing.pretrain_dryrun",
                               driver.resume_args("local", iters=6), saved_at=3, killed_at=5, last=6)
