"""The planner against GPU rows committed in bench/results (``FILES``): each measured run's own flags (with what
``--peakflat auto`` added in place of auto), planned for the attention code that ran it (``extra``'s
``grouped_call_min_keys``: null where every grouped-head attention was one call; ``te_tile_kv_head_calls``: absent
where the tiled sublayer ran one Transformer Engine call per tile; ``sdpa_copies_packed_views``: absent where the
SDPA attention saved v as a view of the packed QKV output), on the card it ran on. A row
that trained is predicted within the calibration's band of its measured peak (max allocated: ``pc.BAND``, 0.95
to 1.10, over rather than under); a row that died of memory is not planned to fit."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import planner_calibration as pc  # noqa: E402
from bench.e2e import _without_option  # noqa: E402
from tests.conftest import plan_sdpa_as_keeping_packed_views  # noqa: E402

CARDS = {"NVIDIA H100 80GB HBM3": pc.Machine("H100", int(79.18 * pc.GIB), 128 * pc.GIB, 132)}
"""Each card the rows ran on as the planner is told of it: torch's total memory, the GPU machine's RAM, its SMs."""
FILES = (("e2e_local_reach.json", "seq="), ("e2e.json", "same_loss,"), ("e2e.json", "seq="),
         ("planner_calibration.json", "shape="))
"""Each results file and the rows of it planned here: the local spec's reach; Transformer Engine's same-loss runs
at 8K under --deterministic-mode, whose peak holds cuDNN's deterministic backward's dP workspace (planned without
it, peakflat-auto's row read -11.0% and peakflat-all's -23.1%); Transformer Engine's reach, both methods, whose
long rows hold cuDNN's dK and dV at the query heads (planned without them, 768K read -17.8% and the 1M run that
died of it was planned to fit); and the calibration's shapes, which no term was fitted to (3 iterations each, the
peak after the first optimizer step)."""

OVER_PLANNED: dict[str, str] = {}
"""Rows whose plan is outside the band, each with what is known of why: strict xfails, which fail once the plan is
in the band, so that the entry is then removed."""


def _rows() -> list[tuple[str, dict]]:
    rows = []
    for name, prefix in FILES:
        for r in json.loads((ROOT / "bench" / "results" / name).read_text())["rows"]:
            if r["case"].startswith(prefix) and r["extra"].get("outcome") in ("ok", "oom", "error"):
                rows.append((f"{name}:{r['case']}:{r['method']}", r))
    return rows


def _params() -> list:
    return [pytest.param(n, r, id=n, marks=pytest.mark.xfail(reason=OVER_PLANNED[n], strict=True))
            if n in OVER_PLANNED else pytest.param(n, r, id=n) for n, r in _rows()]


def _flags(row: dict) -> list[str]:
    """The row's training flags, with what ``--peakflat auto`` added in place of auto (so that the plan's fit
    verdict is that configuration's, not auto's search)."""
    argv = shlex.split(row["extra"]["command"])
    flags = argv[argv.index("megatron_peakflat.pretrain") + 1:]
    if "auto" in row["extra"]:  # bench/e2e.py's rows
        return _without_option(flags, "--peakflat") + shlex.split(row["extra"]["auto"]["added"])
    if "added" in row["extra"]:  # bench/planner_calibration.py's rows
        return _without_option(flags, "--peakflat") + list(row["extra"]["added"])
    return flags


def _memory_error(row: dict) -> bool:
    """The run died of memory, or peakflat's start-up refused it because its plan does not fit (the plan's own
    verdict, which the test then holds to the planner as it is now)."""
    text = "\n".join(row["extra"].get("error_lines", [])) + "".join(a.get("tail", "")
                                                                      for a in row["extra"].get("attempts", []))
    refused = any(ln.startswith("megatron-peakflat: ") and "does not fit" in ln
                  for ln in row["extra"].get("error_lines", []))
    return row["extra"]["outcome"] == "oom" or refused or any(m in text for m in ("out of memory",
                                                                                  "Failed to CUDA calloc"))


def attention_as_it_ran(row: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's attention calls set to those of the code that ran ``row`` (its ``extra``)."""
    from megatron_peakflat.attention import calls
    from megatron_peakflat.planner import model

    if not row["extra"].get("sdpa_copies_packed_views"):
        plan_sdpa_as_keeping_packed_views(monkeypatch)

    monkeypatch.setattr(calls, "GROUPED_CALL_MIN_KEYS", row["extra"].get("grouped_call_min_keys") or 1 << 62)
    if not row["extra"].get("te_tile_kv_head_calls"):
        monkeypatch.setattr(model, "te_tile_calls", lambda s, run: 1)


@pytest.mark.parametrize("name,row", _params())
def test_a_measured_row_is_planned_as_it_ran(name, row, monkeypatch):
    attention_as_it_ran(row, monkeypatch)
    machine = CARDS[row["extra"]["card"]]
    machine = pc.Machine(machine.card, int(row["extra"].get("hbm_cap_gib", machine.hbm_bytes / pc.GIB) * pc.GIB),
                         machine.host_bytes, machine.sm_count)
    got = pc.predict(_flags(row), machine)
    if row["extra"]["outcome"] == "ok":
        low, high = pc.BAND
        measured = row.get("peak_gib") or row["measured_gib"]
        assert low <= got.gib / measured <= high, (got.gib, measured)
    else:
        assert _memory_error(row), "a row that failed for another reason says nothing of the plan"
        assert not got.fits, (got.gib, "planned to fit a run that ran out of memory")
