"""PipelinedLLEP, Ring-DTP and SCO beside Transformer Engine's own modules, through Megatron's pretrain loop.

A tiny MoE GPT with ``--transformer-impl transformer_engine`` (TE's linears, attention and, under
``--moe-grouped-gemm``, ``TEGroupedMLP``), six bf16 iterations with peakflat off and on, the same seed.
Cases: TE's grouped experts (GELU, and SwiGLU with its fused [gate; up] weight layout), under full
recompute with Ring-DTP and SCO, TE linears in a SequentialMLP, and, on 2 GPUs, TE's grouped experts at
EP=2. PipelinedLLEP must take TE's experts on its grouped path (no layer handed back to Megatron's
dispatcher), and the losses must agree to bf16 accumulation order: chunked experts and a blockwise loss
sum in another order than TE's grouped GEMM and Megatron's cross-entropy.

Needs TE, which pip cannot bring to an offline GPU machine in one piece: ``tools/te_to_device.sh`` says
how it got onto the H200 (TE 2.20.2, its torch extension built there for sm_90).
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_peakflat.integration.attention import transformer_engine_available
from megatron_peakflat.testing.subproc import TINY_GPT_ARGS, logged, run_module

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine")]

BASE = [*TINY_GPT_ARGS, "--train-iters", "6", "--bf16", "--transformer-impl", "transformer_engine",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
DISPATCH = ["--peakflat-dispatch", "pipelined-llep", "--peakflat-dispatch-chunk-cap", "16"]  # 64 tokens x top-2: K=8
EP2 = ["--expert-model-parallel-size", "2"]
CASES = {  # name: (flags of both runs, peakflat's flags, ranks)
    "te-grouped-experts": (["--moe-grouped-gemm"], DISPATCH, 1),
    "te-grouped-swiglu-experts": (["--moe-grouped-gemm", "--swiglu"], DISPATCH, 1),
    "te-grouped-experts-full-recompute-all": (["--moe-grouped-gemm", *FULL],
                                              [*DISPATCH, "--peakflat-vocab", "ring-dtp", "--peakflat-sco"], 1),
    "te-sequential-experts": ([], DISPATCH, 1),
    "te-grouped-swiglu-experts-ep2": (["--moe-grouped-gemm", "--swiglu", *EP2], DISPATCH, 2),
}


def _run(*argv: str, nproc: int = 1) -> tuple[list[float], str]:
    out = run_module("megatron_peakflat.pretrain", *BASE, *argv, nproc=nproc, launcher=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert re.search(r"transformer_impl \.+ transformer_engine", text), "Megatron did not build TE's modules"
    return logged(text, "lm loss"), text


@pytest.mark.parametrize("case", CASES)
def test_same_losses_beside_te_modules(case):
    base, on, nproc = CASES[case]
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    off, _ = _run(*base, nproc=nproc)
    ours, text = _run(*base, *on, nproc=nproc)
    assert f"PipelinedLLEP on MoE layers (EP={nproc}," in text
    assert re.search(r"K=8 chunks" if nproc == 1 else r"K=\d+ chunks", text)
    assert "experts run through their modules" not in text  # TE's experts taken on the grouped path
    assert len(off) == len(ours) == 6
    rel = max(abs(a - b) / abs(a) for a, b in zip(off, ours))
    assert rel <= 5e-4, (off, ours)
