"""bench/planner_calibration.py: the shapes it covers, the order of its runs, what a row records, the budget, the
resume, the summary, and its dry run through the real entry point on CPU."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import e2e  # noqa: E402
from bench import planner_calibration as pc  # noqa: E402
from megatron_peakflat.planner.shapes import PRESETS  # noqa: E402

MACHINE = pc.Machine("H100", 80 * pc.GIB, 1024 * pc.GIB, 132)


def _key(s) -> tuple:
    return (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab, s.experts, s.topk, s.moe_ffn)


def test_the_shapes_span_the_planners_range_and_none_is_a_preset_or_the_e2e_model():
    shapes = pc.SHAPES
    assert len(shapes) >= 8 and len({s.name for s in shapes}) == len(shapes)
    known = {_key(p) for p in PRESETS.values()}
    m = e2e.Model()
    known.add((m.hidden, None, m.heads, m.kv_heads, m.head_dim, m.vocab, m.experts, m.topk, m.moe_ffn))
    for s in shapes:
        assert _key(s) not in known, s.name
        assert (s.hidden, s.heads, s.kv_heads, s.experts) != (m.hidden, m.heads, m.kv_heads, m.experts), s.name
    assert any(s.experts == 0 for s in shapes) and any(s.experts for s in shapes)
    assert {64, 128, 256} <= {s.experts for s in shapes if s.topk == 8}  # many small experts, top-8
    assert any(0 < s.experts <= 16 and s.moe_ffn >= 8192 for s in shapes)  # few large ones
    ratios = {s.heads // s.kv_heads for s in shapes}
    assert 1 in ratios and 16 in ratios and len(ratios) >= 4
    assert min(s.vocab for s in shapes) <= 32768 and max(s.vocab for s in shapes) >= 256000
    assert {True, False} == {s.tied for s in shapes}
    assert {s.layers for s in shapes} >= {1, 2, 4}


def test_runs_are_ordered_middle_length_first_then_longest_then_shortest(monkeypatch):
    monkeypatch.setattr(pc, "longest_fitting", lambda shape, spec, machine, cap, floor, method="planner":
                        (64 * 1024 if method == "planner" else 16 * 1024) * (2 if shape.experts else 1))
    shapes = pc.SHAPES[:3]
    jobs, longest = pc.plan_jobs(shapes, ["te", "local"], MACHINE, 1024**2, 1024)
    assert len(jobs) == 3 * 2 * 2 * 3 and longest[(shapes[0].name, "te", "planner")] == 64 * 1024
    first = jobs[:3]
    assert [(j.shape.name, j.spec, j.method) for j in first] == [(s.name, "te", "planner") for s in shapes]
    assert [j.seq for j in first] == [32 * 1024, 32 * 1024, 64 * 1024]  # each shape's middle length
    assert [(j.method, j.spec) for j in jobs[3:12:3]] == [("planner", "local"), ("planner-megatron", "te"),
                                                         ("planner-megatron", "local")]
    assert [j.seq for j in jobs if j.shape is shapes[0] and j.spec == "te" and j.method == "planner"] == \
        [32 * 1024, 64 * 1024, 16 * 1024]
    assert pc.lengths_of(100 * 1024, 1024) == [25 * 1024, 50 * 1024, 100 * 1024]


def _log(iters: int, max_mib: list[float], added: str | None) -> str:
    lines = []
    if added:
        lines += ["peakflat auto: planned for 1 GPU(s)", f"  added: {added}"]
    for i in range(1, iters + 1):
        lines.append(f" iteration {i}/{iters} | elapsed time per iteration (ms): 100.0 | lm loss: 1.0E+01 | grad norm: 1.0 |")
        lines.append(f"[Rank 0] (after {i} iterations) memory (MB) | allocated: 100.0 | max allocated: {max_mib[i - 1]} | "
                     "reserved: 9000.0 | max reserved: 9000.0")
    return "\n".join(lines) + "\n"


def test_a_row_records_the_largest_max_allocated_the_prediction_for_the_flags_that_ran_and_their_ratio(
        tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "_te_importable", lambda: True)
    seen = []

    def predict(flags, machine, added=None):
        seen.append(added)
        if "--peakflat" not in flags:
            return pc.Prediction(9.0, "baseline", [], True)
        return pc.Prediction(10.0 if added is None else 11.0, "peakflat", ["--peakflat-vocab", "ring-dtp"]
                             if added is None else added, True)

    monkeypatch.setattr(pc, "predict", predict)
    calls = []

    def runner(cmd, env, timeout):
        calls.append(cmd)
        added = "--peakflat-vocab ring-dtp --peakflat-sco" if "--peakflat" in cmd else None
        return 0, _log(3, [5120.0, 10240.0, 10240.0], added)

    cal = pc.Calibration(tmp_path / "c.json", MACHINE, dry_run=False, iters=3, timeout=100, runner=runner)
    shape = pc.SHAPES[2]
    job = pc.Job(shape, 8192, "te", "planner", (0,))
    assert cal.run(job, float("inf"))
    row = cal.row(f"shape={shape.name},seq=8192,spec=te", "planner")
    assert row["measured_gib"] == 10.0 and row["extra"]["max_allocated_by_iteration_gib"] == {"1": 5.0, "2": 10.0,
                                                                                              "3": 10.0}
    # the run logged other flags than predicted beforehand: the prediction is the one for the flags that ran
    assert row["predicted_gib"] == 11.0 and row["extra"]["predicted_before_run_gib"] == 10.0
    assert row["extra"]["added"] == ["--peakflat-vocab", "ring-dtp", "--peakflat-sco"]
    assert row["extra"]["ratio"] == 1.1 and row["extra"]["card"] == "H100" and "--moe-grouped-gemm" in row["extra"]["flags"]
    assert "megatron_peakflat.pretrain" in row["extra"]["command"] and "--log-memory-interval" in calls[0]
    plain = pc.Job(shape, 8192, "te", "planner-megatron", (0,))
    assert cal.run(plain, float("inf")) and "--peakflat" not in calls[-1]
    assert cal.row(plain.case, plain.method)["extra"]["ratio"] == 0.9
    again = pc.Calibration(tmp_path / "c.json", MACHINE, dry_run=False, iters=3, timeout=100, runner=runner)
    n = len(calls)
    assert again.run(job, float("inf")) and len(calls) == n  # in the file: not run again
    s = pc.summary(again.doc["rows"])
    assert s["rows"] == 2 and s["lowest"]["method"] == "planner-megatron" and s["highest"]["method"] == "planner"
    assert s["all_in_band"] is False and len(s["outside"]) == 1  # 0.9 is under 0.95


def test_the_budget_leaves_a_run_for_the_next_invocation_and_te_or_a_misfit_is_skipped_with_a_row(
        tmp_path, monkeypatch):
    monkeypatch.setattr(pc, "predict", lambda flags, machine, added=None: pc.Prediction(
        50.0, "baseline", [], "--num-experts" not in flags))
    ran = []
    cal = pc.Calibration(tmp_path / "c.json", MACHINE, dry_run=False, iters=3, timeout=100,
                         runner=lambda cmd, env, timeout: ran.append(timeout) or (0, _log(3, [1.0] * 3, None)))
    dense = pc.SHAPES[0]
    job = pc.Job(dense, 8192, "local", "planner-megatron", (0,))
    assert cal.run(job, time.monotonic() + 20) is False and ran == [] and cal.row(job.case, job.method) is None
    moe = pc.Job(pc.SHAPES[2], 8192, "local", "planner-megatron", (0,))
    assert cal.run(moe, float("inf")) and ran == []
    assert "does not fit" in cal.row(moe.case, moe.method)["extra"]["skipped"]
    monkeypatch.setattr(pc, "_te_importable", lambda: False)
    te = pc.Job(dense, 8192, "te", "planner-megatron", (0,))
    assert cal.run(te, float("inf")) and "Transformer Engine" in cal.row(te.case, te.method)["extra"]["skipped"]
    assert ran == []


def test_the_planners_prediction_for_a_command_line_is_its_runtime_reports_figure():
    """``predict`` goes through the planner's library as the runtime report does: plain Megatron is its baseline
    column; under auto, the flags auto adds on this card, and a larger card fits a longer length."""
    shape = dataclasses.replace(pc.SHAPES[2], layers=1)
    flags = [*shape.flags(32768), *pc.spec_flags("local", shape)]
    plain = pc.predict(flags, MACHINE)
    auto = pc.predict([*flags, *pc.method_flags("planner")], MACHINE)
    assert plain.which == "baseline" and plain.gib > 0 and plain.added == []
    assert auto.which == "peakflat" and "--peakflat-vocab" in auto.added and 0 < auto.gib < plain.gib
    small = pc.longest_fitting(shape, "local", dataclasses.replace(MACHINE, hbm_bytes=40 * pc.GIB), 1024**2)
    assert small is not None and small < pc.longest_fitting(shape, "local", MACHINE, 1024**2)


def test_dry_run_on_cpu_runs_the_real_entry_point_writes_rows_as_it_goes_and_resumes(tmp_path):
    out = tmp_path / "pc.json"
    base = [sys.executable, "bench/planner_calibration.py", "--dry-run", "--shapes", "tiny-moe", "--out", str(out)]
    first = subprocess.run([*base, "--max-runs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["method"]) for r in rows] == [("shape=tiny-moe,seq=128,spec=local", "planner"),
                                                        ("shape=tiny-moe,seq=128,spec=local", "planner-megatron")]
    auto = rows[0]
    assert auto["extra"]["outcome"] == "ok" and auto["predicted_gib"] > 0 and "--peakflat-vocab" in auto["extra"]["added"]
    # the runtime report's own figure, which it prints to 0.01 GiB
    assert auto["extra"]["peak_report"]["total"][1] == round(auto["predicted_gib"], 2)
    assert set(auto["extra"]["max_allocated_by_iteration_gib"]) == {"1", "2", "3"} and auto["extra"]["card"] == "cpu"
    second = subprocess.run([*base, "--max-runs", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "2 already in" in second.stdout, second.stdout[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and rows[2]["case"] == "shape=tiny-moe,seq=256,spec=local"
    assert "planner calibration:" in second.stdout
