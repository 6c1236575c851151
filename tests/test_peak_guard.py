"""The runtime guard (integration/peaks.py ``check_against_plan``): after the second iteration, a measured peak more
than 5% over the plan is warned of once, naming the term that differs most, or the plan's largest term where
nothing was measured per term. A fake measurement on CPU."""

from __future__ import annotations

import logging

import pytest

from megatron_peakflat.integration import peaks
from megatron_peakflat.planner.build import build
from megatron_peakflat.planner.model import GIB, plan


@pytest.fixture
def planned():
    shape, run, pf, _, _ = build(["--preset", "gpt-oss-20b", "--seq-len", "32K", "--gpus", "8", "--hbm-gib", "80"])
    pl = plan(shape, run, pf)
    st = pl.stages[0]
    reserve = st.rows["reserve"].peakflat
    peaks._guard["warned"] = False
    yield pl, st, st.total("peakflat") - reserve
    peaks._guard["warned"] = False


def test_within_five_percent_says_nothing(planned):
    pl, st, figure = planned
    assert peaks.check_against_plan(2, figure * 1.049, pl, st, "peakflat") is None
    assert peaks.check_against_plan(5, figure * 0.5, pl, st, "peakflat") is None


def test_the_first_iteration_is_not_judged(planned):
    pl, st, figure = planned
    assert peaks.check_against_plan(1, figure * 2, pl, st, "peakflat") is None


def test_over_names_the_term_that_differs_most_and_warns_once(planned):
    pl, st, figure = planned
    terms = {"vocab": st.rows["vocab"].peakflat + 3 * GIB, "dispatch": st.rows["dispatch"].peakflat + 1 * GIB}
    note = peaks.check_against_plan(2, figure * 1.10, pl, st, "peakflat", terms)
    assert note is not None and "10% over" in note and "'vocab'" in note and "differs most" in note
    assert peaks.check_against_plan(3, figure * 1.10, pl, st, "peakflat", terms) is None  # once


def test_without_per_term_figures_names_the_plans_largest_term(planned):
    pl, st, figure = planned
    largest = max((n for n in st.rows if n != "reserve"), key=lambda n: st.rows[n].peakflat)
    note = peaks.check_against_plan(2, figure * 1.2, pl, st, "peakflat", {})
    assert note is not None and f"the plan's largest is '{largest}'" in note


def test_the_training_log_guard_warns_from_rank_0(planned, monkeypatch, caplog):
    pl, st, figure = planned
    monkeypatch.setattr(peaks, "prediction", lambda args: (pl, st.stage))
    monkeypatch.setattr(peaks.meter, "lifetime_peak", lambda: int(figure * 1.3))
    monkeypatch.setattr(peaks.meter, "measured", lambda: {})
    monkeypatch.setattr(peaks, "_config", lambda args: pf_on())
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        peaks._guard_step(1, None)
        assert not caplog.records
        peaks._guard_step(2, None)
        peaks._guard_step(3, None)
    warned = [r for r in caplog.records if "over the plan" in r.getMessage()]
    assert len(warned) == 1


def pf_on():
    from megatron_peakflat.config import PeakflatConfig
    from megatron_peakflat.vocab.config import VocabConfig

    return PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))


def test_measured_terms_within_their_plan_point_at_the_others(planned):
    """Where every term measured on its own is (nearly) as planned, the excess lies elsewhere: the warning says so
    and names the largest term not measured, never a measured term that is off by rounding."""
    pl, st, figure = planned
    terms = {"vocab": st.rows["vocab"].peakflat + 1e-4 * GIB, "dispatch": st.rows["dispatch"].peakflat - GIB}
    rest = {n: r for n, r in st.rows.items() if n not in ("reserve", "vocab", "dispatch")}
    largest = max(rest, key=lambda n: rest[n].peakflat)
    note = peaks.check_against_plan(2, figure * 1.13, pl, st, "peakflat", terms)
    assert note is not None and "differs most" not in note and "'vocab'" not in note
    assert "(dispatch, vocab) are within their plan" in note and f"whose largest is '{largest}'" in note
