"""bench/hbm_cap.py: a run capped to a smaller card sees that card's total and free memory, and its allocator is
held to the cap (the fraction of the real card) once per device."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hbm_cap  # noqa: E402


def test_cap_reports_the_smaller_card_and_sets_the_fraction_once(monkeypatch):
    fractions = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: fractions.append((f, d)))
    hbm_cap.install(80.0)
    free, total = torch.cuda.mem_get_info()
    assert total == 80 * 2**30 and free == 40 * 2**30  # 40 GiB of the real card are in use: 40 of the 80 left
    torch.cuda.set_device(0)
    torch.cuda.mem_get_info(0)
    assert fractions == [(80 / 140, 0)]


def test_a_cap_above_the_card_changes_nothing(monkeypatch):
    fractions = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: fractions.append((f, d)))
    hbm_cap.install(139.0)
    assert torch.cuda.mem_get_info() == (70 * 2**30, 80 * 2**30) and fractions == []
