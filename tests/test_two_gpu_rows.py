"""The two-GPU benchmark rows, proven on CPU: bench/e2e.py at --cp 2 (torchrun on two ranks, --context-parallel-size 2,
TE's --cp-comm-type p2p, the planner's figure at two GPUs beside each peak, rows recording their card and GPU count in
a file of their own) and bench/vocab.py at TP 2 (the gather, activations and weights schedules against Megatron's
vocab-parallel cross-entropy, rows recording two GPUs); the harness takes no time ratio between rows of two GPU
counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import e2e, harness
from megatron_peakflat.testing.subproc import child_env, run_on_free_port
from tests.test_e2e import FITS, FakeMegatron

ROOT = Path(__file__).resolve().parent.parent


def test_no_time_ratio_between_rows_of_two_gpu_counts():
    one = harness.Row("N=1", "megatron-native-ce", 1.0, 2.0, True, {"runs_ms": [2.0, 2.1, 1.9]}, card="H100", gpus=1)
    two = harness.Row("N=1", "peakflat-gather", 1.0, 1.0, True, {"runs_ms": [1.0, 1.1, 0.9]}, card="H100", gpus=2)
    with pytest.raises(ValueError, match="GPU"):
        harness.ratio(two, one)
    assert harness.ratio_checks([one, two]) == []
    assert len(harness.ratio_checks([one, harness.Row(**{**two.__dict__, "gpus": None})])) == 1  # unrecorded: one GPU
    # e2e rows record theirs in extra
    a = {"case": "time,seq=8", "method": "peakflat-auto", "ms": 1.0, "extra": {"card": "H100", "gpus": 2}}
    b = {"case": "time,seq=8", "method": "megatron-te", "ms": 2.0, "extra": {"card": "H100"}}
    assert harness.gpus_of(a) == 2 and harness.gpus_of(b) == 1 and harness.ratio_checks([a, b]) == []


def test_e2e_at_cp2_runs_two_ranks_records_the_gpus_and_keeps_its_own_file(tmp_path, monkeypatch):
    fake = FakeMegatron(FITS)
    monkeypatch.setattr(e2e.Driver, "_planner_gib", lambda self, method, flags, a: 7.5 if self.cp == 2 else None)
    d = e2e.Driver(tmp_path / "e2e_cp2.json", e2e.TINY, "te", False, 100.0, runner=fake, cp=2)
    d.save()
    d.reach("megatron-te", 8192, 8192, 8192)
    d.timing([8192], ["megatron-te", "peakflat-auto"], 3, repeats=2)
    for cmd in fake.flags:
        assert cmd[cmd.index("--nproc-per-node") + 1] == "2", cmd
        assert cmd[cmd.index("--context-parallel-size") + 1] == "2" and "--cp-comm-type" in cmd, cmd
        assert cmd[cmd.index("--cp-comm-type") + 1] == "p2p", cmd
    doc = json.loads((tmp_path / "e2e_cp2.json").read_text())
    assert doc["gpus"] == 2 and doc["rows"]
    assert all(r["extra"]["gpus"] == 2 for r in doc["rows"])
    measured = [r for r in doc["rows"] if r["peak_gib"] is not None]
    assert measured and all(r["extra"]["planner_gib"] == 7.5 for r in measured)  # beside each measured peak
    with pytest.raises(e2e.PeakflatConfigError, match="--cp"):
        e2e.Driver(tmp_path / "e2e_cp2.json", e2e.TINY, "te", False, 100.0, runner=fake, cp=1)
    local = e2e.Driver(tmp_path / "local.json", e2e.TINY, "local", False, 100.0, runner=fake, cp=2)
    flags = local.flags(64, e2e.LADDER[0], [], 2)
    assert "--cp-comm-type" not in flags and flags[flags.index("--context-parallel-size") + 1] == "2"


def test_e2e_refuses_a_length_that_cp_does_not_divide(capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--dry-run", "--cp", "3", "--phases", "reach", "--max-seq", "64", "--out", "never_written.json"])
    assert "2 x CP = 6" in capsys.readouterr().err
    assert not (ROOT / "bench" / "results" / "never_written.json").exists()


def test_e2e_dry_run_at_cp2_trains_on_two_gloo_ranks(tmp_path):
    """The real entry point at --context-parallel-size 2 under torchrun on CPU: megatron-te and peakflat-auto."""
    out = "e2e_dryrun_cp2_test.json"
    try:
        proc = subprocess.run([sys.executable, "bench/e2e.py", "--dry-run", "--cp", "2", "--phases", "reach",
                               "--methods", "megatron-te,peakflat-auto", "--max-seq", "64", "--out", out],
                              cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env())
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        doc = json.loads((ROOT / "bench" / "results" / out).read_text())
    finally:
        (ROOT / "bench" / "results" / out).unlink(missing_ok=True)
    rows = {(r["case"], r["method"]): r for r in doc["rows"]}
    for method in ("megatron-te", "peakflat-auto"):
        r = rows[("seq=64,spec=local", method)]
        assert r["extra"]["outcome"] == "ok" and len(r["extra"]["losses"]) == 2, r["extra"]
        assert (r["extra"]["gpus"], r["extra"]["card"]) == (2, "cpu")
        assert "--nproc-per-node 2" in r["extra"]["command"] and "--context-parallel-size 2" in r["extra"]["command"]
        assert r["extra"]["planner_gib"] is not None, r["extra"]
    assert "--peakflat-vocab ring-dtp" in rows[("seq=64,spec=local", "peakflat-auto")]["extra"]["auto"]["added"]


def test_vocab_tp2_schedules_dry_run_writes_rows_with_two_gpus(tmp_path):
    methods = "peakflat-gather,peakflat-activations,peakflat-weights,megatron-native-ce"
    out = tmp_path / "vocab.json"
    env = child_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = run_on_free_port(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                         "--master-port", str(port), "bench/vocab.py", "--dry-run", "--methods",
                                         methods, "--out", str(out)], env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == set(methods.split(","))
    assert all(r["exact"] and r["gpus"] == 2 and r["card"] == "cpu" and r["case"].endswith("tp=2") for r in rows), rows
