"""The demo's output: the loss table and its verdict, the table written to a file with the curves as a PNG beside
it (or one line saying the PNG was skipped without matplotlib), and one progress line per iteration."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_peakflat.cli.demo import loss_table, write_loss_curves
from megatron_peakflat.testing.subproc import ROOT


def test_loss_table_agrees_within_the_tolerance_and_not_beyond():
    table, agree = loss_table([5.0, 4.0, 3.0], [5.0, 4.0001, 3.0], rtol=1e-4)
    assert agree and table.splitlines()[2].split()[:3] == ["2", "4.000000", "4.000100"]
    assert "AGREE" in table.splitlines()[-1]
    _, agree = loss_table([5.0, 4.0, 3.0], [5.0, 4.01, 3.0], rtol=1e-4)
    assert not agree
    _, agree = loss_table([5.0, 4.0], [5.0], rtol=1e-4)  # a run that stopped early does not agree
    assert not agree
    _, agree = loss_table([5.0], [float("nan")], rtol=1e-4)
    assert not agree


def test_the_table_and_the_png_are_written_side_by_side(tmp_path):
    pytest.importorskip("matplotlib")
    table, _ = loss_table([5.0, 4.0, 3.0], [5.0, 4.0, 3.0], rtol=1e-4)
    said = write_loss_curves([5.0, 4.0, 3.0], [5.0, 4.0, 3.0], table, tmp_path / "out", "title")
    assert (tmp_path / "out" / "loss_curves.txt").read_text() == table + "\n"
    png = (tmp_path / "out" / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert said == [f"loss table written to {tmp_path / 'out' / 'loss_curves.txt'}",
                    f"loss curves written to {tmp_path / 'out' / 'loss_curves.png'}"]


def test_without_matplotlib_the_png_is_skipped_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    table, _ = loss_table([5.0], [5.0], rtol=1e-4)
    said = write_loss_curves([5.0], [5.0], table, tmp_path, "title")
    assert (tmp_path / "loss_curves.txt").exists() and not (tmp_path / "loss_curves.png").exists()
    assert len(said) == 2 and said[1].startswith("loss curves PNG skipped: matplotlib is not installed")


def test_a_short_demo_prints_one_progress_line_per_iteration(tmp_path):
    """Two ranks on CPU, 3 iterations each way: 3 lines per run while it trains, in order, then the table, the
    files and the verdict (exit 0: the curves agree)."""
    out = subprocess.run([sys.executable, "-m", "megatron_peakflat.demo", "--device", "cpu", "--steps", "3",
                          "--layers", "2", "--no-plan", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    progress = [line.split()[:3] for line in out.stdout.splitlines() if line.startswith("  [")]
    assert progress == [[f"[{run}]", "iteration", f"{i}/3"] for run in ("megatron", "peakflat") for i in (1, 2, 3)]
    assert (tmp_path / "loss_curves.txt").exists()
    assert "-> AGREE" in out.stdout
