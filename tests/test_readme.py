"""The README says what the software prints and what was measured: its quick start is the planner's own output
and launch line, and every figure of its results section is the one in ``bench/results/e2e.json``. A change to
the planner or a new measurement that leaves the README behind fails here."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
E2E = json.loads((ROOT / "bench" / "results" / "e2e.json").read_text())["rows"]


def _fenced_after(marker: str) -> str:
    """The first fenced block after ``marker``."""
    at = README.index(marker)
    start = README.index("```", at)
    start = README.index("\n", start) + 1
    return README[start:README.index("```", start)]


def _results() -> str:
    return README[README.index("<!-- results-table: begin -->"):README.index("<!-- results-table: end -->")]


def _row(method: str, case: str) -> dict:
    (row,) = [r for r in E2E if r["method"] == method and r["case"] == case]
    return row


def test_quick_start_shows_the_planners_output_and_launches_its_recommended_flags(capsys):
    from megatron_peakflat.plan import main
    from megatron_peakflat.planner.report import FLAGS_LABEL

    command = _fenced_after("**1. Ask the planner**").splitlines()[0]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "megatron_peakflat.plan"], command
    assert main(argv[3:]) == 0
    printed = [ln.rstrip() for ln in capsys.readouterr().out.splitlines()]
    shown = [ln.rstrip() for ln in _fenced_after("It prints every term per rank").strip("\n").splitlines()]
    assert len(shown) >= 4 and printed[-len(shown):] == shown, "\n".join(printed[-len(shown):])

    label = FLAGS_LABEL.strip()
    recommended = shlex.split(next(ln for ln in shown if ln.lstrip().startswith(label)).split(label, 1)[1])
    launch = _fenced_after("**3. Launch**").replace("\\\n", " ")
    assert shlex.split(launch.split("<your model, data and training flags>")[1]) == recommended


def _gib(method: str, tokens: int) -> str:
    return f"{_row(method, f'seq={tokens},spec=te')['peak_gib']:.1f} GiB"


CONFIGS = {"gpu-optimizer": "optimizer on the GPU", "cpu-offload": "optimizer offloaded"}


def _table(header: str) -> list[str]:
    """The body rows of the results section's table whose header row starts with ``header``."""
    lines = _results().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    body = []
    for ln in lines[at + 2:]:
        if not ln.startswith("|"):
            break
        body.append(ln)
    return body


def test_results_table_is_the_measured_rows():
    lines = _table("| tokens per sequence | megatron-te | peakflat-auto |")
    assert len(lines) >= 8
    for line in lines:
        k, te, auto = (c.strip().replace("**", "") for c in line.strip("|").split("|"))
        tokens = int(k[:-1]) * {"K": 2**10, "M": 2**20}[k[-1]]
        for method, cell in (("megatron-te", te), ("peakflat-auto", auto)):
            rows = [r for r in E2E if r["method"] == method and r["case"] == f"seq={tokens},spec=te"]
            if not cell:
                assert not rows or method == "peakflat-auto", (k, method)  # megatron-te shows every length it tried
                continue
            (row,) = rows
            extra = row["extra"]
            if cell.startswith("OOM"):
                assert extra["outcome"] == "oom" and row["peak_gib"] is None, (k, method)
                if "activation offloading" in cell:
                    assert "activation-offload" in extra["config"], (k, method)
                continue
            assert extra["outcome"] == "ok" and cell.startswith(_gib(method, tokens)), (k, method, cell)
            if "(" in cell:
                assert CONFIGS[extra["config"]] in cell, (k, method, cell)


def _half_up(x: float) -> str:
    return f"{int(x + 0.5):,}"


def test_time_table_is_the_medians_and_ranges_of_three_runs():
    """Each timed length: both methods' median and range in ms, megatron-te's configuration, peakflat-auto's memory,
    and the tokens/s ratio with its range, all as the rows hold them; a row with fewer than 3 runs is not shown."""
    lines = _table("| tokens | megatron-te (its configuration) | peakflat-auto |")
    assert len(lines) >= 3
    shown = set()
    for line in lines:
        k, te_cell, auto_cell, ratio_cell = (c.strip() for c in line.strip("|").split("|"))
        case = f"time,seq={int(k[:-1]) * 1024},spec=te,iters=5"
        te, auto = _row("megatron-te", case), _row("peakflat-auto", case)
        for row, cell in ((te, te_cell), (auto, auto_cell)):
            runs = row["extra"]["runs_ms"]
            assert row["extra"]["outcome"] == "ok" and len(runs) >= 3 and row["ms"] == sorted(runs)[len(runs) // 2]
            assert cell.startswith(f"{_half_up(row['ms'])} ms [{_half_up(min(runs))}-{_half_up(max(runs))}]"), (k, cell)
        assert f"({CONFIGS[te['extra']['config']]})" in te_cell and f"{auto['peak_gib']:.1f} GiB" in auto_cell
        lo, hi = auto["extra"]["tokens_per_s_vs_megatron_te_range"]
        assert ratio_cell == f"**{auto['extra']['tokens_per_s_vs_megatron_te']:.2f}x** [{lo:.2f}-{hi:.2f}]", ratio_cell
        assert lo > 1.0  # the README says no range includes 1.0x
        shown.add(case)
    complete = {r["case"] for r in E2E if r["case"].startswith("time,seq=") and r["method"] == "peakflat-auto"
                and r["extra"]["outcome"] == "ok" and len(r["extra"].get("runs_ms", [])) >= 3}
    paired = {r["case"] for r in E2E if r["case"] in complete and r["method"] == "megatron-te"
              and r["extra"].get("runs_ms")}
    assert shown == paired, (shown, paired)
    for case in sorted(complete - paired):  # beyond Megatron's reach: peakflat-auto's own time, in seconds
        row = _row("peakflat-auto", case)
        runs = row["extra"]["runs_ms"]
        said = (f"at {int(case.split('seq=')[1].split(',')[0]) // 1024}K is {row['ms'] / 1000:.1f} s per iteration "
                f"[{min(runs) / 1000:.1f}-{max(runs) / 1000:.1f}] ({len(runs)} runs")
        assert said in " ".join(README.split()), said


def test_results_figures_are_the_measured_ones():
    text = " ".join(_results().split())
    te, auto = _row("megatron-te", "time,seq=49152,spec=te,iters=5"), _row("peakflat-auto", "time,seq=49152,spec=te,iters=5")
    assert f"{te['ms'] / 1000:.2f} s/iter" in text and f"{auto['ms'] / 1000:.2f} s/iter" in text
    speed = auto["extra"]["tokens_per_s"] / te["extra"]["tokens_per_s"]
    assert f"{speed:.2f}x its tokens/s in {auto['peak_gib'] / te['peak_gib']:.2f}x its memory" in text
    whole = [_half_up(r["extra"]["tokens_per_s"]) for r in (auto, te)]
    assert f"({whole[0]} against {whole[1]} tokens/s, medians of 3 runs each;" in text
    lo, hi = auto["extra"]["tokens_per_s_vs_megatron_te_range"]
    assert f"range {lo:.2f}x to {hi:.2f}x" in text and len(te["extra"]["runs_ms"]) == len(auto["extra"]["runs_ms"]) == 3
    head = " ".join(README[:README.index("## Install")].split())
    assert f"at 48K it runs {speed:.2f}x as many tokens per second (median of 3 runs each, range {lo:.2f}x to {hi:.2f}x)" in head

    reach = {m: _row(m, "reach,spec=te")["reach_tokens"] for m in ("megatron-te", "peakflat-auto")}
    assert f"**Reach: {reach['peakflat-auto'] // reach['megatron-te']}x.**" in text
    assert f"Megatron trains {reach['megatron-te'] // 1024}K tokens" in text
    longest = _row("peakflat-auto", f"seq={reach['peakflat-auto']},spec=te")
    label = "1M" if reach["peakflat-auto"] == 2**20 else f"{reach['peakflat-auto'] // 1024}K"
    assert f"the same run trains {label} at {longest['peak_gib']:.1f} GiB of 80" in text
    # one run's Megatron figure at iteration 2, the mean of iterations 1 and 2 (rows from before iter_ms)
    assert f"({longest['extra']['one_run_ms'] / 1000:.0f} s per iteration, the mean of its two, one run;" in text
    assert longest["ms"] is None and "iteration_2_own" not in longest["extra"]
    assert f"its peak report had planned {longest['extra']['planner_gib']:.1f} GiB)" in text
    assert longest["extra"]["te_tile_kv_head_calls"] and "--peakflat-tile" in longest["extra"]["auto"]["added"]
    quarter = _row("peakflat-auto", "seq=262144,spec=te")
    growth = (longest["peak_gib"] - quarter["peak_gib"]) * 2**30 / (reach["peakflat-auto"] - 262144) / 1024
    assert f"From 256K to 1M the peak grows by {growth:.1f} KiB per token" in text
    half = _row("peakflat-auto", "seq=524288,spec=te")
    assert "--peakflat-tile" not in half["extra"]["auto"]["added"] and half["peak_gib"] > longest["peak_gib"]
    died = _row("peakflat-auto", "seq=1048576,spec=te,one_te_call_per_tile")
    asked = re.search(r"Tried to allocate ([\d.]+) GiB", died["extra"]["attempts"][-1]["oom"]["message"]).group(1)
    assert f"cuDNN asked for one {asked} GiB workspace" in text
    assert f"Auto had planned {died['extra']['planner_gib']:.1f} GiB and said \"fits\"" in text

    errors = [(r["peak_gib"] - r["extra"]["planner_gib"]) / r["peak_gib"] for r in E2E
              if r["method"] == "peakflat-auto" and r["case"].startswith("seq=") and r["peak_gib"]]
    # the report's error, predicted against measured, as the README words it
    worst_over, worst_under = -min(errors), -max(errors)
    assert f"within {worst_over:+.1%} to {worst_under:.1%} of the measured one" in text


@pytest.mark.parametrize("method, label", [
    ("megatron-te-control", "megatron-te, optimizer offloaded (Megatron against itself)"),
    ("peakflat-auto", "peakflat-auto"),
    ("peakflat-all", "peakflat-all (every component)"),
])
def test_same_loss_table_is_the_measured_gaps(method, label):
    from bench.pretrain_compare import loss_gap

    ref = _row("megatron-te", "same_loss,seq=8192,spec=te,iters=50")["extra"]["losses"]
    mine = _row(method, "same_loss,seq=8192,spec=te,iters=50")["extra"]["losses"]
    assert len(ref) == len(mine) == 50
    (line,) = [ln for ln in _results().splitlines() if ln.strip().startswith(f"| {label} |")]
    equal, first5, above, worst = (c.strip() for c in line.strip().strip("|").split("|")[1:])
    same = next(i for i, (a, b) in enumerate(zip(ref, mine)) if a != b)
    assert equal == f"{same} iterations"
    assert first5 == f"{loss_gap(ref[:5], mine[:5])['max_rel_diff']:.1e}".replace("e-0", "e-")
    gap = loss_gap(ref, mine)
    assert above == f"iteration {gap['first_above_1e-3']}"
    assert worst == f"{gap['max_rel_diff']:.1%}"


def test_local_spec_reach_figures_are_the_measured_ones():
    """The local-spec bullet: the length that trained, its peak, and the length that ran out of memory,
    as ``bench/results/e2e_local_reach.json`` holds them."""
    text = " ".join(_results().split())
    rows = json.loads((ROOT / "bench" / "results" / "e2e_local_reach.json").read_text())["rows"]
    reach = next(r for r in rows if r["case"] == "reach,spec=local" and r["method"] == "peakflat-auto")
    ok = next(r for r in rows if r["case"] == f"seq={reach['reach_tokens']},spec=local")
    assert f"trained {reach['reach_tokens'] // 1024}K tokens at {ok['peak_gib']:.1f} GiB (its time is one run" in text
    assert ok["ms"] is None  # one run: no timing until three
    assert f"{ok['extra']['one_run_ms'] / 1000:.0f} s per iteration, the mean of its two" in text
    assert "iteration_2_own" not in ok["extra"]
    planned = ok["extra"]["component_peaks_gib"]["total"][1]
    assert f"planned {planned:.1f} GiB ({planned / ok['peak_gib'] - 1:+.1%})" in text  # the plan against the run
    assert "with the tiled attention sublayer on" in text and "--peakflat-tile" in ok["extra"]["auto"]["added"]
    half = next(r for r in rows if r["case"] == "seq=524288,spec=local")
    assert f"512K trained at {half['peak_gib']:.1f} GiB with the tile off" in text
    assert "--peakflat-tile" not in half["extra"]["auto"]["added"]
    failing = reach["extra"]["first_failing"]
    assert reach["extra"]["limited_by"] == f"error at {failing}" and failing == 2**20
    assert "At 1M it ran out of memory" in text and ok["extra"]["card"] == "NVIDIA H100 80GB HBM3"


def test_the_replanned_rows_are_the_planners_figures(monkeypatch):
    """The README's "planned again" range: each TE row that trained, planned now with its own flags on its card
    and its attention code (tests/test_planner_measured.py's planning), against its measured peak; and the 1M run
    planned not to fit."""
    from tests.test_planner_measured import CARDS, _flags, attention_as_it_ran, pc

    text = " ".join(_results().split())
    ratios, fits_1m = [], None
    for r in E2E:
        if not r["case"].startswith("seq=") or r["extra"].get("outcome") not in ("ok", "oom"):
            continue
        with monkeypatch.context() as m:
            attention_as_it_ran(r, m)
            got = pc.predict(_flags(r), CARDS[r["extra"]["card"]])
        if r["extra"]["outcome"] == "ok":
            ratios.append(got.gib / r["peak_gib"] - 1)
        elif r["case"] == "seq=1048576,spec=te,one_te_call_per_tile":
            fits_1m = got.fits
    assert f"every row of the table lies within {min(ratios):+.1%} to {max(ratios):+.1%} of its run" in text
    assert fits_1m is False and "the 1M run that died with one TE call per tile does not fit" in text
