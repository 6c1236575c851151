"""SCO on a plain PyTorch model (torch.utils.checkpoint, reentrant): exactness, budget, bounds, pool."""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch

from megatron_peakflat import stats
from megatron_peakflat.sco import BoundaryOffloader, TorchHostPool, checkpoint_chunks, make_pool, resolve_budget
from megatron_peakflat.testing.live_bytes import LiveBytesMeter
from tests._helpers import native_available

S, B, H = 24, 3, 40  # odd shape; boundary = S*B*H*4 bytes
BOUNDARY = S * B * H * 4


class Chunk(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 3 * h)
        self.down = torch.nn.Linear(3 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model(layers: int, seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Chunk(H) for _ in range(layers))


def _x(seed: int = 1, seq: int = S) -> torch.Tensor:
    return torch.randn(seq, B, H, generator=torch.Generator().manual_seed(seed))


def _step(model, x, offloader):
    for p in model.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out = checkpoint_chunks(list(model), x, offloader)
    loss = (out.float() ** 2).mean()
    loss.backward()
    return loss.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _offloader(budget: int = 1 << 30, prefetch: int = 1, impl: str = "torch") -> BoundaryOffloader:
    return BoundaryOffloader(make_pool(budget, pin=False, impl=impl), prefetch=prefetch)


POOLS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not native_available(),
                                                                   reason="megatron_peakflat._C not built"))]


@pytest.mark.parametrize("impl", POOLS)
@pytest.mark.parametrize("layers,prefetch", [(1, 1), (5, 0), (5, 1), (6, 3)])
def test_bitwise_equal_and_counts(layers, prefetch, impl):
    model, x = _model(layers), _x()
    ref = _step(model, x, None)
    off = _offloader(prefetch=prefetch, impl=impl)
    assert type(off.pool).__name__ == {"torch": "TorchHostPool", "native": "NativeHostPool"}[impl]
    for it in range(3):  # the pool is reused across iterations: no new host allocation after the first
        got = _step(model, x, off)
        assert torch.equal(got[0], ref[0])
        assert torch.equal(got[1], ref[1])
        assert got[2].keys() == ref[2].keys()
        for n in ref[2]:
            assert torch.equal(got[2][n], ref[2][n]), n
        assert off.packed == layers * (it + 1)
        # the last boundary of the group stays on the device (backward needs it first)
        assert off.offloaded == (layers - 1) * (it + 1)
        assert off.pool.in_use == 0
        assert off.pool.allocations == layers - 1
        assert off.offloaded_bytes_live == 0


@pytest.mark.parametrize("impl", POOLS)
def test_budget_keeps_the_last_layers_on_device(impl):
    layers, fit = 6, 2
    off = _offloader(budget=fit * BOUNDARY + BOUNDARY // 2, impl=impl)
    model, x = _model(layers), _x()
    handles: list = []
    original = off._pack

    def spy(t):
        h = original(t)
        if not isinstance(h, torch.Tensor):
            handles.append(h)
        return h

    off._pack = spy
    ref = _step(model, x, None)
    got = _step(model, x, off)
    assert torch.equal(got[0], ref[0]) and all(torch.equal(got[2][n], ref[2][n]) for n in ref[2])
    assert off.pool.reserved <= off.pool.budget
    assert off.pool.peak_in_use == fit * BOUNDARY
    assert [int(h.offloaded) for h in handles] == [1] * fit + [0] * (layers - fit)  # first layers offloaded, the last stay
    assert off.offloaded == fit


def test_only_the_boundary_is_offloaded():
    """Other tensors saved by the same checkpoint (a mask, a rotary table) are left alone."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(H, H)
    mask = torch.rand(S, B, H) > 0.5
    rope = torch.randn(S, 1, H)

    def fn(x, m, r):
        return lin(x * r).masked_fill(m, 0.0) + x

    off = _offloader()
    x = _x().requires_grad_(True)
    with off.group():
        with off.boundary(x):
            y = torch.utils.checkpoint.checkpoint(fn, x, mask, rope, use_reentrant=True)
        with off.boundary(y):
            z = torch.utils.checkpoint.checkpoint(fn, y, mask, rope, use_reentrant=True)
    assert off.packed == 2 and off.offloaded == 1
    assert off.pool.peak_in_use == BOUNDARY  # neither mask nor rope took a slot
    z.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.utils.checkpoint.checkpoint(fn, x2, mask, rope, use_reentrant=True)
    torch.utils.checkpoint.checkpoint(fn, y2, mask, rope, use_reentrant=True).sum().backward()
    assert torch.equal(x.grad, x2.grad)


class _SavesTwice(torch.autograd.Function):
    """y = 2 x, saving x twice (as some fused kernels save their input under two roles)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        assert torch.equal(a, b)
        return g * 2


def _saves_twice_chain(off: BoundaryOffloader, x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` boundaries in one group, each saving its (contiguous) input twice; the last one's output."""
    with off.group():
        for _ in range(n):
            with off.boundary(x):
                x = _SavesTwice.apply(x).contiguous()
    return x


def test_only_the_first_save_of_the_boundary_is_packed():
    """A boundary saved twice inside its checkpoint takes one slot and is counted once; the second save is
    left to autograd, and the gradients are those without the offloader."""
    off = _offloader()
    x = _x().requires_grad_(True)
    z = _saves_twice_chain(off, x, 2)
    assert off.packed == 2 and off.offloaded == 1
    assert off.pool.peak_in_use == BOUNDARY
    z.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 4.0))


@pytest.mark.parametrize("keep_first", [False, True])
def test_keep_first_leaves_the_first_boundary_on_the_device(keep_first):
    """group(keep_first=True) (a pipeline stage's received input, held by the schedule anyway): of three
    boundaries only the middle one goes to the host; without it, all but the last."""
    off = _offloader()
    x = _x().requires_grad_(True)
    with off.group(keep_first=keep_first):
        t = x
        for _ in range(3):
            with off.boundary(t):
                t = _SavesTwice.apply(t)
    assert off.packed == 3 and off.offloaded == (1 if keep_first else 2)
    assert off.pool.peak_in_use == off.offloaded * BOUNDARY
    t.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 8.0))


class _SavesBoth(torch.autograd.Function):
    """y = other * x, saving ``other`` first; backward records whether each saved tensor is still the
    caller's memory (not offloaded) or a copy brought back."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, other, x):
        ctx.save_for_backward(other, x)
        return other * x

    @staticmethod
    def backward(ctx, g):
        other, x = ctx.saved_tensors
        _SavesBoth.seen = [t.untyped_storage().data_ptr() == ctx.buffer for t in (other, x)]
        return g * x, g * other


def test_a_view_of_the_same_storage_at_another_offset_is_not_the_boundary():
    """Two rows of one buffer share storage, shape, dtype and strides: the row that is the boundary is
    offloaded and its sibling, saved first by the same op, stays where it is; the gradients are exact."""
    buf = torch.randn(2, S, B, H)
    grads = []
    for use_offloader in (True, False):
        b = buf.clone().requires_grad_(True)
        x, other = b[0], b[1]
        off = _offloader()
        with off.group():
            with off.boundary(x) if use_offloader else contextlib.nullcontext():
                y = _SavesBoth.apply(other, x)
                y.grad_fn.buffer = b.untyped_storage().data_ptr()
            with off.boundary(y) if use_offloader else contextlib.nullcontext():
                z = _SavesTwice.apply(y).sum()  # y, the group's last boundary, stays on the device: x goes to the host
        if use_offloader:
            assert off.packed == 2 and off.offloaded == 1 and off.pool.peak_in_use == BOUNDARY
        z.backward()
        assert _SavesBoth.seen == [True, not use_offloader], (use_offloader, _SavesBoth.seen)
        grads.append(b.grad)
    assert torch.equal(grads[0], grads[1])


def test_a_non_contiguous_boundary_stays_on_the_device():
    """A boundary that is not contiguous (here a transposed input) is not offloaded: only the contiguous middle
    boundary of three goes to the host, and the gradients are those without the offloader."""
    off = _offloader()
    x = torch.randn(B, S, H).transpose(0, 1).requires_grad_(True)
    assert not x.is_contiguous()
    out = _saves_twice_chain(off, x, 3)
    assert off.packed == 3 and off.offloaded == 1
    assert off.pool.peak_in_use == BOUNDARY
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 8.0))


def _live_at_backward_start(layers: int, offloader: BoundaryOffloader | None, seq: int = S) -> int:
    model, x = _model(layers), _x(seq=seq).requires_grad_(True)
    if offloader is not None:
        offloader.pool.reserve(seq * B * H * 4, layers)  # host slots exist before the meter: not device bytes
    with LiveBytesMeter() as meter:
        out = checkpoint_chunks(list(model), x, offloader)
        loss = (out ** 2).mean()
        live = meter.live
        loss.backward()
    return live


def test_live_bytes_do_not_grow_with_depth():
    base = {n: _live_at_backward_start(n, None) for n in (2, 4, 8)}
    sco = {n: _live_at_backward_start(n, _offloader()) for n in (2, 4, 8)}
    # without SCO every boundary stays: 4 more layers keep 4 more boundaries
    assert base[8] - base[4] == 4 * BOUNDARY and base[4] - base[2] == 2 * BOUNDARY
    # with SCO only the last boundary and the output stay, whatever the depth
    assert sco[2] == sco[4] == sco[8]
    assert sco[8] <= base[2]


def test_live_bytes_stay_under_two_boundaries_as_tokens_grow():
    """The bound in tokens: at backward's start SCO leaves the last boundary and the output on the device,
    2 x S x B x H x 4 bytes (+ the loss), at any depth; 4x the tokens moves only that formula."""
    for seq in (S, 4 * S):
        boundary = seq * B * H * 4
        sco = {n: _live_at_backward_start(n, _offloader(), seq) for n in (2, 8)}
        base = {n: _live_at_backward_start(n, None, seq) for n in (2, 8)}
        assert sco[2] == sco[8] <= 2 * boundary + 512, (seq, sco, boundary)
        assert base[8] - base[2] == 6 * boundary, (seq, base)


def test_live_bytes_respect_the_budget_rule():
    """Boundaries past the budget stay on the device: live bytes grow by exactly those."""
    fit = 3
    live = {n: _live_at_backward_start(n, _offloader(budget=fit * BOUNDARY)) for n in (4, 6)}
    assert live[6] - live[4] == 2 * BOUNDARY


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_bounds_boundaries_back_on_device(prefetch):
    layers = 6
    off = _offloader(prefetch=prefetch)
    counts: list[tuple[int, int]] = []
    model = _model(layers)

    def probe(i):
        def fn(x):
            if torch.is_grad_enabled():  # recompute during backward
                handles = [h for g in list(off._live_groups) for h in g.live()]
                counts.append((i, sum(h.device_tensor is not None for h in handles)))
            return model[i](x)
        return fn

    x = _x().requires_grad_(True)
    out = checkpoint_chunks([probe(i) for i in range(layers)], x, off)
    out.sum().backward()
    assert [i for i, _ in counts] == list(reversed(range(layers)))
    for i, n in counts:
        assert n == min(1 + prefetch, i + 1) or (prefetch == 0 and n == 1), (i, n)


def _peak_over_step(layers: int, offloader: BoundaryOffloader | None, loss: str) -> int:
    model, x = _model(layers), _x().requires_grad_(True)
    for p in [x, *model.parameters()]:
        p.grad = torch.zeros_like(p)  # every chunk's backward then has the same working set
    w = torch.randn(S, B, H)
    if offloader is not None:
        offloader.pool.reserve(BOUNDARY, layers)
    with LiveBytesMeter() as meter:
        out = checkpoint_chunks(list(model), x * 1.0, offloader)  # the first boundary is an activation
        (out.sum() if loss == "sum" else (out * w).sum()).backward()
    return meter.peak


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_step_peak_drops_by_all_but_the_kept_and_prefetched_boundaries(prefetch):
    """Over forward and backward, SCO lowers the peak by exactly (layers - 1 - prefetch) boundaries when
    each chunk's backward receives a materialised gradient, as in a model. With ``out.sum()`` the last
    chunk receives a zero-stride gradient, so the run without SCO peaks at the last two chunks alike
    while SCO peaks at the second-to-last one (which holds a real gradient): one boundary less is saved."""
    layers = 8
    for loss, expect in (("weighted", layers - 1 - prefetch), ("sum", layers - 2 - prefetch)):
        ref = _peak_over_step(layers, None, loss)
        got = _peak_over_step(layers, _offloader(prefetch=prefetch), loss)
        assert ref - got == expect * BOUNDARY, (loss, (ref - got) / BOUNDARY, expect)


def test_graph_dropped_without_backward_returns_slots():
    off = _offloader()
    model = _model(4)
    out = checkpoint_chunks(list(model), _x().requires_grad_(True), off)
    assert off.pool.in_use == 3 * BOUNDARY
    del out
    gc.collect()
    assert off.pool.in_use == 0 and off.offloaded_bytes_live == 0


def test_stats_and_log(caplog):
    stats.reset()
    off = _offloader()
    model = _model(3)
    with caplog.at_level(logging.INFO, logger="megatron_peakflat"):
        for _ in range(2):
            _step(model, _x(), off)
    lines = [r.getMessage() for r in caplog.records if "sco (first backward" in r.getMessage()]
    assert len(lines) == 1 and "6 boundaries" not in lines[0] and "3 boundaries packed, 2 offloaded" in lines[0]
    snap = stats.snapshot()["sco"]
    assert snap["boundaries_packed"] == 6 and snap["boundaries_offloaded"] == 4
    assert snap["device_bytes_saved_peak"] == 2 * BOUNDARY


def test_summary_waits_for_the_backward_of_every_group_in_flight(caplog):
    """With two microbatches in flight (both groups packed before either backward), the one-time summary is
    logged once the backward of both has reached its first boundary, not after the first group's alone."""
    off = _offloader()
    model = _model(3)

    def summaries():
        return [r.getMessage() for r in caplog.records if "sco (first backward" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="megatron_peakflat"):
        outs = [checkpoint_chunks(list(model), _x(seed).requires_grad_(True), off) for seed in (1, 2)]
        outs[0].sum().backward()
        assert summaries() == []
        outs[1].sum().backward()
    lines = summaries()
    assert len(lines) == 1 and "6 boundaries packed, 4 offloaded" in lines[0]


def test_summary_reports_the_peak_of_device_bytes_saved():
    """``device_bytes_saved_peak`` is the most boundary bytes that were off the device at once, not those off
    it at the latest offload: a step of 4 chunks then one of 2 still reports the 3 boundaries of the first."""
    off = _offloader()
    _step(_model(4), _x(), off)
    _step(_model(2), _x(), off)
    s = off.summary()
    assert s["device_bytes_saved_peak"] == 3 * BOUNDARY
    assert (s["boundaries_packed"], s["boundaries_offloaded"], s["boundaries_kept_on_device"]) == (6, 4, 2)


def test_pool_budget_and_resolve(caplog):
    pool = TorchHostPool(100, pin=False)
    a = pool.acquire(60)
    assert a is not None and pool.acquire(60) is None  # would exceed the budget
    pool.release(a)
    b = pool.acquire(50)  # reuses the free 60-byte slot (within 2x)
    assert b is a and pool.allocations == 1
    pool.release(b)
    c = pool.acquire(90)  # drops the free slot to make room
    assert c is not None and pool.reserved == 90
    with pytest.raises(RuntimeError):
        pool.release(c), pool.release(c)
    # torch's pinned allocator rounds blocks up to a power of two: the budget counts the rounded size
    assert TorchHostPool(1 << 20, pin=True)._cost(3 * 1024 + 1) == 4096
    assert TorchHostPool(1 << 20, pin=False)._cost(3 * 1024 + 1) == 3 * 1024 + 1
    assert resolve_budget(None, available=8 << 30, local_ranks=4) == (8 << 30) // 2 // 4
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        assert resolve_budget(100 << 30, available=8 << 30, local_ranks=2) == int((8 << 30) * 0.9) // 2
    assert any("clamped" in r.getMessage() for r in caplog.records)
    assert resolve_budget(1 << 20, available=8 << 30, local_ranks=2) == 1 << 20


def test_pool_reuses_a_free_slot_only_up_to_twice_the_request():
    """A small request does not take a large free slot (best fit within 2x): the large slot stays free for
    the next boundary of its size, and the small one gets a slot of its own."""
    pool = TorchHostPool(1 << 20, pin=False)
    big = pool.acquire(4096)
    pool.release(big)
    small = pool.acquire(100)
    assert small is not big and small.nbytes == 100 and pool.allocations == 2
    assert pool.acquire(4096) is big and pool.allocations == 2
    pool.release(small)
    assert pool.acquire(60) is small  # 100 <= 2 x 60: reused


def test_pool_keeps_free_slots_it_cannot_trade_for_room():
    """A request that does not fit even after dropping every free slot leaves the free slots alone, so the
    next request of their size reuses one instead of allocating (pinning) host memory again."""
    pool = TorchHostPool(100, pin=False)
    a, b = pool.acquire(60), pool.acquire(30)
    pool.release(b)
    assert pool.acquire(50) is None  # 60 in use + 50 > 100 with or without the free 30
    assert pool.acquire(30) is b and pool.allocations == 2 and pool.reserved == 90
    pool.release(a)
    assert pool.acquire(70) is not None and pool.reserved == 100  # the free 60 is dropped: that makes room


def test_pool_serves_the_smallest_free_slot_up_to_exactly_twice_the_request():
    """Among free slots of at least the request and at most twice it, the smallest is taken (best fit); a slot of
    exactly twice the request still counts, so it is reused rather than a new one allocated."""
    pool = TorchHostPool(1 << 20, pin=False)
    s150, s100, s300 = pool.acquire(150), pool.acquire(100), pool.acquire(300)
    for s in (s150, s100, s300):
        pool.release(s)
    assert pool.acquire(80) is s100  # 100 and 150 both within 2 x 80: the smaller
    assert pool.acquire(150) is s150
    assert pool.acquire(150) is s300  # 300 == 2 x 150
    assert pool.allocations == 3


def test_pinned_slot_cost_is_the_next_power_of_two_not_beyond():
    """The budget counts a pinned slot at torch's rounded block size: a size that is already a power of two
    costs itself, one byte more costs the next power."""
    pool = TorchHostPool(1 << 20, pin=True)
    assert [pool._cost(n) for n in (1, 2, 4096, 4097, 1 << 16)] == [1, 2, 4096, 8192, 1 << 16]


def test_explicit_budget_is_kept_when_available_memory_is_unknown(monkeypatch, caplog):
    """Without /proc/meminfo the default budget is 0 (logged) but an explicit --peakflat-sco-budget is used as
    given: there is nothing to clamp it against."""
    from megatron_peakflat.sco import pool as pool_module

    monkeypatch.setattr(pool_module.host, "mem_available", lambda *a, **k: None)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        assert resolve_budget(None, local_ranks=1) == 0
    assert any("cannot read MemAvailable" in r.getMessage() for r in caplog.records)
    assert resolve_budget(3 << 20, local_ranks=2) == 3 << 20


@pytest.mark.skipif(not native_available(), reason="megatron_peakflat._C not built")
def test_native_pool_refuses_a_slot_that_would_not_fit_once_aligned():
    """The native region carves slots at 256-byte offsets: a request that fits the bytes left but not the space
    after the next aligned offset gets None (its boundary stays on the device), never an error."""
    from megatron_peakflat import _ext
    from megatron_peakflat.sco import NativeHostPool

    pool = NativeHostPool(1024, pin=False, module=_ext.load())
    assert pool.acquire(100) is not None
    assert pool.acquire(900) is None  # 100 + 900 <= 1024, but the next slot starts at 256
    slot = pool.acquire(512)
    assert slot is not None and slot.nbytes == 512 and pool.reserved <= pool.budget
    assert pool.acquire(256) is not None and pool.reserved == 1024  # ends at the region's last byte: taken
    assert pool.acquire(1) is None


def test_native_pool_falls_back_when_missing(monkeypatch, caplog):
    from megatron_peakflat import _ext

    monkeypatch.setattr(_ext, "load", lambda: None)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        pool = make_pool(1 << 20, pin=False, impl="native")
    assert isinstance(pool, TorchHostPool) and any("native host pool unavailable" in r.getMessage()
                                                   for r in caplog.records)
    with pytest.raises(ValueError, match="impl"):
        make_pool(1 << 20, pin=False, impl="cuda")


def test_pool_degrades_when_pinning_fails(monkeypatch, caplog):
    real_empty = torch.empty

    def failing_empty(*a, **k):
        if k.get("pin_memory"):
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", failing_empty)
    pool = TorchHostPool(1000, pin=True)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        slot = pool.acquire(100)
    assert slot is not None and not pool.pinned
    assert any("pageable" in r.getMessage() for r in caplog.records)


def test_pool_shrinks_its_budget_to_what_is_pinned_when_pinning_more_fails(monkeypatch, caplog):
    real_empty = torch.empty
    pinned_calls = []

    def pins_once(*a, **k):
        if k.get("pin_memory"):
            pinned_calls.append(a)
            if len(pinned_calls) > 1:
                raise RuntimeError("cudaHostAlloc failed: out of memory")
            k = {**k, "pin_memory": False}  # no CUDA here: stand in for the one pinned block
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", pins_once)
    pool = TorchHostPool(1000, pin=True)
    first = pool.acquire(100)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        second = pool.acquire(100)
    assert first is not None and second is None  # the second boundary stays on the device
    assert pool.pinned and pool.budget == pool.reserved < 1000
    assert any("budget shrunk" in r.getMessage() for r in caplog.records)


def test_pool_shrinks_its_budget_when_even_pageable_host_memory_runs_out(monkeypatch, caplog):
    """Pinning failed and then a pageable block too: the pool keeps what it holds, refuses more (those
    boundaries stay on the device) and says so, instead of raising in the middle of a forward."""
    real_empty = torch.empty
    calls = []

    def host_runs_out(*a, **k):
        calls.append(k.get("pin_memory", False))
        if k.get("pin_memory") or len(calls) > 2:
            raise RuntimeError("std::bad_alloc")
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", host_runs_out)
    pool = TorchHostPool(1000, pin=True)
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        first = pool.acquire(100)  # pinning fails, a pageable block is served
        second = pool.acquire(100)  # the next pageable block fails
    assert first is not None and second is None and not pool.pinned
    assert pool.budget == pool.reserved == 100
    assert pool.acquire(100) is None and len(calls) == 3  # past the shrunk budget nothing is tried again
    assert any("host allocation of 100 B failed (std::bad_alloc); budget shrunk from 1000 B to 100 B" in r.getMessage()
               for r in caplog.records)


def test_bad_arguments():
    with pytest.raises(ValueError, match="prefetch"):
        BoundaryOffloader(TorchHostPool(0, pin=False), prefetch=-1)
    with pytest.raises(ValueError, match="budget"):
        TorchHostPool(-1, pin=False)
    off = _offloader()
    with pytest.raises(RuntimeError, match="inside group"):
        with off.boundary(_x()):
            pass
    with off.group():
        with pytest.raises(RuntimeError, match=r"group\(\) does not nest"):
            with off.group():
                pass
        with off.boundary(_x()):
            with pytest.raises(RuntimeError, match=r"boundary\(\) does not nest"):
                with off.boundary(_x()):
                    pass


def test_integration_wrapper_mechanics(caplog):
    """The Megatron factory on a stand-in module: off = untouched, on = boundaries offloaded and the
    module's tensor_parallel restored, fp8 = handed back with one warning, no_grad = untouched."""
    import sys
    import types

    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.integration import sco as sco_integration
    from megatron_peakflat.integration import state
    from megatron_peakflat.sco.config import SCOConfig

    mod = types.ModuleType("fake_megatron_recompute")
    real_tp = types.SimpleNamespace(
        checkpoint=lambda fn, distribute, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True))
    mod.tensor_parallel = real_tp
    exec(
        "def checkpointed_forward(self, hidden_states, rope):\n"
        "    for layer in self.layers:\n"
        "        hidden_states = tensor_parallel.checkpoint(lambda h, r, l=layer: l(h) * r, False, hidden_states, rope)\n"
        "    return hidden_states\n", mod.__dict__)
    mod.checkpointed_forward.__module__ = mod.__name__
    sys.modules[mod.__name__] = mod
    try:
        wrapped = sco_integration.wrap_checkpointed_forward(mod.checkpointed_forward)
        block = types.SimpleNamespace(layers=list(_model(4)), config=types.SimpleNamespace(fp8=False, fp4=False),
                                      pre_process=True)
        rope = torch.ones(1, 1, H)

        def run(fp8=False):
            block.config.fp8 = fp8
            x = _x().requires_grad_(True)
            y = wrapped(block, x, rope)
            y.square().mean().backward()
            return x.grad

        sco_integration.reset()
        state.set_current(PeakflatConfig(sco=SCOConfig(enabled=False)))
        ref = run()
        assert sco_integration.offloader() is None
        state.set_current(PeakflatConfig(sco=SCOConfig(enabled=True, budget=1 << 30)))
        assert torch.equal(run(), ref)
        off = sco_integration.offloader()
        assert off.packed == 4 and off.offloaded == 3
        assert mod.tensor_parallel is real_tp
        with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
            assert torch.equal(run(fp8=True), ref) and torch.equal(run(fp8=True), ref)
        assert off.packed == 4
        assert sum("handing back" in r.getMessage() for r in caplog.records) == 1
        with torch.no_grad():
            wrapped(block, _x(), rope)
        assert off.packed == 4
    finally:
        state.set_current(None)
        sco_integration.reset()
        del sys.modules[mod.__name__]


def test_integration_offloader_is_rebuilt_when_the_budget_changes():
    """The process keeps one offloader (its pool lives across steps) while the settings stay the same;
    another budget gets a new offloader over a pool of that budget."""
    from megatron_peakflat.integration import sco as sco_integration

    cpu = torch.device("cpu")
    sco_integration.reset()
    try:
        first = sco_integration.get_offloader(1 << 20, 1, cpu)
        assert sco_integration.get_offloader(1 << 20, 1, cpu) is first and first.pool.budget == 1 << 20
        second = sco_integration.get_offloader(2 << 20, 1, cpu)
        assert second is not first and second.pool.budget == 2 << 20
        assert sco_integration.offloader() is second
    finally:
        sco_integration.reset()


def test_config_rejects_bad_values():
    from megatron_peakflat import PeakflatConfigError
    from megatron_peakflat.sco.config import SCOConfig

    for bad, flag in ((dict(prefetch=-1), "--peakflat-sco-prefetch"), (dict(budget=-5), "--peakflat-sco-budget"),
                      (dict(pool="cuda"), "--peakflat-sco-pool")):
        with pytest.raises(PeakflatConfigError, match=flag):
            SCOConfig(enabled=True, **bad).validate()


def test_default_budget_leaves_room_for_promised_optimizer_state():
    """The boundary pool is sized in the first forward, before OffloadStreamAdamW pins its state at the
    first step: what the optimizer promised comes off this rank's share before the budget is taken from it
    (on the 126 GiB H200 node the 128K run's SCO budget was 61.5 GiB beside the optimizer's 57.4 GiB)."""
    from megatron_peakflat.runtime import host

    gib = 1 << 30
    try:
        host.promise("test-optimizer", 57 * gib)
        assert resolve_budget(None, available=123 * gib, local_ranks=1) == int(66 * gib * 0.5)
        assert resolve_budget(None, available=123 * gib, local_ranks=2) == int((123 * gib // 2 - 57 * gib) * 0.5)
        assert resolve_budget(100 * gib, available=123 * gib, local_ranks=1) == int(66 * gib * 0.9)  # clamped
        host.promise("test-optimizer", 200 * gib)  # more than there is: nothing left for boundaries
        assert resolve_budget(None, available=123 * gib, local_ranks=1) == 0
    finally:
        host.settle("test-optimizer")
    assert resolve_budget(None, available=123 * gib, local_ranks=1) == int(123 * gib * 0.5)
