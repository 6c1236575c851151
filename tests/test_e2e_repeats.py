"""bench/e2e.py's repeated timings, same-loss cases, error lines, extra flags, explicit lengths and background runs."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import e2e  # noqa: E402
from tests.test_e2e import FITS, FakeMegatron, _driver, _value  # noqa: E402

K = 1024


class Noisy(FakeMegatron):
    """FakeMegatron whose time per iteration follows ``times`` per configuration key, one value per process."""

    def __init__(self, fits, times: dict[str, list[float]]) -> None:
        super().__init__(fits)
        self.times, self.envs = {k: list(v) for k, v in times.items()}, []

    def __call__(self, cmd, env, timeout):
        self.envs.append(env)
        key = self.key(cmd)
        if key in self.times and int(_value(cmd, "--seq-length")) <= self.fits[key]:
            self.speed[key] = self.times[key].pop(0) / (100.0 + int(_value(cmd, "--seq-length")) / K)
        return super().__call__(cmd, env, timeout)


def test_the_time_phase_repeats_each_method_in_turn_and_records_every_run(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = Noisy(FITS, {"gpu-optimizer": [200.0, 210.0, 205.0], "auto": [100.0, 104.0, 102.0]})
    d = _driver(tmp_path, fake)
    d.timing([8 * K], ["megatron-te", "peakflat-auto"], 5, repeats=3)
    assert fake.calls == [(8 * K, "gpu-optimizer"), (8 * K, "auto")] * 3  # in turn, each run its own process
    case = f"time,seq={8 * K},spec=te,iters=5"
    te, auto = d.row(case, "megatron-te"), d.row(case, "peakflat-auto")
    assert te["ms"] == 205.0 and te["extra"]["runs_ms"] == [200.0, 210.0, 205.0]
    assert te["extra"]["spread"] == round(10.0 / 205.0, 4) and te["extra"]["outcome"] == "ok"
    assert auto["ms"] == 102.0 and len(auto["extra"]["runs"]) == 3
    for run in (*te["extra"]["runs"], *auto["extra"]["runs"]):  # every iteration's own time is kept
        assert len(run["iter_ms"]) == 5 and run["ms"] == statistics.median(run["iter_ms"][1:])
    assert auto["extra"]["tokens_per_s_vs_megatron_te"] == round(205.0 / 102.0, 3)
    assert auto["extra"]["tokens_per_s_vs_megatron_te_range"] == [round(200.0 / 104.0, 3), round(210.0 / 100.0, 3)]
    assert auto["extra"]["overlaps_1x"] is False and auto["extra"]["megatron_te_config"] == "gpu-optimizer"
    again = Noisy(FITS, {})
    _driver(tmp_path, again).timing([8 * K], ["megatron-te", "peakflat-auto"], 5, repeats=3)
    assert again.calls == []  # every run is in the file
    more = Noisy(FITS, {"gpu-optimizer": [190.0], "auto": [220.0]})
    _driver(tmp_path, more).timing([8 * K], ["megatron-te", "peakflat-auto"], 5, repeats=4)  # one more run each
    assert more.calls == [(8 * K, "gpu-optimizer"), (8 * K, "auto")]
    checks = _driver(tmp_path, Noisy(FITS, {})).time_summary()
    assert len(checks) == 1 and checks[0].overlaps_one  # 220 ms against 190-210: the runs cannot tell them apart


def test_megatron_climbs_its_ladder_in_the_time_phase_and_a_length_it_cannot_fit_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = Noisy({**FITS, "cpu-offload+activation-offload": 48 * K}, {})
    d = _driver(tmp_path, fake)
    d.timing([32 * K, 64 * K], ["megatron-te", "peakflat-auto"], 5, repeats=2)
    assert fake.calls == [(32 * K, "gpu-optimizer"), (32 * K, "cpu-offload"), (32 * K, "auto"),
                          (32 * K, "cpu-offload"), (32 * K, "auto"),
                          (64 * K, "gpu-optimizer"), (64 * K, "cpu-offload"), (64 * K, "cpu-offload+activation-offload")]
    te = d.row(f"time,seq={32 * K},spec=te,iters=5", "megatron-te")
    assert te["extra"]["config"] == "cpu-offload" and [x["outcome"] for x in te["extra"]["attempts"]] == ["oom", "ok"]
    assert "--optimizer-cpu-offload" in fake.flags[2]  # peakflat-auto on megatron-te's configuration there
    assert d.row(f"time,seq={64 * K},spec=te,iters=5", "peakflat-auto") is None
    assert d.row(f"time,seq={64 * K},spec=te,iters=5", "megatron-te")["extra"]["outcome"] == "oom"


def test_same_loss_in_fp32_records_the_gaps_beside_their_targets_with_tf32_off(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = Noisy(FITS, {})
    fake.drift = {"auto": 1e-7, "all": 1e-4}  # at iteration 50: 4.9e-6 and 4.9e-3
    d = e2e.Driver(tmp_path / "e2e.json", e2e.dataclasses.replace(e2e.TINY, bf16=False), "te", False, 100.0,
                   runner=fake)
    d.same_loss(8 * K, 50)
    case = f"same_loss,seq={8 * K},spec=te,iters=50,dtype=fp32"
    assert [k for _, k in fake.calls] == ["gpu-optimizer", "auto", "all"]  # no control in fp32
    assert all(env["NVIDIA_TF32_OVERRIDE"] == "0" for env in fake.envs)
    assert all("--bf16" not in c for c in fake.flags)
    assert "--optimizer-cpu-offload" not in fake.flags[1]  # peakflat-auto on megatron-te's configuration of this case
    auto, every = d.row(case, "peakflat-auto"), d.row(case, "peakflat-all")
    assert auto["extra"]["targets"] == {"loss": 1e-5, "grad_norm": 1e-4} and auto["extra"]["env"]
    assert auto["extra"]["within_targets"] is True and auto["exact"] is True
    assert every["extra"]["within_targets"] is False
    assert every["extra"]["vs_megatron_te"]["loss"]["max_rel_diff"] == pytest.approx(49e-4, rel=1e-2)


def test_same_loss_runs_nothing_more_where_megatron_te_did_not_train(tmp_path, monkeypatch):
    """Without megatron-te's losses there is nothing to compare with: the other methods are not run (in fp32 on
    Transformer Engine's layers start-up refuses megatron-te, whose unfused attention holds [s, s] tensors)."""
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = Noisy({**FITS, "gpu-optimizer": 4 * K}, {})
    d = e2e.Driver(tmp_path / "e2e.json", e2e.dataclasses.replace(e2e.TINY, bf16=False), "te", False, 100.0,
                   runner=fake)
    d.same_loss(8 * K, 50)
    assert [k for _, k in fake.calls] == ["gpu-optimizer"]
    case = f"same_loss,seq={8 * K},spec=te,iters=50,dtype=fp32"
    assert d.row(case, "megatron-te")["extra"]["outcome"] == "oom" and d.row(case, "peakflat-auto") is None


def test_same_loss_cases_name_dtype_and_a_learning_rate_other_than_the_default(tmp_path):
    d = _driver(tmp_path, FakeMegatron(FITS))
    assert d.same_loss_case(8192, 50) == "same_loss,seq=8192,spec=te,iters=50"  # the committed rows' name
    d.model = e2e.dataclasses.replace(d.model, lr=1e-5)
    assert d.same_loss_case(8192, 50) == "same_loss,seq=8192,spec=te,iters=50,dtype=bf16,lr=1e-05"
    d.model = e2e.dataclasses.replace(d.model, lr=3e-4, bf16=False)
    assert d.same_loss_case(8192, 50) == "same_loss,seq=8192,spec=te,iters=50,dtype=fp32"


def test_an_error_row_keeps_the_failing_ranks_own_lines_not_the_launchers_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    log = "\n".join([
        "/site/megatron/core/x.py:1: UserWarning: ImportError: apex is not installed",
        " iteration 1/2 | elapsed time per iteration (ms): 900.0 | lm loss: 1.2E+01 | grad norm: 4.4 |",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/site/transformer_engine/pytorch/attention/rope.py", line 120, in forward',
        "[rank0]:     output = tex.fused_rope_forward(t, freqs, False)",
        "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered",
        "[rank0]: CUDA kernel errors might be asynchronously reported at some other API call.",
        "E1206 12:00:00 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 0",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3/torch/distributed/run.py", line 9, in main',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "============================================================",
        "Root Cause (first observed failure):",
        "  exitcode  : 1 (pid: 7)",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "============================================================",
    ])
    d = _driver(tmp_path, lambda cmd, env, timeout: (1, log))
    row = d.measure("peakflat-auto", 8 * K)
    lines = row["extra"]["error_lines"]
    assert row["extra"]["outcome"] == "error" and 3 <= len(lines) <= 30
    assert lines[0] == "[rank0]: Traceback (most recent call last):"
    assert any("illegal memory access" in ln for ln in lines) and any("rope.py" in ln for ln in lines)
    assert not any("ChildFailedError" in ln or "Root Cause" in ln for ln in lines)
    assert row["extra"]["attempts"][0]["error_lines"] == lines
    assert e2e.error_lines("a\nb\n") == ["a", "b"]  # no error line found: the last lines


def test_a_start_up_refusal_is_the_rows_error_not_the_launchers_traceback_below_it():
    """A run that peakflat refused at start-up exits cleanly and torchrun then prints its own traceback: the row keeps
    the refusal (flag, value, why, fix), as the fp32 same-loss run on Transformer Engine's layers logged it."""
    refusal = ("megatron-peakflat: --transformer-impl='transformer_engine': Transformer Engine 2.20's unfused attention "
               "backend (UnfusedDotProductAttention) runs this line and holds its [b, heads/TP, s, s] scores and "
               "softmax: 32.00 GiB per layer, and the run's plan with them does not fit 79.18 GiB. Fix: change what "
               "sends it there: fp32 data (flash and fused attention take bf16 and fp16): add --bf16")
    log = "\n".join([
        "WARNING: one_logger package is required to enable e2e metrics tracking.", refusal,
        "E1208 00:47:05.546000 3049 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1)",
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        '  File "<frozen runpy>", line 88, in _run_code',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ])
    assert e2e.error_lines(log) == [refusal]
    assert e2e.error_lines("[rank0]: " + refusal) == ["[rank0]: " + refusal]


def test_extra_flags_are_appended_to_their_method_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron(FITS)
    flags = e2e.method_flag_pairs(["peakflat-auto=--peakflat-dispatch-chunk-cap 32768"], e2e.ALL_METHODS)
    d = _driver(tmp_path, fake, extra_flags=flags)
    d.measure("megatron-te", 8 * K)
    row = d.measure("peakflat-auto", 8 * K)
    assert fake.flags[-1][-4:-2] == ["--peakflat-dispatch-chunk-cap", "32768"]
    assert "--peakflat-dispatch-chunk-cap" not in fake.flags[0]  # megatron-te's line is its own
    assert row["extra"]["extra_flags"] == ["--peakflat-dispatch-chunk-cap", "32768"]
    with pytest.raises(Exception, match="METHOD=FLAGS"):
        e2e.method_flag_pairs(["nomethod=--x"], e2e.ALL_METHODS)


def test_peakflat_tile_is_refused_at_start_up_until_its_flag_exists_then_runs_on_autos_configuration(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "peakflat_flag_exists", lambda flag: False)
    with pytest.raises(SystemExit) as e:
        e2e.main(["--dry-run", "--phases", "reach", "--methods", "peakflat-tile", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--peakflat-tile" in err and "does not define" in err and "Traceback" not in err
    monkeypatch.setattr(e2e, "peakflat_flag_exists", lambda flag: True)
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron({**FITS, "auto": 384 * K})
    d = _driver(tmp_path, fake)
    d.measure("megatron-te", 8 * K)
    d.measure("peakflat-tile", 8 * K)
    assert fake.flags[-1][fake.flags[-1].index("--peakflat"):][:3] == ["--peakflat", "auto", "--peakflat-tile"]
    assert "--optimizer-cpu-offload" not in fake.flags[-1]  # megatron-te's configuration there


def test_reach_at_explicit_lengths_stops_at_the_first_that_does_not_train(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron(FITS)
    row = _driver(tmp_path, fake).reach_lengths("peakflat-all", [512 * K, 128 * K, 256 * K, 1024 * K])
    assert [s for s, _ in fake.calls] == [128 * K, 256 * K, 512 * K]
    assert row["reach_tokens"] == 256 * K and row["extra"]["limited_by"] == f"oom at {512 * K}"
    assert row["extra"]["search"]["lengths"] == [128 * K, 256 * K, 512 * K, 1024 * K]
    assert e2e.tokens_list("512K,768K,1M") == [512 * K, 768 * K, 1024 * K]


def test_a_background_length_runs_detached_and_collect_reads_its_rows(tmp_path):
    """A real dry-run process (Megatron's pretrain on the CPU shim) started with --background: the command returns
    at once, a start is refused while an earlier run on the same file lives, --collect exits 3 while it runs and 0
    with its rows after."""
    out, where = "e2e_bg_test.json", tmp_path / "bg"
    base = [sys.executable, "bench/e2e.py", "--dry-run", "--phases", "reach", "--methods", "megatron-te",
            "--lengths", "64", "--out", out, "--background-dir", str(where)]
    try:
        # refused while the recorded run lives: this test's own process stands in for it, so that the refusal does
        # not depend on how long a real run takes on a loaded machine
        where.mkdir(parents=True)
        e2e.run_record(Path(out), where).write_text(json.dumps({"pid": os.getpid(), "started": "now"}))
        again = subprocess.run([*base, "--background"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert again.returncode == 1 and "still going" in again.stdout, again.stdout + again.stderr
        e2e.run_record(Path(out), where).unlink()
        t0 = time.monotonic()
        start = subprocess.run([*base, "--background"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert start.returncode == 0 and "started in the background" in start.stdout, start.stdout + start.stderr
        assert time.monotonic() - t0 < 60
        pid = json.loads(e2e.run_record(Path(out), where).read_text())["pid"]
        res = subprocess.run([*base, "--collect"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        if res.returncode == 3:
            assert f"background run pid {pid}" in res.stdout and "running" in res.stdout, res.stdout
        else:  # it had ended by then
            assert not e2e._alive(pid), res.stdout + res.stderr
        deadline = time.monotonic() + 500  # the run's end, watched here rather than by a --collect process a poll
        while e2e._alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        res = subprocess.run([*base, "--collect"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        doc = json.loads((ROOT / "bench" / "results" / out).read_text())
        assert "pid" not in doc  # the rows and the process record are two files
        rows = {(r["case"], r["method"]): r for r in doc["rows"]}
        assert rows[("seq=64,spec=local", "megatron-te")]["extra"]["outcome"] == "ok", res.stdout
        assert rows[("reach,spec=local", "megatron-te")]["reach_tokens"] == 64
        assert "seq=64,spec=local" in res.stdout
    finally:
        (ROOT / "bench" / "results" / out).unlink(missing_ok=True)
