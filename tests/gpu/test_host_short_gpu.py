"""Host memory short on one GPU, with a faked small ``MemAvailable``: SCO's pinned pool is clamped (or shrinks when
pinning fails) with one warning naming the shortfall, the boundaries past it stay on the GPU, and training stays
bitwise exact; the offloaded optimizer is refused at start-up with the fix. ``tests/test_host_short.py`` is the
CPU twin; here the pool is really pinned (``cudaHostAlloc``) and the boundaries really leave the GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_peakflat.runtime import host
from megatron_peakflat.sco import BoundaryOffloader, TorchHostPool
from megatron_peakflat.sco import pool as pool_module
from megatron_peakflat.testing.pretrain_hooks import MEM_AVAILABLE, read_trace
from megatron_peakflat.testing.subproc import MODEL_BUILT, TINY_GPT_ARGS, logged
from tests._helpers import run_traced

from tests.test_host_short import BOUNDARY, _assert_exact
from tests.test_host_short import _model as cpu_model
from tests.test_host_short import _step as cpu_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KIB = 1 << 10  # the boundary (tests/test_host_short.py's S*B*H*4 = 11.25 KiB) is a 16 KiB block of torch's pinned allocator


def _model():
    return cpu_model("cuda")


def _step(model, offloader):
    return cpu_step(model, offloader, "cuda")


def test_sco_budget_past_the_share_is_clamped_once_pinned_and_exact(monkeypatch, caplog):
    """48 KiB free: a 1 GiB request is clamped to 43.2 KiB (two pinned 16 KiB blocks), one warning; two of the
    five boundaries each step could offload leave the GPU, the rest stay; bitwise equal to plain recompute."""
    from megatron_peakflat.integration import sco as sco_integration

    monkeypatch.setattr(host, "mem_available", lambda path="/proc/meminfo": 48 * KIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    model = _model()
    ref = _step(model, None)
    sco_integration.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
            off = sco_integration.get_offloader(1 << 30, 1, torch.device("cuda"))
            for _ in range(3):
                _assert_exact(_step(model, off), ref)
    finally:
        sco_integration.reset()
    said = [r.getMessage() for r in caplog.records if "--peakflat-sco-budget" in r.getMessage()]
    assert len(said) == 1 and "short by" in said[0] and "43.20 KiB available on this rank" in said[0], said
    s = off.summary()
    assert off.pool.pinned and s["host_bytes"] == 2 * 16 * KIB
    assert s["boundaries_offloaded"] == 3 * 2 and s["device_bytes_saved_peak"] == 2 * BOUNDARY


def test_failed_pinned_allocation_shrinks_the_pool_once_and_stays_exact(monkeypatch, caplog):
    """cudaHostAlloc failing from the third slot on (raised as a failed one does): the pool keeps the two pinned
    slots it has, one warning, the other boundaries stay on the GPU, bitwise exact."""
    model = _model()
    ref = _step(model, None)
    real, pinned = torch.empty, []

    def empty(*args, pin_memory: bool = False, **kwargs):
        if pin_memory:
            pinned.append(1)
            if len(pinned) > 2:
                raise torch.OutOfMemoryError("CUDA error: out of memory")
        return real(*args, pin_memory=pin_memory, **kwargs)

    monkeypatch.setattr(pool_module.torch, "empty", empty)
    off = BoundaryOffloader(TorchHostPool(1 << 30, pin=True), prefetch=1)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        for _ in range(3):
            _assert_exact(_step(model, off), ref)
    said = [r.getMessage() for r in caplog.records if "pinning" in r.getMessage()]
    assert len(said) == 1 and "budget shrunk from 1.00 GiB to the 32.00 KiB already pinned" in said[0], said
    assert off.pool.pinned and off.summary()["boundaries_offloaded"] == 3 * 2 and len(pinned) == 3


ARGS = [*TINY_GPT_ARGS, "--train-iters", "3", "--num-layers", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--deterministic-mode"]


def _pretrain(monkeypatch: pytest.MonkeyPatch, trace: str, *extra: str, mem: int | None = None):
    out = run_traced(monkeypatch, "megatron_peakflat.testing.pretrain_hooks", *ARGS, *extra, trace=trace,
                     env={MEM_AVAILABLE: mem}, launcher=True, timeout=400)
    return out.returncode, out.stdout + out.stderr


def test_pretrain_with_little_host_memory_clamps_sco_and_trains_as_without_it(tmp_path, monkeypatch):
    rc, off_text = _pretrain(monkeypatch, str(tmp_path / "off"))
    assert rc == 0, off_text[-4000:]
    rc, text = _pretrain(monkeypatch, str(tmp_path / "sco"), "--peakflat-sco", "--peakflat-sco-budget", "1GiB",
                         mem=48 * KIB)
    assert rc == 0, text[-4000:]
    said = [line for line in text.splitlines() if "--peakflat-sco-budget 1.00 GiB requested" in line]
    assert len(said) == 1 and "short by" in said[0], text[-4000:]
    assert "4 boundaries packed, 2 offloaded, 32.00 KiB on host (pinned)" in text, text[-4000:]
    ref, got = read_trace(str(tmp_path / "off")), read_trace(str(tmp_path / "sco"))
    assert sorted(ref) == sorted(got) == [1, 2, 3]
    for it in ref:
        assert got[it]["loss"] == ref[it]["loss"] and got[it]["grad_norm"] == ref[it]["grad_norm"], it
    assert len(logged(text, "lm loss")) == 3


def test_pretrain_refuses_offloaded_optimizer_state_past_the_share_at_start_up(tmp_path, monkeypatch):
    rc, text = _pretrain(monkeypatch, str(tmp_path / "opt"), "--use-distributed-optimizer", "--optimizer-cpu-offload",
                         "--use-precision-aware-optimizer", "--peakflat-optimizer", "offload-stream", mem=256 * KIB)
    assert rc != 0, text[-4000:]
    assert "OffloadStreamAdamW is predicted to pin" in text and "short by" in text, text[-4000:]
    assert "Fix: shard the state over more data-parallel ranks" in text and MODEL_BUILT not in text
