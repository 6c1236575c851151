"""Context parallelism on two GPUs (NCCL), every component on: ``tests/_cp_driver.py``'s comparisons at CP 2 and its
resume after SIGKILL at CP 2, the driver that ``tests/test_cp_driver.py`` runs on two gloo ranks on CPU.

- fp32 (TF32 off), the local spec with the SDPA attention: the loss, every parameter's gradient and every parameter
  after the step against unpatched Megatron at CP 1 on the same tokens, within DESIGN.md's 1e-5.
- bf16, on Transformer Engine's layers where TE imports (its CP attention, ``cp_comm_type`` p2p) and on the local spec
  with the SDPA attention: against an fp32 reference at CP 1 on the same (bf16-rounded) weights, the loss and every
  parameter's gradient no further from it than Megatron's own CP 2 path in bf16, plus one bf16 epsilon.
- CP 2 x EP 2 with every token on one expert (fp32, local spec, whose CPU-initialised experts are EP 1's).
- SIGKILL inside an iteration's forward at CP 2 (``python -m megatron_peakflat.testing.pretrain_hooks`` under torchrun,
  two ranks), then a resume from the checkpoint: every later iteration bit for bit as the uninterrupted run's,
  the CUDA generator's state included.

fp32 on TE's layers is not a case: TE's attention under CP runs only its flash and fused kernels, which take bf16 and
fp16; its unfused fp32 attention has no CP. Each case is its own ``run_distributed`` launch, so one failure names
itself.
"""

from __future__ import annotations

import pytest

from megatron_peakflat.testing import run_distributed
from tests import _cp_driver as driver
from tests.conftest import needs_pretrain_entry

pytestmark = driver.needs_two_gpus("the same driver runs on two gloo ranks on CPU: tests/test_cp_driver.py")
needs_te = driver.needs_te

CASES = {
    "fp32-local": driver.Case("fp32-local", dtype="fp32", spec="local"),
    "bf16-local": driver.Case("bf16-local", dtype="bf16", spec="local"),
    "bf16-te": driver.Case("bf16-te", dtype="bf16", spec="te", seq=64),
    "fp32-cp2xep2-all-tokens-on-one-expert": driver.Case("fp32-cp2xep2-all-tokens-on-one-expert", ep=2, skew=8.0),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_te) if CASES[n].spec == "te" else n for n in CASES])
def test_every_component_at_cp2_on_two_gpus(name):
    case = CASES[name]
    results = run_distributed(driver.rank_main, 2, [case], False, backend="nccl", timeout=900)
    driver.check(results, [case])


@needs_pretrain_entry
@pytest.mark.parametrize("spec", [pytest.param("te", marks=needs_te), "local"])
def test_sigkill_mid_iteration_at_cp2_then_resume_equals_the_uninterrupted_run_bit_for_bit(spec, tmp_path, monkeypatch):
    driver.sigkill_then_resume(tmp_path, monkeypatch, "megatron_peakflat.testing.pretrain_hooks",
                               [*driver.resume_args(spec, iters=40), *(["--bf16"] if spec == "te" else [])],
                               saved_at=20, killed_at=25, last=40,
                               compared_rng=(*driver.RESTORED_RNG, "cuda"), timeout=600)
