"""bench/tile.py --dry-run on CPU: the untiled and tiled sublayer at two lengths and two tiles, rows written with
where they ran, each time the median of 3 runs, the tiled output and gradients equal to the untiled ones, and the
tiled peak (LiveBytesMeter) at or under tile/bound.py's prediction and under the untiled peak at the longer length;
a tiled sublayer that computes something else is a 'mismatch' row and exit status 1, and one out of memory an
'OOM' row, the other rows still written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from megatron_peakflat.testing.subproc import child_env

ROOT = Path(__file__).resolve().parent.parent


def test_tile_benchmark_dry_run_on_cpu(tmp_path):
    out = tmp_path / "tile.json"
    env = child_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "bench/tile.py", "--dry-run", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["component"] == "tile"
    rows = doc["rows"]
    assert {(r["extra"]["seq"], r["method"]) for r in rows} == {
        (s, m) for s in (64, 128) for m in ("full-recompute", "peakflat-tile16", "peakflat-tile48")}
    for r in rows:
        e = r["extra"]
        assert (r["card"], r["threads"]) == ("cpu", 1) and r["commit"], r
        assert r["exact"] is True and "error" not in e, r
        assert len(e["runs_ms"]) == 3 and r["ms"] == sorted(e["runs_ms"])[1] and e["spread"] >= 0, r
        assert e["peak_bytes"] > 0 and abs(r["peak_gib"] - e["peak_bytes"] / 2**30) < 1e-6, r
        if r["method"] == "full-recompute":
            assert "bound_bytes" not in e, r
            continue
        assert e["peak_bytes"] <= e["bound_bytes"], r
        assert e["peak_vs_bound"] == round(e["peak_bytes"] / e["bound_bytes"], 4) <= 1.0, r
        assert e["max_rel_err"] <= e["tol"] == 1e-4 and e["checkpoint"] is True, r
    untiled = {r["extra"]["seq"]: r["extra"]["peak_bytes"] for r in rows if r["method"] == "full-recompute"}
    tiled16 = {r["extra"]["seq"]: r["extra"]["peak_bytes"] for r in rows if r["method"] == "peakflat-tile16"}
    assert tiled16[128] < untiled[128], (tiled16, untiled)  # 8 tiles of 16 hold less than the whole sublayer


def test_tile_benchmark_flags_a_mismatch_and_records_an_oom(tmp_path, monkeypatch):
    """The comparison can fail: RoPE of position 0 for every tile (the tile-16 rows) is a 'mismatch' row and exit
    status 1; a tile-48 step out of memory is an 'OOM' row with no peak or time; the untiled rows stay exact."""
    sys.path.insert(0, str(ROOT))
    from bench import tile as bench_tile
    from megatron_peakflat.tile.ops import TileOps

    real_reference, real_tiled = bench_tile.reference_sublayer, bench_tile.Sublayer.tiled

    def wrong_reference(args, device, dtype):  # noqa: ANN001, ANN202
        sub = real_reference(args, device, dtype)
        ops = sub.ops(0)
        wrong = TileOps(qkv=lambda x, start: ops.qkv(x, 0), attend=ops.attend, project=ops.project)
        sub.ops = lambda seq: wrong
        return sub

    def tiled(self, x, tile, seq):  # noqa: ANN001, ANN202
        if tile == 48:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_tiled(self, x, tile, seq)

    monkeypatch.setattr(bench_tile, "reference_sublayer", wrong_reference)
    monkeypatch.setattr(bench_tile.Sublayer, "tiled", tiled)
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "tile.json"
    assert bench_tile.main(["--dry-run", "--repeats", "1", "--iters", "1", "--out", str(out)]) == 1
    rows = {(r["extra"]["seq"], r["method"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 6
    for seq in (64, 128):
        assert rows[seq, "full-recompute"]["exact"] is True
        bad = rows[seq, "peakflat-tile16"]
        assert bad["exact"] is False and bad["extra"]["error"] == "mismatch" and bad["extra"]["max_rel_err"] > 1e-2
        oom = rows[seq, "peakflat-tile48"]
        assert oom["extra"]["error"] == "OOM" and oom["peak_gib"] is None and oom["ms"] is None, oom
