"""The runtime helpers the components share: the machine probes (``runtime.machine``)."""

from __future__ import annotations

import os

import pytest

from megatron_peakflat.runtime import host, machine

MEMINFO = "MemTotal:       131072 kB\nMemFree:         1024 kB\nMemAvailable:    65536 kB\n"


def test_meminfo_fields_in_bytes_and_none_where_unreadable(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert machine.mem_total(str(path)) == 131072 * 1024
    assert machine.mem_available(str(path)) == 65536 * 1024
    assert machine.meminfo_bytes("MemFree", str(path)) == 1024 * 1024
    assert machine.meminfo_bytes("Mem", str(path)) is None  # a prefix of a field is not the field
    assert machine.mem_total(str(tmp_path / "absent")) is None
    path.write_text("MemTotal: many kB\n")
    assert machine.mem_total(str(path)) is None
    path.write_text("MemTotal:\n")
    assert machine.mem_total(str(path)) is None


@pytest.mark.parametrize("value, default, expected", [
    (None, 1, 1), (None, 8, 8), (None, None, None),
    ("", 1, 1), ("", None, None), ("four", 8, 8), ("0", 1, 1), ("-2", None, None),
    ("4", 1, 4), ("4", 8, 4), ("4", None, 4),
])
def test_local_world_size_is_torchruns_where_positive_else_the_callers_default(monkeypatch, value, default,
                                                                                expected):
    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert machine.local_world_size(default=default) == expected


def test_host_sizes_for_one_rank_per_node_where_torchrun_does_not_say(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host.local_ranks() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert host.local_ranks() == 3
    assert host.mem_available is machine.mem_available  # one reader; tests and dry-run hooks fake it in host


def test_usable_cores_follow_the_affinity_mask_else_every_core(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        assert machine.usable_cores() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert machine.usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert machine.usable_cores() == 1
