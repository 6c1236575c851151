"""bench/e2e.py's driver: the reach search, Megatron's configuration ladder, resuming, the time budget, the dry run."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import e2e  # noqa: E402

K = 1024


def _value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


class FakeMegatron:
    """Answers a command line as Megatron's log would, fitting up to a length per configuration."""

    def __init__(self, fits: dict[str, int], timeout_at: int | None = None, drift: dict[str, float] | None = None,
                 speed: dict[str, float] | None = None) -> None:
        self.fits, self.timeout_at, self.calls = fits, timeout_at, []
        self.drift, self.speed, self.flags = drift or {}, speed or {}, []

    def key(self, cmd: list[str]) -> str:
        if "--peakflat" in cmd:
            return "auto"
        if "--peakflat-sco" in cmd:
            return "all"
        if "--fine-grained-activation-offloading" in cmd:
            return "cpu-offload+activation-offload"
        return "cpu-offload" if "--optimizer-cpu-offload" in cmd else "gpu-optimizer"

    def __call__(self, cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
        seq, iters = int(_value(cmd, "--seq-length")), int(_value(cmd, "--train-iters"))
        self.calls.append((seq, self.key(cmd)))
        self.flags.append(cmd)
        key = self.key(cmd)
        if self.timeout_at is not None and seq >= self.timeout_at:
            return 124, "[pretrain_compare] killed after --timeout\n"
        if seq > self.fits[self.key(cmd)]:
            return 1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB.\n"
        ms = (100.0 + seq / K) * self.speed.get(key, 1.0)
        lines = [f" iteration {i}/{iters} | elapsed time per iteration (ms): {ms:.1f} | "
                 f"lm loss: {(10.0 - i * 0.1) * (1 + self.drift.get(key, 0.0) * (i - 1)):.6E} | grad norm: 1.000 |"
                 for i in range(1, iters + 1)]
        lines.insert(2, f"[Rank 0] (after 2 iterations) memory (MB) | allocated: 1024.0 | max allocated: {seq / 64:.1f} | "
                        f"reserved: {seq / 60:.1f} | max reserved: {seq / 60:.1f}")
        return 0, "\n".join(lines) + "\n"


FITS = {"gpu-optimizer": 16 * K, "cpu-offload": 48 * K, "cpu-offload+activation-offload": 48 * K, "auto": 384 * K,
        "all": 256 * K}


def _driver(tmp_path: Path, runner, **kw) -> e2e.Driver:
    d = e2e.Driver(tmp_path / "e2e.json", e2e.TINY, "te", False, 100.0, runner=runner, **kw)
    d.save()
    return d


def test_megatron_climbs_its_ladder_and_the_search_bisects_to_the_granularity(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron(FITS)
    row = _driver(tmp_path, fake).reach("megatron-te", 8 * K, 1024 * K, 8 * K)
    assert row["reach_tokens"] == 48 * K and row["extra"]["limited_by"] == f"oom at {56 * K}"
    assert [s for s, _ in fake.calls] == [8 * K, 16 * K, 32 * K, 32 * K, 64 * K, 64 * K, 48 * K, 56 * K, 56 * K]
    doc = json.loads((tmp_path / "e2e.json").read_text())
    by = {r["case"]: r for r in doc["rows"] if r["method"] == "megatron-te"}
    assert by[f"seq={32 * K},spec=te"]["extra"]["config"] == "cpu-offload"  # the fastest that fits
    assert [a["outcome"] for a in by[f"seq={32 * K},spec=te"]["extra"]["attempts"]] == ["oom", "ok"]
    assert by[f"seq={16 * K},spec=te"]["extra"]["config"] == "gpu-optimizer"
    assert by[f"seq={64 * K},spec=te"]["extra"]["outcome"] == "oom" and by[f"seq={64 * K},spec=te"]["peak_gib"] is None
    ok = by[f"seq={48 * K},spec=te"]
    assert ok["peak_gib"] == round(48 * K / 64 / 1024, 3) and ok["extra"]["card"]
    assert ok["ms"] is None and ok["extra"]["tokens_per_s"] is None  # one run is not a timing
    assert ok["extra"]["one_run_ms"] == 100.0 + 48 and ok["extra"]["one_run_tokens_per_s"] == round(48 * K / 0.148, 1)


def test_peakflat_starts_from_megatrons_configuration_and_the_cap_bounds_the_search(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron(FITS)
    d = _driver(tmp_path, fake)
    d.reach("megatron-te", 8 * K, 32 * K, 8 * K)
    fake.calls.clear()
    row = d.reach("peakflat-auto", 8 * K, 512 * K, 8 * K)
    assert row["reach_tokens"] == 384 * K and row["extra"]["limited_by"] == f"oom at {392 * K}"
    rows = {r["case"]: r for r in d.doc["rows"] if r["method"] == "peakflat-auto"}
    assert rows[f"seq={16 * K},spec=te"]["extra"]["config"] == "gpu-optimizer"  # megatron-te's own there
    assert rows[f"seq={64 * K},spec=te"]["extra"]["config"] == "cpu-offload"  # beyond megatron-te's reach
    (tmp_path / "x").mkdir()
    capped = _driver(tmp_path / "x", FakeMegatron(FITS))
    assert capped.reach("peakflat-all", 8 * K, 128 * K, 8 * K)["extra"]["limited_by"] == "search cap"


def test_a_second_invocation_resumes_from_the_rows_and_a_timeout_bounds_the_reach_by_time(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    _driver(tmp_path, FakeMegatron(FITS)).reach("megatron-te", 8 * K, 64 * K, 8 * K)
    again = FakeMegatron(FITS)
    row = _driver(tmp_path, again).reach("megatron-te", 8 * K, 64 * K, 8 * K)
    assert again.calls == [] and row["reach_tokens"] == 48 * K  # every length was in the file
    slow = FakeMegatron(FITS, timeout_at=32 * K)
    (tmp_path / "t").mkdir()
    row = _driver(tmp_path / "t", slow).reach("peakflat-auto", 8 * K, 64 * K, 8 * K)
    assert row["reach_tokens"] == 16 * K and row["extra"]["limited_by"] == "time"


def test_the_budget_leaves_an_unfinished_length_for_the_next_invocation(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    calls = []

    def killed(cmd, env, timeout):
        calls.append(timeout)
        return 124, "killed\n"

    d = _driver(tmp_path, killed, deadline=time.monotonic() + 60)
    with pytest.raises(e2e.BudgetSpent):
        d.measure("megatron-te", 8 * K)
    assert calls and calls[0] <= 60 and d.row(f"seq={8 * K},spec=te", "megatron-te") is None
    d.deadline = time.monotonic() + 10  # under 30 s left: nothing starts
    with pytest.raises(e2e.BudgetSpent):
        d.measure("megatron-te", 8 * K)
    assert len(calls) == 1


def test_a_pending_ladder_continues_with_the_configurations_not_yet_tried(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    first = FakeMegatron({**FITS, "gpu-optimizer": 0})
    d = _driver(tmp_path, first, deadline=float("inf"))

    def stop_after_first(cmd, env, timeout):
        if first.calls:
            raise e2e.BudgetSpent()
        return first(cmd, env, timeout)

    d.runner = stop_after_first
    with pytest.raises(e2e.BudgetSpent):
        d.measure("megatron-te", 8 * K)
    assert d.row(f"seq={8 * K},spec=te", "megatron-te")["extra"]["outcome"] == "pending"
    second = FakeMegatron({**FITS, "gpu-optimizer": 0})
    row = _driver(tmp_path, second).measure("megatron-te", 8 * K)
    assert second.calls == [(8 * K, "cpu-offload")] and row["extra"]["outcome"] == "ok"
    assert [a["config"] for a in row["extra"]["attempts"]] == ["gpu-optimizer", "cpu-offload"]


def test_parse_reads_megatrons_log_and_the_runtime_reports():
    text = ("peakflat auto: planned for 1 GPU(s)\n  predicted peak 29.0 GiB per GPU (33.7 whatever the routing), binding x\n"
            "  added: --peakflat-vocab ring-dtp\n"
            " iteration 1/2 | elapsed time per iteration (ms): 900.0 | lm loss: 1.2E+01 | grad norm: 4.4 |\n"
            "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.0 | max allocated: 2.0 | reserved: 3.0 | max reserved: 4.0\n"
            " iteration 2/2 | elapsed time per iteration (ms): 600.0 | lm loss: 1.1E+01 | grad norm: 4.3 |\n"
            "[Rank 0] (after 2 iterations) memory (MB) | allocated: 10.0 | max allocated: 20.0 | reserved: 30.0 | max reserved: 40.0\n"
            "peakflat peaks iter 2 (only stage), GiB measured/predicted: dispatch 1.94/2.64, vocab 2.23/2.23, total 22.81/23.00\n")
    a = e2e.parse(text, 0, 12.0, 2)
    assert a.outcome == "ok" and a.losses == [12.0, 11.0] and a.ms == 300.0  # iteration 2's own: 600 is the mean of 900 and it
    assert a.memory_mib == {"allocated": 10.0, "max_allocated": 20.0, "reserved": 30.0, "max_reserved": 40.0}
    assert a.peaks == {"dispatch": (1.94, 2.64), "vocab": (2.23, 2.23), "total": (22.81, 23.0)}
    assert a.auto == {"added": "--peakflat-vocab ring-dtp", "planner_total_gib": 29.0, "planner_guaranteed_gib": 33.7}
    assert e2e.parse("RuntimeError: boom\n", 1, 1.0, 2).outcome == "error"
    assert e2e.parse(text.replace("lm loss: 1.1E+01", ""), 0, 1.0, 2).outcome == "error"  # one loss of two


def test_tokens_take_units():
    assert e2e.tokens("8K") == 8192 and e2e.tokens("1M") == 1024**2 and e2e.tokens("4096") == 4096
    with pytest.raises(Exception):
        e2e.tokens("1G")


def test_dry_run_on_cpu_runs_megatron_and_peakflat_auto_through_the_real_entry_point(tmp_path):
    """Two real processes (Megatron's pretrain on the CPU shim, tiny shapes): the rows, the auto decision."""
    out = "e2e_dryrun_test.json"
    try:
        proc = subprocess.run([sys.executable, "bench/e2e.py", "--dry-run", "--phases", "reach",
                               "--methods", "megatron-te,peakflat-auto", "--max-seq", "64", "--out", out],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        doc = json.loads((ROOT / "bench" / "results" / out).read_text())
    finally:
        (ROOT / "bench" / "results" / out).unlink(missing_ok=True)
    rows = {(r["case"], r["method"]): r for r in doc["rows"]}
    assert rows[("seq=64,spec=local", "megatron-te")]["extra"]["outcome"] == "ok"
    auto = rows[("seq=64,spec=local", "peakflat-auto")]
    assert auto["extra"]["outcome"] == "ok" and "--peakflat-vocab ring-dtp" in auto["extra"]["auto"]["added"]
    assert len(auto["extra"]["losses"]) == 2 and auto["extra"]["card"] == "cpu"
    assert rows[("reach,spec=local", "peakflat-auto")]["reach_tokens"] == 64


def test_more_iterations_time_the_median_of_all_but_the_first():
    """Iterations of 5000 (warm-up), 300, 300 and 310 ms, as Megatron 0.19 logs them: its second figure is the
    mean of the first two (2650). The median is taken over iterations 2-4 as they ran (300), not over the
    logged figures (310)."""
    lines = [f" iteration {i}/4 | elapsed time per iteration (ms): {t} | lm loss: 1.0E+01 | grad norm: 1.0 |"
             for i, t in enumerate((5000.0, 2650.0, 300.0, 310.0), 1)]
    a = e2e.parse("\n".join(lines), 0, 1.0, 4)
    assert a.outcome == "ok" and a.ms == 300.0 and a.iter_ms == [5000.0, 300.0, 300.0, 310.0]


def test_iteration_times_undo_megatrons_unreset_first_report():
    """Five iterations of megatron-te at 32K on one H100 (TE 2.20.2, megatron-core 0.19.2), as logged: the figure
    at iteration 2 (10189.7 ms) is the mean of iterations 1 and 2; the log lines' own clocks, 2.735 s apart, give
    iteration 2's time, which ``iteration_ms`` recovers. The later figures match the clocks as logged."""
    from megatron_peakflat.testing.subproc import iteration_ms

    log = """\
 [2026-12-07 22:27:17.487104] iteration        1/       5 | consumed samples:            1 | elapsed time per iteration (ms): 17644.2 | learning rate: 3.000000E-04 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 17019.31 | max allocated: 54693.21 | reserved: 57352.00 | max reserved: 57352.00
 [2026-12-07 22:27:20.222315] iteration        2/       5 | consumed samples:            2 | elapsed time per iteration (ms): 10189.7 | learning rate: 2.604594E-04 |
 [2026-12-07 22:27:23.062486] iteration        3/       5 | consumed samples:            3 | elapsed time per iteration (ms): 2840.1 | learning rate: 1.650000E-04 |
 [2026-12-07 22:27:25.827372] iteration        4/       5 | consumed samples:            4 | elapsed time per iteration (ms): 2764.7 | learning rate: 6.954058E-05 |
 [2026-12-07 22:27:28.555340] iteration        5/       5 | consumed samples:            5 | elapsed time per iteration (ms): 2727.9 | learning rate: 3.000000E-05 |
"""
    got = iteration_ms(log)
    assert got[0] == 17644.2 and got[2:] == [2840.1, 2764.7, 2727.9]
    assert got[1] == pytest.approx(2735.2) and abs(got[1] - 2735.211) < 1.0  # the clocks: 20.222315 - 17.487104 s
    # a log whose first report is not iteration 1 (a resumed run) is taken as logged
    assert iteration_ms(log.replace("iteration        1/", "iteration        7/")) == [17644.2, 10189.7, 2840.1,
                                                                                     2764.7, 2727.9]


def test_same_loss_measures_each_method_and_megatrons_own_control_against_megatron(tmp_path, monkeypatch):
    """The control is megatron-te in its other configuration; a method is within it when its largest loss gap is
    no larger than the control's."""
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron(FITS, drift={"cpu-offload": 1e-3, "auto": 1e-4, "all": 2e-3})
    d = _driver(tmp_path, fake)
    d.measure("megatron-te", 8 * K)  # trains with the optimizer on the GPU
    d.same_loss(8 * K, 3)
    assert [k for _, k in fake.calls[1:]] == ["gpu-optimizer", "auto", "all", "cpu-offload"]
    assert all("--deterministic-mode" in c and _value(c, "--train-iters") == "3" for c in fake.flags[1:])
    assert "--peakflat-sco" in fake.flags[3]  # peakflat-all, on the offloaded configuration
    case = f"same_loss,seq={8 * K},spec=te,iters=3"
    control = d.row(case, e2e.CONTROL)
    assert control["extra"]["config"] == "cpu-offload"
    gap = control["extra"]["vs_megatron_te"]["loss"]["max_rel_diff"]
    assert gap == pytest.approx(2e-3, rel=1e-3)  # iteration 3: 1 + 2 * drift
    auto, every = d.row(case, "peakflat-auto"), d.row(case, "peakflat-all")
    assert auto["extra"]["within_control"] is True and auto["exact"] is True
    assert every["extra"]["within_control"] is False and every["exact"] is False
    again = FakeMegatron(FITS)
    _driver(tmp_path, again).same_loss(8 * K, 3)  # every row is in the file: nothing runs again
    assert again.calls == []


def test_the_time_phase_reruns_each_method_on_its_search_configuration_and_takes_ratios_on_one_card(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron(FITS, speed={"auto": 0.5})
    d = _driver(tmp_path, fake)
    d.measure("megatron-te", 48 * K)  # OOM with the optimizer on the GPU, trains offloaded
    fake.calls.clear()
    d.timing(48 * K, ["megatron-te", "peakflat-auto"], 5)
    assert fake.calls == [(48 * K, "cpu-offload"), (48 * K, "auto")]
    assert "--optimizer-cpu-offload" in fake.flags[-1] and "--peakflat-report-peaks" in fake.flags[-1]
    row = d.row(f"time,seq={48 * K},spec=te,iters=5", "peakflat-auto")
    assert row["ms"] == (100.0 + 48) * 0.5 and row["extra"]["tokens_per_s_vs_megatron_te"] == 2.0
    assert row["extra"]["command"] == shlex.join(fake.flags[-1])  # the command that ran, its port included
    te = d.row(f"time,seq={48 * K},spec=te,iters=5", "megatron-te")
    te["extra"]["card"] = "another card"
    d.put(te)
    row["extra"].pop("tokens_per_s_vs_megatron_te")
    d.put(row)
    d.timing(48 * K, ["megatron-te", "peakflat-auto"], 5)
    assert "tokens_per_s_vs_megatron_te" not in d.row(f"time,seq={48 * K},spec=te,iters=5", "peakflat-auto")["extra"]


def test_a_search_starting_above_a_length_that_trained_bisects_down_to_it_not_to_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    fake = FakeMegatron(FITS)
    d = _driver(tmp_path, fake)
    d.measure("megatron-te", 48 * K)
    fake.calls.clear()
    row = d.reach("megatron-te", 64 * K, 64 * K, 8 * K)
    assert [s for s, _ in fake.calls] == [64 * K, 64 * K, 56 * K, 56 * K]  # each length up the ladder, none below 48K
    assert row["reach_tokens"] == 48 * K


def test_warm_up_as_long_as_a_phase_is_refused_at_start_up_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--dry-run", "--phases", "time", "--time-iters", "5", "--lr-warmup-iters", "10",
                  "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--lr-warmup-iters 10" in err and "--time-iters" in err and "below 5" in err
    assert not (tmp_path / "x.json").exists()


def test_a_length_that_auto_refuses_is_recorded_as_refused_with_its_reason(tmp_path, monkeypatch):
    """Where ``--peakflat auto`` finds nothing that fits, the run stops at start-up with the planner's reason: the
    row says 'refused' (not an error), keeps the reason's lines, and the reach is limited by it."""
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda *a: None)
    refusal = ("megatron-peakflat: --peakflat='auto': nothing fits in this command line's layout (TP1 PP1 CP1 DP1 "
               "EP1): the only stage needs 80.21 GiB per GPU\n"
               "E1207 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 3)\n")

    def runner(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
        if "--peakflat" in cmd and int(_value(cmd, "--seq-length")) > 768 * K:
            return 1, refusal
        return FakeMegatron(FITS | {"auto": 1024 * K})(cmd, env, timeout)

    d = _driver(tmp_path, runner)
    reach = d.reach_lengths("peakflat-auto", [768 * K, 1024 * K])
    row = d.row(f"seq={1024 * K},spec=te", "peakflat-auto")
    assert row["extra"]["outcome"] == "refused" and row["peak_gib"] is None
    assert any("nothing fits" in ln for ln in row["extra"]["error_lines"])
    assert reach["reach_tokens"] == 768 * K and reach["extra"]["limited_by"] == f"refused at {1024 * K}"
    # an error that is not the planner's stays an error
    assert e2e.parse("Traceback (most recent call last):\nValueError: x\n", 1, 1.0, 2).outcome == "error"
