"""The tiled attention sublayer under context parallelism on two GPUs (NCCL): ``tests/_cp_driver.py``'s comparisons
at CP 2 with every component and ``--peakflat-tile`` on in our run, the driver that
``tests/test_tile_cp_megatron.py`` runs with the tile on two gloo ranks on CPU.

- fp32 (TF32 off), the local spec with the SDPA attention: the loss, every parameter's gradient and every parameter
  after the step against unpatched Megatron at CP 1 on the whole sequence, within 1e-5; with CP 2 x EP 2 and every
  token on one expert too. On the GPUs K and V are all-gathered and dK, dV reduce-scattered in place over NCCL.
- bf16, on the local spec and, where Transformer Engine imports, on TE's layers (each tile's attention is TE's with
  the bottom-right causal mask and no CP group of its own; Megatron's own path is TE's CP attention, ``cp_comm_type``
  p2p): against an fp32 reference at CP 1, no further from it than Megatron's own CP 2 path, plus two bf16 epsilons
  (``TILE_BF16_SLACK`` says why two).

Tiles that do not divide a chunk (chunks of 8 tokens at 32, 16 at 64). Fewer than two GPUs: skipped.
"""

from __future__ import annotations

import pytest

from megatron_peakflat.testing import run_distributed
from tests import _cp_driver as driver

pytestmark = driver.needs_two_gpus("the CP tiling runs on gloo ranks on CPU: tests/test_tile_cp.py, "
                                   "tests/test_tile_cp_megatron.py")
needs_te = driver.needs_te

TILE_BF16_SLACK = 2 * driver.BF16_SLACK
"""Two bf16 epsilons for the tiled runs in bf16: under CP the tiled backward differentiates each tile twice, once
through its queries and once through its keys and values (against their reduce-scattered gradients), so the input
norm's gradient, dx and what precedes the layer sum two products each rounded to bf16 where the untiled backward
rounds one (on CPU at 64 tokens: 0.0270 against Megatron's 0.0230 for one norm bias). A wrong mask or position is
off by O(1)."""

CASES = {
    "fp32-local-tile5": driver.Case("fp32-local-tile5", seq=32, tile=5),
    "bf16-local-tile6": driver.Case("bf16-local-tile6", dtype="bf16", seq=64, tile=6, bf16_slack=TILE_BF16_SLACK),
    "bf16-te-tile6": driver.Case("bf16-te-tile6", dtype="bf16", spec="te", seq=64, tile=6,
                                 bf16_slack=TILE_BF16_SLACK),
    "fp32-cp2xep2-all-tokens-on-one-expert-tile5": driver.Case("fp32-cp2xep2-all-tokens-on-one-expert-tile5", ep=2,
                                                               skew=8.0, seq=32, tile=5),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_te) if CASES[n].spec == "te" else n for n in CASES])
def test_tiled_layers_at_cp2_on_two_gpus(name):
    case = CASES[name]
    results = run_distributed(driver.rank_main, 2, [case], False, backend="nccl", timeout=900)
    driver.check(results, [case])
