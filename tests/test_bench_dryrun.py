"""The multi-rank benchmarks run their whole logic on CPU before they cost GPU time: under torchrun
with 2 gloo ranks, bench/dispatch.py (EP=2, every method exact against Megatron's dispatcher, the
overlap method added) and bench/vocab.py (TP=2 with sequence parallelism, Ring-DTP and Megatron's
vocab-parallel CE exact against an fp64 reference)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_peakflat.testing.subproc import child_env, run_on_free_port


def _torchrun(*args: str) -> str:
    env = child_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # a dry run is a CPU run, GPUs or not
    res = run_on_free_port(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                         "--master-port", str(port), *args], env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def test_dispatch_benchmark_at_ep2_on_cpu():
    methods = "megatron-alltoall,llep-unchunked,peakflat,peakflat-nooverlap,peakflat-overlap,peakflat-strided,peakflat-hybrid"
    out = _torchrun("bench/dispatch.py", "--dry-run", "--skews", "0,95", "--regimes", "full", "--methods", methods)
    lines = [line for line in out.splitlines() if "ep=2" in line]
    ours = [line for line in lines if "megatron-alltoall" not in line]
    assert {line.split()[1] for line in ours} == set(methods.split(",")[1:]), out[-2000:]
    assert len(ours) == 2 * 2 * 6 and all("exact=True" in line for line in ours), out[-2000:]  # 2 T x 2 skews x 6 methods


def test_vocab_benchmark_at_tp2_on_cpu():
    out = _torchrun("bench/vocab.py", "--dry-run")
    rows = [line for line in out.splitlines() if "tp=2" in line]
    assert {r.split()[1] for r in rows} == {"peakflat", "peakflat-main-grad", "peakflat-gather-main-grad",
                                           "megatron-native-ce"}, out[-2000:]
    assert all("exact=True" in r for r in rows) and "dry run: every method exact" in out, out[-2000:]
    assert "was not the loss's real gradient" not in out  # the in-forward rows were told 1/N


def test_pretrain_compare_reads_megatron_log():
    """bench/pretrain_compare.py's reading of a Megatron training log: every loss and grad norm, the median
    iteration time after the first two, and rank 0's memory report after two iterations."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.pretrain_compare import parse_log

    lines = [f" [2026-11-30] iteration {i}/ 4 | elapsed time per iteration (ms): {t} | learning rate: 1.0E-04 | "
             f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {g} |"
             for i, t, loss, g in ((1, 900.0, 10.6, 3.5), (2, 500.0, 10.1, 2.5), (3, 410.0, 9.5, 1.5),
                                   (4, 430.0, 9.1, 1.25))]
    lines.insert(2, "[Rank 0] (after 2 iterations) memory (MB) | allocated: 1234.50 | max allocated: 2345.25 | "
                    "reserved: 3000.00 | max reserved: 3000.00")
    got = parse_log("\n".join(lines))
    assert got["lm_loss"] == [10.6, 10.1, 9.5, 9.1] and got["grad_norm"] == [3.5, 2.5, 1.5, 1.25]
    assert got["ms_per_iter"] == 420.0
    assert (got["allocated_mib"], got["max_allocated_mib"]) == (1234.5, 2345.25)
    assert parse_log("no log")["ms_per_iter"] is None
    assert got["timers_ms"] == {}


def test_pretrain_compare_reads_megatron_timers():
    """Megatron's timer report, written in the two formats of ``megatron.core.timers`` ("(min, max)" and
    "max"), read back per timer as the maximum across ranks, in log order; the loss lines around it are not
    timers, and a torchrun rank prefix is allowed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.pretrain_compare import timers_of

    def report(times: dict[str, tuple[float, float]], max_only: bool = False, prefix: str = "") -> str:
        out = "max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"
        for name, (lo, hi) in times.items():
            label = (name + " ").ljust(48, ".")
            out += f"\n{prefix}    {label}: {hi:.2f}" if max_only else f"\n{prefix}    {label}: ({lo:.2f}, {hi:.2f})"
        return out

    long_name = "a-timer-name-longer-than-the-forty-eight-columns-megatron-pads"
    log = "\n".join([
        " [2026-11-30] iteration 3/ 4 | elapsed time per iteration (ms): 410.0 | lm loss: 9.5E+00 |",
        report({"forward-backward": (1189.25, 1201.5), "optimizer": (180.0, 197.25)}),
        " [2026-11-30] iteration 4/ 4 | elapsed time per iteration (ms): 430.0 | lm loss: 9.1E+00 |",
        report({"forward-backward": (0.0, 1218.0), long_name: (1.0, 2.0)}, max_only=True, prefix="[default0]:"),
    ])
    assert timers_of(log) == {"forward-backward": [1201.5, 1218.0], "optimizer": [197.25], long_name: [2.0]}


def test_pretrain_compare_names_an_oom_and_compares_losses():
    """A run that died of CUDA OOM keeps the allocator's message and the innermost frames it died in, with
    paths cut to their package; a log without one has none; two runs' loss gap is the largest relative one."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.pretrain_compare import loss_gap, oom_of, parse_log

    log = "\n".join([
        " [2026-11-30] iteration 1/ 4 | lm loss: 1.0E+01 |",
        "Traceback (most recent call last):",
        '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/autograd/function.py", line 5, in apply',
        '  File "/tmp/site/megatron/training/training.py", line 10, in train_step',
        "    losses = forward_backward_func()",
        '  File "/tmp/site/megatron/core/tensor_parallel/cross_entropy.py", line 120, in forward',
        "    exp_logits = torch.exp(vocab_parallel_logits)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 48.00 GiB. GPU 0 has a total capacity "
        "of 139.81 GiB of which 20.10 GiB is free.",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.",
    ])
    got = oom_of(log)
    assert got["message"].startswith("CUDA out of memory. Tried to allocate 48.00 GiB"), got
    assert got["where"] == ["torch/autograd/function.py:5 apply", "megatron/training/training.py:10 train_step",
                            "megatron/core/tensor_parallel/cross_entropy.py:120 forward"], got
    assert parse_log(log)["oom"] == got
    assert oom_of(log.replace("OutOfMemoryError", "RuntimeError")) is None
    gap = loss_gap([10.0, 9.0, 8.0], [10.0, 9.009, 8.004, 7.0])
    assert gap["iterations"] == 3 and gap["at_iteration"] == 2 and abs(gap["max_rel_diff"] - 1e-3) < 1e-12
    assert loss_gap([], [1.0])["max_rel_diff"] is None
    assert loss_gap([10.0, 9.0, 8.0, 7.0], [10.0, 9.00001, 8.1, 7.0])["first_above_1e-3"] == 3
    assert loss_gap([10.0, 9.0], [10.0, 9.00001])["first_above_1e-3"] is None


def test_pretrain_compare_timeout_kills_the_whole_session():
    """--timeout ends every process a run started (a launcher's children too), with status 124."""
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.pretrain_compare import run_in_session

    marker = Path("/tmp") / f"peakflat_timeout_{os.getpid()}"
    marker.unlink(missing_ok=True)
    t0 = time.monotonic()
    rc, out = run_in_session(["bash", "-c", f"echo started; (sleep 3; touch {marker}) & sleep 60"], dict(os.environ), 1.0)
    assert rc == 124 and "started" in out and "killed after --timeout" in out
    assert time.monotonic() - t0 < 20
    time.sleep(3.5)
    assert not marker.exists(), "a child of the timed-out run survived it"
    assert run_in_session(["bash", "-c", "echo fine"], dict(os.environ), 10.0) == (0, "fine\n")


def test_pretrain_compare_timeout_does_not_wait_on_a_process_that_left_the_session():
    """A grandchild that called setsid survives the session's kill and holds the output pipe: the call still
    returns within the drain time, 124, with a line saying the rest of the output is lost."""
    import subprocess
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.pretrain_compare import run_in_session

    survivor = f"sleep 30.{os.getpid()}"  # a name of its own: the clean-up below stops this one and no other
    t0 = time.monotonic()
    rc, out = run_in_session(["bash", "-c", f"echo started; setsid {survivor} & sleep 60"], dict(os.environ), 1.0,
                             drain=1.0)
    assert rc == 124 and "killed after --timeout" in out and "the rest is lost" in out
    assert time.monotonic() - t0 < 10
    subprocess.run(["pkill", "-f", f"^{survivor}$"], check=False)


def test_memory_peak_replays_a_snapshot_to_its_highest_point():
    """bench/memory_peak.py walks the allocator's events back from the live state: the peak inside the window
    and the blocks alive there (a block freed before the snapshot included), charged to their first frame in
    this package or Megatron."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.memory_peak import by_site, events, find_peak, pending_at, report

    def fr(path: str, line: int) -> list[dict]:
        return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/site/{path}", "line": line, "name": "f"}]

    a, b, c, d = fr("megatron/core/a.py", 1), fr("megatron_peakflat/vocab/b.py", 2), fr("megatron/core/c.py", 3), fr("x/d.py", 4)
    snap = {"segments": [{"blocks": [{"address": 1, "size": 100, "state": "active_allocated", "frames": a},
                                     {"address": 4, "size": 10, "state": "active_allocated", "frames": d},
                                     {"address": 9, "size": 7, "state": "inactive"}]}],
            "device_traces": [[{"action": "alloc", "addr": 2, "size": 50, "frames": b},
                               {"action": "alloc", "addr": 3, "size": 200, "frames": c},
                               {"action": "free_requested", "addr": 3, "size": 200, "frames": c},
                               {"action": "free_completed", "addr": 3, "size": 200, "frames": c},
                               {"action": "alloc", "addr": 4, "size": 10, "frames": d},
                               {"action": "free_requested", "addr": 2, "size": 50, "frames": b},
                               {"action": "free_completed", "addr": 2, "size": 50, "frames": b}]]}
    peak = find_peak(snap)
    assert peak.bytes == 350 and sorted(peak.live) == [1, 2, 3] and peak.event == 2
    assert by_site(peak.live) == [("megatron/core/c.py:3 f", 200, 1), ("megatron/core/a.py:1 f", 100, 1),
                                  ("megatron_peakflat/vocab/b.py:2 f", 50, 1)]
    lines = list(report(snap))
    assert "at the snapshot" in lines[0] and "reached by event 1, alloc" in lines[1] and len(lines) == 5
    assert len(list(report(snap, depth=2))) == 7  # the stack of the alloc that reached the peak
    listed = list(report(snap, blocks=2))[5:]
    assert listed[0] == "the 2 largest blocks at the peak, with their stacks:"
    assert "(200 B)" in listed[1] and listed[3].strip() == "megatron/core/c.py:3 f" and "(100 B)" in listed[4]
    assert find_peak({"segments": snap["segments"]}).bytes == 110  # no history: the live state is all there is
    # a free event may carry another stack than the block's alloc: the block keeps its own
    snap["device_traces"][0][2]["frames"] = d
    assert find_peak(snap).live[3] == (200, c)
    # a block freed while another stream still used it (record_stream) stops counting as allocated at its
    # free_requested, as the allocator's own statistics do, though its free_completed comes later
    deferred = {"segments": [{"blocks": []}],
                "device_traces": [[{"action": "alloc", "addr": 5, "size": 300, "frames": a},
                                   {"action": "free_requested", "addr": 5, "size": 300, "frames": a},
                                   {"action": "alloc", "addr": 6, "size": 100, "frames": b},
                                   {"action": "free_completed", "addr": 5, "size": 300, "frames": a},
                                   {"action": "free_requested", "addr": 6, "size": 100, "frames": b},
                                   {"action": "free_completed", "addr": 6, "size": 100, "frames": b}]]}
    peak = find_peak(deferred)
    assert peak.bytes == 300 and list(peak.live) == [5]
    assert pending_at(deferred, 3) == 300 and pending_at(deferred, 4) == 0 and pending_at(deferred, 6) == 0
    listed = list(events(deferred, 200))  # the 300-byte block's three events, not the 100-byte one's
    assert [line.split()[:3] for line in listed] == [["0", "alloc", "0.000"], ["1", "free_requested", "0.000"],
                                                     ["3", "free_completed", "0.000"]]
    assert listed[0].endswith("megatron/core/a.py:1")


def test_optimizer_benchmark_dry_run_on_cpu(tmp_path):
    """bench/optimizer.py --dry-run on CPU: tiny shapes through every step that runs without CUDA, rows written with
    where they ran; each time the median of 5 repetitions per round, min and max kept, 3 rounds in turn; the host
    kernel's rate measured the same way; the CUDA-only peers and the copy bandwidths skipped with their reason
    (so no roofline); fewer than 5 repetitions refused."""
    import json
    import subprocess

    out = tmp_path / "optimizer.json"
    env = child_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "bench.optimizer", "--dry-run", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"peakflat", "peakflat-gpu", "peakflat-cpu", "gpu-fused-adamw", "megatron-hybrid-optimizer",
                         "megatron-hybrid-optimizer-nooverlap"}
    for name, r in rows.items():
        assert (r["card"], r["threads"]) == ("cpu", 1) and r["commit"], r
        if name.startswith("megatron-hybrid"):
            assert r["ms"] is None and "CUDA" in r["extra"]["skipped"], r
            continue
        e = r["extra"]
        assert r["exact"] is True and e["reps"] == 5 and e["rounds"] == 3 and len(e["ms_rounds"]) == 3, r
        assert e["ms_min"] <= r["ms"] <= e["ms_max"], r
        assert e["runs_ms"] == e["ms_rounds"] and r["ms"] == sorted(e["runs_ms"])[1] and e["spread"] >= 0, r
        assert e["host_kernel_gparam_s_min"] <= e["host_kernel_gparam_s"] <= e["host_kernel_gparam_s_max"], r
        assert e["host_kernel_gparam_s_reps"] == 5 and "CUDA" in e["bandwidth_skipped"], r
        assert "roofline_ms" not in e and "duplex_bound_ms" not in e, r
    bad = subprocess.run([sys.executable, "-m", "bench.optimizer", "--dry-run", "--reps", "3", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert bad.returncode != 0 and "at least 5 repetitions" in bad.stderr, bad.stderr[-2000:]
