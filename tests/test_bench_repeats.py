"""The benchmarks' repeats: a row's ms is the median of its runs, every run and their spread kept, and the time
ratios between methods taken on one card with the range the runs allow, flagged where it holds 1.0x."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402


def _row(method: str, runs: list[float], card: str = "H100", case: str = "N=1") -> harness.Row:
    return harness.repeated(harness.Row(case, method, 1.0, None, None, {}, card=card), runs)


def test_a_row_keeps_the_median_of_its_runs_every_run_and_their_spread():
    row = _row("peakflat", [12.0, 10.0, 11.0])
    assert row.ms == 11.0 and row.extra["runs_ms"] == [12.0, 10.0, 11.0]
    assert row.extra["spread"] == round(2.0 / 11.0, 4)
    assert harness.runs_of({"ms": 5.0, "extra": {"ms_rounds": [4.0, 5.0, 6.0]}}) == [4.0, 5.0, 6.0]
    assert harness.runs_of({"ms": 5.0, "extra": {}}) == [5.0] and harness.runs_of({"ms": None, "extra": {}}) == []


def test_ratios_are_between_medians_of_one_card_and_flag_a_range_holding_one():
    rows = [_row("peakflat", [10.0, 10.5, 11.0]), _row("megatron-alltoall", [20.0, 21.0, 22.0]),
            _row("llep-unchunked", [10.8, 11.0, 11.2]),
            _row("megatron-alltoall", [1.0, 1.0, 1.0], card="H200"),  # another card: no ratio with it
            _row("megatron-alltoall", [30.0, 30.0, 30.0], case="N=2")]  # another case: none either
    checks = {c.peer: c for c in harness.ratio_checks(rows)}
    assert set(checks) == {"megatron-alltoall", "llep-unchunked"}
    clear, close = checks["megatron-alltoall"], checks["llep-unchunked"]
    assert clear.ratio == round(10.5 / 21.0, 4) and clear.low == round(10.0 / 22.0, 4)
    assert clear.high == round(11.0 / 20.0, 4) and not clear.overlaps_one
    assert close.ratio == round(10.5 / 11.0, 4) and close.low < 1.0 < close.high and close.overlaps_one
    assert "OVERLAPS 1.0x" in close.line() and "OVERLAPS" not in clear.line()


def test_e2e_rows_read_their_card_from_extra_and_a_single_run_is_flagged_as_such():
    rows = [{"case": "time,seq=8192", "method": "peakflat-auto", "ms": 90.0,
             "extra": {"card": "H100", "runs_ms": [89.0, 90.0, 91.0]}},
            {"case": "time,seq=8192", "method": "megatron-te", "ms": 100.0, "extra": {"card": "H100"}}]
    (check,) = harness.ratio_checks(rows)
    assert check.ratio == 0.9 and check.runs == (3, 1) and "fewer than 3 runs" in check.line()


def test_the_ratios_command_exits_1_when_a_ratio_is_unresolved(tmp_path):
    path = tmp_path / "x.json"
    rows = [_row("peakflat", [10.0, 10.5, 11.0]), _row("megatron-alltoall", [10.2, 10.4, 10.6])]
    path.write_text(json.dumps({"rows": [r.__dict__ for r in rows]}))
    res = subprocess.run([sys.executable, "-m", "bench.harness", "ratios", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "1 of 1 ratios overlap 1.0x" in res.stdout, res.stdout + res.stderr
    rows[1] = _row("megatron-alltoall", [20.0, 20.0, 20.0])
    path.write_text(json.dumps({"rows": [r.__dict__ for r in rows]}))
    res = subprocess.run([sys.executable, "-m", "bench.harness", "ratios", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "0 of 1 ratios overlap" in res.stdout, res.stdout + res.stderr


def test_every_timing_benchmark_takes_repeats_defaulting_to_three():
    import argparse

    for name in ("dispatch", "vocab", "sco", "optimizer"):
        text = (ROOT / "bench" / f"{name}.py").read_text()
        assert "repeats_arg(ap)" in text, name
    ap = argparse.ArgumentParser()
    harness.repeats_arg(ap)
    assert ap.parse_args([]).rounds == 3 and ap.parse_args(["--repeats", "5"]).rounds == 5
    assert ap.parse_args(["--rounds", "4"]).rounds == 4
