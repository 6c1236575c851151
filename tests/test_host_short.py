"""Host memory short: a run whose pinned host budget cannot be met degrades or refuses, never pins past the free
memory, and says so once, naming the shortfall.

- SCO with ``--peakflat-sco-budget`` past this rank's share of ``MemAvailable``: the pool is clamped to the share
  (one warning: requested, available, short by), the boundaries past it stay on the device, and the loss and
  every gradient equal plain full recompute bitwise.
- SCO's pinned allocation failing (cudaHostAlloc / ``pin_memory`` raising): the pool shrinks to what it holds,
  or falls back to pageable memory when it holds nothing, one warning each; training goes on, exact.
- SCO's default budget with nothing left (the optimizer's promise takes the share): budget 0, one warning.
- OffloadStreamAdamW's state past the share: refused before anything is allocated, naming the shortfall and the
  fixes, at start-up where the planner sees it (``integration.peaks.check_optimizer_host``), else at the first
  step (``optimizer.host_memory.check_host_budget``); the parameters are left as they were.
- Through ``python -m megatron_peakflat.pretrain`` (CPU dry run, ``PEAKFLAT_TEST_MEM_AVAILABLE`` fakes a small
  ``MemAvailable``): SCO clamps with one warning and trains to the run without SCO's losses and grad norms
  bit for bit; the offloaded optimizer is refused at start-up, before the model is built, with the fix.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_peakflat.runtime import host
from megatron_peakflat.sco import BoundaryOffloader, TorchHostPool, checkpoint_chunks, resolve_budget
from megatron_peakflat.sco import pool as pool_module
from megatron_peakflat.testing.pretrain_hooks import MEM_AVAILABLE, read_trace
from megatron_peakflat.testing.subproc import MODEL_BUILT, TINY_GPT_ARGS, logged
from tests._helpers import run_traced
from tests.conftest import needs_pretrain_entry
from tests.test_sco import Chunk

S, B, H, LAYERS = 24, 3, 40, 6  # odd shape; boundary = S*B*H*4 bytes
BOUNDARY = S * B * H * 4
KIB = 1 << 10


def _model(device: str = "cpu") -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Chunk(H) for _ in range(LAYERS)).to(device)


def _step(model: torch.nn.ModuleList, offloader: BoundaryOffloader | None, device: str = "cpu"):
    """Loss, input gradient and every parameter's gradient of one full-recompute step."""
    for p in model.parameters():
        p.grad = None
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_(True)
    loss = (checkpoint_chunks(list(model), x, offloader).float() ** 2).mean()
    loss.backward()
    if device != "cpu":
        torch.cuda.synchronize()
    return loss.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_exact(got, ref) -> None:
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[2].keys() == ref[2].keys()
    for n in ref[2]:
        assert torch.equal(got[2][n], ref[2][n]), n


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_explicit_sco_budget_past_the_share_is_clamped_once_and_training_stays_exact(monkeypatch, caplog):
    """A 1 GiB request on a node with 32 KiB free, 1 local rank: the offloader's pool is clamped to 90% of the
    share (two boundaries of 11.25 KiB fit, not three), one warning names the request, what is available and
    the shortfall; of the 5 boundaries each step could offload, 2 go to the host and the rest stay on the
    device; loss and every gradient equal plain full recompute bitwise, step after step."""
    from megatron_peakflat.integration import sco as sco_integration

    monkeypatch.setattr(host, "mem_available", lambda path="/proc/meminfo": 32 * KIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    model = _model()
    ref = _step(model, None)
    sco_integration.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
            off = sco_integration.get_offloader(1 << 30, 1, torch.device("cpu"))
            for _ in range(3):
                assert sco_integration.get_offloader(1 << 30, 1, torch.device("cpu")) is off
                _assert_exact(_step(model, off), ref)
    finally:
        sco_integration.reset()
    ceiling = int(32 * KIB * 0.9)
    assert off.pool.budget == ceiling and 2 * BOUNDARY <= ceiling < 3 * BOUNDARY
    said = _warnings(caplog, "--peakflat-sco-budget")
    assert len(said) == 1, said
    assert ("--peakflat-sco-budget 1.00 GiB requested, 28.80 KiB available on this rank (90% of MemAvailable "
            "32.00 KiB / LOCAL_WORLD_SIZE=1): short by 1023.97 MiB; budget clamped to 28.80 KiB") in said[0], said
    assert "stay on the GPU" in said[0]
    s = off.summary()
    assert (s["boundaries_packed"], s["boundaries_offloaded"]) == (3 * LAYERS, 3 * 2)
    assert s["host_bytes"] == 2 * BOUNDARY


def test_default_budget_with_no_host_memory_left_is_zero_with_one_warning(caplog):
    """The optimizer's promise takes more than the share: SCO's default budget is 0 and says why and what to do."""
    try:
        host.promise("test-optimizer", 64 * KIB)
        with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
            assert resolve_budget(None, available=48 * KIB, local_ranks=1) == 0
    finally:
        host.settle("test-optimizer")
    said = _warnings(caplog, "no host memory left")
    assert len(said) == 1 and "less 64.00 KiB the optimizer will pin = 0 B" in said[0], said
    assert "every boundary stays on the GPU" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        assert resolve_budget(None, available=48 * KIB, local_ranks=1) == 24 * KIB
    assert not _warnings(caplog, "peakflat sco")


def _failing_pins(monkeypatch: pytest.MonkeyPatch, succeed: int) -> list[bool]:
    """torch.empty as the pool calls it: the first ``succeed`` pinned allocations succeed (pageable underneath,
    this machine has no GPU), later ones raise as a failed cudaHostAlloc does. Returns the pin flags asked."""
    real, asked = torch.empty, []

    def empty(*args, pin_memory: bool = False, **kwargs):
        asked.append(pin_memory)
        if pin_memory and sum(asked) > succeed:
            raise torch.OutOfMemoryError("CUDA error: out of memory\nCUDA kernel errors might be reported later")
        return real(*args, **kwargs)

    monkeypatch.setattr(pool_module.torch, "empty", empty)
    return asked


def test_failed_pinned_allocation_shrinks_the_pool_warns_once_and_training_stays_exact(monkeypatch, caplog):
    """Pinning the third slot fails: the pool's budget shrinks to the two it holds (one warning, however
    many more boundaries ask), boundaries past them stay on the device, and the steps stay exact."""
    model = _model()
    ref = _step(model, None)
    asked = _failing_pins(monkeypatch, succeed=2)
    off = BoundaryOffloader(TorchHostPool(1 << 30, pin=True), prefetch=1)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        for _ in range(3):
            _assert_exact(_step(model, off), ref)
    said = _warnings(caplog, "pinning")
    assert len(said) == 1, said
    # two slots of 11.25 KiB, each costing the 16 KiB torch's pinned allocator rounds it up to
    assert "budget shrunk from 1.00 GiB to the 32.00 KiB already pinned" in said[0], said
    assert off.pool.pinned and off.pool.budget == off.pool.reserved == 2 * off.pool._cost(BOUNDARY)
    assert off.summary()["boundaries_offloaded"] == 3 * 2 and sum(asked) == 3


def test_pinning_that_fails_from_the_start_falls_back_to_pageable_memory_once(monkeypatch, caplog):
    """No pinned memory at all: one warning, the pool continues pageable at its budget, exact."""
    model = _model()
    ref = _step(model, None)
    _failing_pins(monkeypatch, succeed=0)
    off = BoundaryOffloader(TorchHostPool(1 << 30, pin=True), prefetch=1)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        for _ in range(2):
            _assert_exact(_step(model, off), ref)
    said = _warnings(caplog, "pinned host memory unavailable")
    assert len(said) == 1 and "using pageable memory" in said[0], said
    assert not off.pool.pinned and off.summary()["boundaries_offloaded"] == 2 * (LAYERS - 1)


def test_offloaded_optimizer_state_past_the_share_is_refused_before_anything_is_allocated(monkeypatch):
    """OffloadStreamAdamW's first step on a node with 64 KiB free: HostMemoryError naming the need, the share,
    the shortfall and the fixes; no host state exists, the parameters are unchanged, and the same optimizer
    steps once the memory is there."""
    from megatron_peakflat.optimizer import HostMemoryError, OffloadStreamAdamW

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(host, "mem_available", lambda path="/proc/meminfo": 64 * KIB)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(77, 13))]
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    opt = OffloadStreamAdamW(params, lr=1e-2, engine="cpu", host_kernel="torch")
    with pytest.raises(HostMemoryError) as e:
        opt.step()
    msg = str(e.value)
    assert "this rank's share is 64.00 KiB (MemAvailable 64.00 KiB / LOCAL_WORLD_SIZE=1): short by" in msg, msg
    assert "nothing was allocated" in msg and "Fix: shard the state over more data-parallel ranks" in msg
    assert not opt._materialized and not opt.state
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    monkeypatch.setattr(host, "mem_available", lambda path="/proc/meminfo": 1 << 30)
    opt.step()
    assert opt._materialized and not all(torch.equal(p, b) for p, b in zip(params, before))


TINY = [*TINY_GPT_ARGS, "--train-iters", "3", "--num-layers", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
"""4 layers of [32, 2, 64] fp32 boundaries (16 KiB each), 2 micro-batches per iteration, one rank."""


def _dryrun(monkeypatch: pytest.MonkeyPatch, trace: str, *extra: str, mem: int | None = None):
    out = run_traced(monkeypatch, "megatron_peakflat.testing.pretrain_dryrun", *TINY, *extra, trace=trace,
                     env={MEM_AVAILABLE: mem}, timeout=300)
    return out.returncode, out.stdout + out.stderr


@needs_pretrain_entry
def test_pretrain_with_little_host_memory_clamps_sco_once_and_trains_as_without_it(tmp_path, monkeypatch):
    """48 KiB free: --peakflat-sco-budget 1GiB becomes 43.2 KiB, two of the three boundaries each micro-batch
    could offload fit, one warning says so, and the three iterations' losses and grad norms (as train_step
    returned them) equal the run without SCO bit for bit."""
    rc, off_text = _dryrun(monkeypatch, str(tmp_path / "off"))
    assert rc == 0, off_text[-3000:]
    rc, text = _dryrun(monkeypatch, str(tmp_path / "sco"), "--peakflat-sco", "--peakflat-sco-budget", "1GiB",
                       mem=48 * KIB)
    assert rc == 0, text[-3000:]
    said = [line for line in text.splitlines() if "--peakflat-sco-budget 1.00 GiB requested" in line]
    assert len(said) == 1, text[-3000:]
    assert "43.20 KiB available on this rank (90% of MemAvailable 48.00 KiB / LOCAL_WORLD_SIZE=1): short by" in said[0]
    assert "first backward done): 4 boundaries packed, 2 offloaded, 32.00 KiB on host" in text, text[-3000:]
    ref, got = read_trace(str(tmp_path / "off")), read_trace(str(tmp_path / "sco"))
    assert sorted(ref) == sorted(got) == [1, 2, 3]
    for it in ref:
        assert got[it]["loss"] == ref[it]["loss"] and got[it]["grad_norm"] == ref[it]["grad_norm"], it
    assert logged(text, "lm loss") == logged(off_text, "lm loss") and len(logged(text, "lm loss")) == 3


@needs_pretrain_entry
def test_pretrain_refuses_offloaded_optimizer_state_past_the_share_at_start_up(tmp_path, monkeypatch):
    """256 KiB free and the offloaded optimizer on: refused before the model is built (not at a step, not by the
    OOM killer), naming the flag, what it would pin, the share and the fix."""
    rc, text = _dryrun(monkeypatch, str(tmp_path / "opt"), "--use-distributed-optimizer", "--optimizer-cpu-offload",
                       "--use-precision-aware-optimizer", "--peakflat-optimizer", "offload-stream", mem=256 * KIB)
    assert rc != 0, text[-3000:]
    assert "megatron-peakflat: --peakflat-optimizer='offload-stream': OffloadStreamAdamW is predicted to pin" in text, \
        (rc, text[-3000:])
    assert "this rank's share of the host's available memory is 256.00 KiB (MemAvailable / LOCAL_WORLD_SIZE=1): " \
           "short by" in text, text[-3000:]
    assert "Fix: shard the state over more data-parallel ranks" in text
    assert MODEL_BUILT not in text and not logged(text, "lm loss")
