"""The test harness itself: the gloo launcher at world 1/2/4, the CPU shim's guard, child processes' environment
and the live-bytes meter."""

import gc
import os

import pytest
import torch
import torch.distributed as dist

from megatron_peakflat.testing import DistributedTestError, LiveBytesMeter, run_distributed


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return (rank, dist.get_world_size(), t.item())


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _start_a_manager(rank, world_size):
    """As Megatron's checkpoint writer does: a spawned multiprocessing Manager kept for the process's life."""
    import multiprocessing

    global _manager
    _manager = multiprocessing.get_context("spawn").Manager()
    return _manager._process.pid


def test_a_ranks_child_processes_end_with_it():
    import os

    pids = run_distributed(_start_a_manager, 2, timeout=120)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_launcher_runs_world(world):
    out = run_distributed(_all_reduce_rank, world)
    expected = world * (world + 1) / 2
    assert out == [(r, world, expected) for r in range(world)]


def _large_result(rank, world_size):
    return torch.full((256 * 1024,), float(rank))  # 1 MiB pickled: 16 times a Linux pipe's buffer


def test_launcher_returns_results_larger_than_a_pipe_buffer():
    """A rank blocks in put() until the parent reads; the parent reads while the ranks run, so no hang."""
    out = run_distributed(_large_result, 2, timeout=60)
    assert [t.numel() for t in out] == [256 * 1024] * 2
    assert [t.unique().tolist() for t in out] == [[0.0], [1.0]]


def test_launcher_reports_the_failing_rank():
    with pytest.raises(DistributedTestError) as e:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert "rank 1" in str(e.value) and "boom on rank one" in str(e.value)


def _visible_devices(rank, world_size):
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gloo_ranks_see_no_gpu_unless_asked(monkeypatch):
    """CPU ranks start with the GPUs hidden (on a GPU machine a visible one lets torch.compile's device checks
    meet the CPU shim's device); ``cuda=True`` passes the caller's setting on; the caller's own is restored."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert run_distributed(_visible_devices, 2, timeout=60) == ["", ""]
    assert run_distributed(_visible_devices, 1, timeout=60, cuda=True) == ["0,1"]
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def _probe_and_loaded(rank, world_size):
    import os
    import sys

    return os.environ.get("PEAKFLAT_PROBE"), "megatron.training" in sys.modules


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_as_it_is_at_the_call(monkeypatch, start):
    """Forked ranks take the caller's environment at each call, not the fork server's from its start, and come
    with Megatron imported; spawned ones import it themselves (this module does not)."""
    monkeypatch.setenv("PEAKFLAT_TEST_RANKS", start)
    monkeypatch.setenv("PEAKFLAT_PROBE", "first")
    assert run_distributed(_probe_and_loaded, 1, timeout=120)[0][0] == "first"
    monkeypatch.setenv("PEAKFLAT_PROBE", "second")
    assert run_distributed(_probe_and_loaded, 2, timeout=120) == [("second", start == "forkserver")] * 2


def _sleep_in_a_named_function(rank, world_size):
    import time

    time.sleep(600)


def test_a_timed_out_rank_prints_where_it_hung(capfd):
    # The deadline counts from the start, and the rank must be inside the function by then: a rank forked from
    # the server (started by the first call, outside any deadline) only imports this module first (a whole run of
    # _all_reduce_rank took 0.13 s here), which 15 s covers on cores that other processes keep busy; a spawned one
    # imports torch too, which took over 5 s with another test worker busy on both of this machine's cores.
    run_distributed(_all_reduce_rank, 1, timeout=120)
    timeout = 30 if os.environ.get("PEAKFLAT_TEST_RANKS") == "spawn" else 15
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_sleep_in_a_named_function, 1, timeout=timeout)
    assert "_sleep_in_a_named_function" in capfd.readouterr().err


def test_cpu_shim_refuses_a_process_that_initialised_cuda(monkeypatch):
    from megatron_peakflat.testing import megatron_cpu

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        megatron_cpu.install_cpu_shim()
    assert not megatron_cpu._INSTALLED


def test_child_env_puts_the_repository_first_and_keeps_the_callers_path(monkeypatch):
    import os

    from megatron_peakflat.testing.subproc import ROOT, child_env

    monkeypatch.setenv("PYTHONPATH", "/where/megatron/lives")
    env = child_env(FOO="1")
    assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, "/where/megatron/lives"] and env["FOO"] == "1"
    monkeypatch.delenv("PYTHONPATH")
    assert child_env()["PYTHONPATH"] == ROOT


@pytest.fixture
def busy_port():
    """A port something listens on, as another test's store would."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        s.listen()
        yield s.getsockname()[1]


def _first_busy(monkeypatch, module, busy: int) -> list[int]:
    """Make ``module.free_port`` answer ``busy`` first, then real ports; returns the answers given."""
    real, given = module.free_port, []

    def draw():
        given.append(busy if not given else real())
        return given[-1]

    monkeypatch.setattr(module, "free_port", draw)
    return given


def test_free_port_draws_outside_the_ephemeral_range():
    """Outgoing connections (gloo's, many per parallel test) take their local ports from that range."""
    import socket

    from megatron_peakflat.testing import distributed

    eph = distributed._ephemeral_range()
    if eph is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range on this system")
    for _ in range(20):
        port = distributed.free_port()
        assert not eph[0] <= port <= eph[1] and 20000 <= port < 65536, (port, eph)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))


def _port_held(rank, world_size):
    from megatron_peakflat.testing.distributed import _bindable

    return os.environ["TORCHELASTIC_USE_AGENT_STORE"], _bindable(int(os.environ["MASTER_PORT"]))


def test_launcher_serves_its_rendezvous_store_on_a_port_it_holds(monkeypatch):
    """The launcher's store listens before any rank starts and every rank joins it as a client (torchrun's agent
    store): no port is drawn, so none can be taken between its choice and the rendezvous, nor joined by another
    launch's ranks; a failed run raises its rank's error."""
    from megatron_peakflat.testing import distributed

    monkeypatch.setattr(distributed, "free_port", lambda: pytest.fail("the launcher drew a port"))
    assert run_distributed(_port_held, 2, timeout=120) == [("True", False)] * 2
    assert run_distributed(_all_reduce_rank, 2, timeout=120) == [(0, 2, 3.0), (1, 2, 3.0)]
    with pytest.raises(DistributedTestError, match="boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=120)


def test_a_child_run_starts_again_when_its_port_was_taken(monkeypatch, busy_port):
    """torchrun's store finds the port in use (EADDRINUSE): the child runs again on another port."""
    from megatron_peakflat.testing import subproc

    given = _first_busy(monkeypatch, subproc, busy_port)
    res = subproc.run_module("site", launcher=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert given[0] == busy_port and len(given) == 2


def test_the_interpreter_probe_skips_only_for_the_known_gap():
    """The Triton kernels' interpreter tests skip for Triton 3.6's interpreter bug and for nothing else."""
    from megatron_peakflat.testing.subproc import INTERPRETER_PROBE, probe_interpreter

    call = "_loop[(2,)](torch.tensor([3, 0], dtype=torch.int32), out)"
    assert call in INTERPRETER_PROBE
    known = 'raise TypeError("only 0-dimensional arrays can be converted to Python scalars")'
    assert "0-dimensional arrays" in probe_interpreter(INTERPRETER_PROBE.replace(call, known))
    with pytest.raises(RuntimeError, match="something else"):
        probe_interpreter(INTERPRETER_PROBE.replace(call, 'raise ValueError("something else")'))


def test_meter_counts_a_known_pattern_exactly():
    keep = torch.ones(1000)  # allocated before: never counted
    with LiveBytesMeter() as m:
        a = torch.empty(100, dtype=torch.float32)  # 400 B
        b = torch.empty(50, dtype=torch.float64)  # 400 B
        v = a.view(10, 10)  # a view: no new storage
        a.add_(1)  # in place: nothing new
        keep.mul_(2)  # in place on a pre-existing storage: nothing new
        torch.mul(a, 2, out=a)  # out=: nothing new
        assert (m.live, m.peak) == (800, 800)
        del b
        gc.collect()
        assert (m.live, m.peak) == (400, 800)
        c = torch.zeros(25)  # 100 B
        del a, v
        gc.collect()
        assert (m.live, m.peak) == (100, 800)
        m.reset_peak()
        d = torch.empty(300)  # 1200 B
        del d
        assert (m.live, m.peak) == (100, 1300)
        assert m.allocations == 4
    del c


def test_meter_tracks_autograd_saved_tensors():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    with LiveBytesMeter() as m:
        y = torch.relu(x @ w)  # x@w dies at once; relu's output is kept (saved for backward)
        loss = y.sum()  # a 4-byte scalar
        assert m.live == 64 * 16 * 4 + 4
        loss.backward()  # grads of x and w are new storages; the saved output is released
        del y, loss
        gc.collect()
        assert m.live == (64 * 32 + 32 * 16) * 4
    assert m.peak >= 2 * 64 * 16 * 4


def test_meter_waits_for_a_storage_that_another_thread_lets_go_of():
    """The shape of gloo's late release: the last reference dies on a worker thread after the caller moved on."""
    import threading
    import time

    with LiveBytesMeter() as m:
        box = [torch.empty(100)]  # 400 B, held only by the box
    releaser = threading.Timer(0.2, box.clear)
    releaser.start()
    started = time.monotonic()
    assert m.live == 400
    assert m.wait_for(lambda: m.live == 0, timeout_s=5.0) and m.live == 0
    assert 0.1 < time.monotonic() - started < 5.0
    releaser.join()
    with LiveBytesMeter() as m:
        kept = torch.empty(10)  # really kept: the wait gives up and says so
    assert not m.wait_for(lambda: m.live == 0, timeout_s=0.05) and m.live == 40
    del kept


def test_meter_live_since_counts_by_order_not_by_key():
    with LiveBytesMeter() as m:
        a = torch.empty(10)  # 40 B
        mark = m.allocations
        assert m.live_since(mark) == {}
        b = torch.empty(20)  # 80 B
        assert list(m.live_since(mark).values()) == [80]
        assert sorted(m.live_since(0).values()) == [40, 80]
        del b
        gc.collect()
        assert m.live_since(mark) == {}
        c = torch.empty(30)  # 120 B: new, even if it reuses b's key
        assert list(m.live_since(mark).values()) == [120]
    del a, c


# ---- bench/harness.py: results merging and the largest-fitting search ---------------------------

def _oracle(threshold):
    from bench.harness import Trial

    calls = []

    def attempt(size):
        calls.append(size)
        return Trial(size, size <= threshold, peak_gib=size / 1000)

    return attempt, calls


@pytest.mark.parametrize("threshold", [1, 7, 8, 9, 63, 64, 100, 1000])
@pytest.mark.parametrize("start", [8, 40, 64, 200])
def test_largest_fitting_finds_the_threshold_from_any_start(threshold, start):
    from bench.harness import largest_fitting

    attempt, calls = _oracle(threshold)
    best, first_fail, tries, complete = largest_fitting(attempt, step=8, start=start, limit_size=512)
    expect = (min(threshold, 512) // 8) * 8 or None
    assert best == expect and complete
    if threshold < 512:
        assert first_fail == (best or 0) + 8  # a tight bracket: the next step was tried and failed
    else:
        assert first_fail is None  # everything up to the limit fits
    assert len(calls) == len(set(calls)) <= 2 * 7 + 2  # no size twice; logarithmic in 512 / 8
    assert [t.size for t in tries] == calls


def test_largest_fitting_uses_known_tries_and_never_repeats_them():
    from bench.harness import Trial, largest_fitting

    attempt, calls = _oracle(100)
    known = [Trial(16, True), Trial(60, True), Trial(130, False)]  # 60 and 130 are not multiples of 8
    best, first_fail, tries, complete = largest_fitting(attempt, step=8, start=96, limit_size=1024, known=known)
    assert (best, first_fail, complete) == (96, 104, True)
    assert not {16, 60, 130} & set(calls) and tries[:3] == known
    # a known failure at the first step: nothing fits, nothing is tried
    attempt, calls = _oracle(100)
    assert largest_fitting(attempt, step=8, start=64, limit_size=64, known=[Trial(8, False)])[:2] == (None, 8)
    assert calls == []


def test_largest_fitting_stops_at_the_deadline():
    from bench.harness import largest_fitting

    now = [0.0]

    def attempt(size):
        from bench.harness import Trial

        now[0] += size / 10  # a try costs size / 10 seconds
        return Trial(size, size <= 400)

    best, _, _, complete = largest_fitting(attempt, step=8, start=8, limit_size=4096, deadline=50.0,
                                           cost=lambda s: s / 10, clock=lambda: now[0])
    assert not complete and best is not None and best < 400  # a lower bound only
    assert now[0] <= 50.0  # the cost estimate kept it from starting a try that would overrun
    with pytest.raises(ValueError):
        largest_fitting(attempt, step=0, start=8, limit_size=64)


def test_write_merges_rows_by_case_and_method(tmp_path, monkeypatch):
    import json

    from bench.harness import Row, write

    monkeypatch.delenv("OUT", raising=False)
    path = tmp_path / "sco.json"
    write("sco", [Row("S=1", "peakflat", 1.0, 2.0, True), Row("S=1", "save-on-cpu", 3.0, 4.0, True)],
          command="main run", out=path)
    write("sco", [Row("max-seq,limit=1GiB", "peakflat", None, None, None, {"max_seq": 8}),
                  Row("S=1", "save-on-cpu", 5.0, 6.0, False)], command="max-seq run", out=path, merge=True)
    doc = json.loads(path.read_text())
    assert doc["command"] == "main run" and doc["merged_commands"] == ["max-seq run"]
    assert [(r["case"], r["method"], r["peak_gib"]) for r in doc["rows"]] == [
        ("S=1", "peakflat", 1.0), ("S=1", "save-on-cpu", 5.0), ("max-seq,limit=1GiB", "peakflat", None)]
    assert doc["rows"][2]["extra"] == {"max_seq": 8}
    # without merge the file is replaced, as before
    write("sco", [Row("S=2", "peakflat", 1.0, 1.0, True)], command="again", out=path)
    assert [r["case"] for r in json.loads(path.read_text())["rows"]] == ["S=2"]
    # merge into a file that does not exist yet: a plain write
    other = tmp_path / "new.json"
    write("sco", [Row("S=3", "peakflat", 1.0, 1.0, True)], command="c", out=other, merge=True)
    assert json.loads(other.read_text())["command"] == "c"


def test_trace_gaps_finds_idle_stretches_and_charges_the_host_frames_inside_them():
    from tools.probes.trace_gaps import charge, gpu_gaps

    k = lambda ts, dur: {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}  # noqa: E731
    host = lambda name, ts, dur: {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    # kernels: [0, 100], [90, 150] (overlapping), [400, 450], [460, 500]: one gap over 50 us, 150 -> 400
    events = [k(0, 100), k(90, 60), k(400, 50), k(460, 40),
              host("step", 0, 500), host("plan", 120, 200), host("launch", 380, 10), host("before", 0, 10)]
    gaps = gpu_gaps(events, 50)
    assert gaps == [(150, 400)]
    got = charge(events, gaps)
    assert got[("python_function", "step")] == 250
    assert got[("python_function", "plan")] == 170  # 150 -> 320
    assert got[("python_function", "launch")] == 10
    assert ("python_function", "before") not in got


def test_gap_summary_counts_only_time_when_no_stream_runs():
    from bench.harness import gap_summary, idle_gaps

    # a long kernel on one stream [0, 100] covers a short one [10, 20] and a gap between short ones
    spans = [(0.0, 100.0, "long"), (10.0, 20.0, "a"), (30.0, 40.0, "b"), (1100.0, 1200.0, "c")]
    assert idle_gaps(spans) == [(100.0, 1100.0, "long", "c")]
    assert gap_summary(spans).startswith("idle between kernels 1.00 ms/step")


def test_cuda_kernels_leave_out_annotations():
    from types import SimpleNamespace

    from bench.harness import cuda_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, dev, a, b, ann=False: SimpleNamespace(  # noqa: E731
        name=name, device_type=dev, device_time=(b - a), time_range=SimpleNamespace(start=a, end=b),
        is_user_annotation=ann)
    prof = SimpleNamespace(events=lambda: [ev("call", cpu, 0, 900, True), ev("call", cuda, 5, 800),
                                           ev("gemm", cuda, 10, 300), ev("gemm", cuda, 400, 700),
                                           ev("region", cuda, 0, 50, True)])
    kern, spans = cuda_kernels(prof)
    assert kern == {"gemm": [0.59, 2.0]}
    assert spans == [(10, 300, "gemm"), (400, 700, "gemm")]


def test_more_rounds_times_methods_in_turn_and_keeps_the_median(monkeypatch):
    import bench.harness as h

    timed: list[str] = []
    times = iter([9.0, 30.0, 11.0, 20.0])  # rounds 2 and 3 of a and b, in the order they are timed

    def fake_measure(fn, *, warmup, reps):
        fn()
        return 0.0, next(times)

    monkeypatch.setattr(h, "measure", fake_measure)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = [h.Row("c", "a", 1.0, 10.0, True), h.Row("c", "oom", None, None, None, {"error": "OOM"}),
            h.Row("c", "b", 1.0, 40.0, True)]
    out = h.more_rounds(rows, lambda row: (lambda: timed.append(row.method)), 3, warmup=0, reps=1)
    assert out is rows and timed == ["a", "b", "a", "b"]  # in turn; the row without a time is not run
    assert rows[0].extra["ms_rounds"] == [10.0, 9.0, 11.0] and rows[0].ms == 10.0
    assert rows[2].extra["ms_rounds"] == [40.0, 30.0, 20.0] and rows[2].ms == 30.0
    assert rows[1].ms is None and "ms_rounds" not in rows[1].extra
    assert h.more_rounds(rows, lambda row: None, 1, warmup=0, reps=1) is rows  # one round: nothing more


def test_rows_record_where_they_ran_and_a_merge_keeps_each_rows_own(tmp_path, monkeypatch):
    """Every written row records its card, host threads and commit; a merge of rows measured elsewhere keeps
    both sets of rows' own fields (the file's top-level device stays its main run's), and a row written before
    rows recorded a card is left without one."""
    import json

    from bench.harness import Row, where_ran, write
    from bench.summarize import where

    monkeypatch.delenv("OUT", raising=False)
    here = where_ran()
    assert here["card"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert here["threads"] == torch.get_num_threads() and here["commit"]
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps({"component": "vocab", "device": "NVIDIA H200", "torch": "2.11", "megatron_core": "0.19",
                                "command": "old run", "rows": [{"case": "N=1", "method": "cce", "peak_gib": 1.0,
                                                                "ms": 3.0, "exact": True, "extra": {}}]}))
    write("vocab", [Row("N=1", "liger-flce", 1.0, 2.0, True, card="NVIDIA H100 80GB HBM3", threads=16, commit="abc1234")],
          command="h100 run", out=path, merge=True)
    write("vocab", [Row("N=1", "peakflat", 1.0, 1.0, True)], command="here", out=path, merge=True)
    doc = json.loads(path.read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    assert doc["device"] == "NVIDIA H200"  # the main run's, untouched
    assert "card" not in rows["cce"]  # not invented
    assert (rows["liger-flce"]["card"], rows["liger-flce"]["threads"], rows["liger-flce"]["commit"]) == (
        "NVIDIA H100 80GB HBM3", 16, "abc1234")
    assert (rows["peakflat"]["card"], rows["peakflat"]["threads"], rows["peakflat"]["commit"]) == (
        here["card"], here["threads"], here["commit"])
    assert where(doc) == (f"rows' cards: NVIDIA H100 80GB HBM3 (1 rows), {here['card']} (1 rows); 1 rows record none "
                          "(the file's main run: NVIDIA H200)")


def test_a_ratio_is_computed_only_between_rows_of_the_same_card():
    from bench.harness import Row, ratio
    from bench.summarize import ratio_note

    h100 = Row("N=1", "peakflat", 1.0, 300.0, True, card="NVIDIA H100", threads=16, commit="a")
    liger = Row("N=1", "liger-flce", 1.0, 400.0, True, card="NVIDIA H100", threads=16, commit="a")
    h200 = Row("N=1", "liger-flce", 1.0, 350.0, True, card="NVIDIA H200", threads=16, commit="a")
    assert ratio(h100, liger) == pytest.approx(0.75) and ratio(h100, liger, "peak_gib") == 1.0
    with pytest.raises(ValueError, match="different cards: peakflat@NVIDIA H100 vs liger-flce@NVIDIA H200"):
        ratio(h100, h200)
    unknown = {"case": "N=1", "method": "cce", "peak_gib": 1.0, "ms": 1.0, "exact": True, "extra": {}}
    with pytest.raises(ValueError, match="cce@no card recorded"):
        ratio(h100, unknown)
    doc = {"rows": [dict(vars(h100)), dict(vars(h200)), unknown]}
    assert "different cards" in ratio_note(doc, "N=1", "peakflat", "liger-flce")
    doc["rows"][1] = dict(vars(liger))
    assert ratio_note(doc, "N=1", "peakflat", "liger-flce") == "peakflat / liger-flce = 0.750 (ms, both on NVIDIA H100)"


def test_where_ran_marks_a_tree_that_is_not_its_commit(tmp_path, monkeypatch):
    """A row names the commit only where the tracked code is that commit: an edited tracked file appends
    '+modified'; results under bench/results (which the run itself writes) do not."""
    import importlib.util
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parent.parent / "bench" / "harness.py", repo / "bench" / "harness.py")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "bench" / "results" / "r.json").write_text("{}\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=repo, check=True)
    spec = importlib.util.spec_from_file_location("harness_copy", repo / "bench" / "harness.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    (repo / "bench" / "results" / "r.json").write_text('{"rows": []}\n')
    assert mod.where_ran()["commit"] == head
    (repo / "code.py").write_text("x = 2\n")
    assert mod.where_ran()["commit"] == head + "+modified"


# ---- testing.forked_module: the CPU dry runs' ranks forked from the preloaded server -------------------------

def _forked(mode: str, nproc: int = 1, timeout: float = 120, **env: str):
    import os

    from megatron_peakflat.testing.forked_module import run_forked
    from megatron_peakflat.testing.subproc import ROOT, child_env

    from megatron_peakflat.testing.distributed import free_port

    return run_forked("tests._forked_probe", [mode, "--flag"], nproc=nproc, launcher=nproc > 1,
                      env=child_env(MASTER_PORT=str(free_port()), **env), cwd=str(ROOT),
                      timeout=timeout), os.path.realpath(ROOT)


def test_forked_ranks_run_the_module_as_torchrun_starts_it(monkeypatch):
    """Each rank runs the module as __main__ with its argv, the caller's environment at the call, torchrun's rank
    variables, a session of its own, from the repository root, its rendezvous store's port already held by the
    launcher; both ranks' stdout and stderr come back apart."""
    monkeypatch.setenv("PEAKFLAT_PROBE", "at-the-call")
    out, root = _forked("ok", nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank={rank} world=2 port_held=True agent_store=True probe=at-the-call cwd={root} "
                f"argv=['ok', '--flag'] leads_group=True main=__main__") in out.stdout, out.stdout
        assert f"stderr of rank {rank}" in out.stderr and f"stderr of rank {rank}" not in out.stdout
    one, _ = _forked("ok")  # without the launcher: no rank variables, in the caller's process group, its own port
    assert one.returncode == 0, one.stderr[-3000:]
    assert "rank=None world=None port_held=False agent_store=None" in one.stdout and "leads_group=False" in one.stdout


def test_forked_ranks_exit_as_the_interpreter_would():
    assert _forked("exit-3")[0].returncode == 3
    out, _ = _forked("raise-on-1", nproc=2)
    assert out.returncode == 1 and "ValueError: boom on rank one" in out.stderr, out.stderr[-3000:]
    assert "rank 1 (pid " in out.stderr and "failed: exit code 1" in out.stderr  # rank 0 was stopped, not waited for
    out, _ = _forked("sigkill-on-1", nproc=2)
    assert out.returncode == 1 and "Signal 9 (SIGKILL)" in out.stderr, out.stderr[-3000:]


def test_forked_ranks_past_the_timeout_are_killed_and_it_raises():
    import subprocess
    import time

    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        _forked("sleep", nproc=2, timeout=5)
    assert time.monotonic() - started < 60 and "stderr of rank" in e.value.stderr
