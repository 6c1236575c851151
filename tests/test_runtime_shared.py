"""The runtime helpers the components share: the machine probes (``runtime.machine``) and the pinned host region
(``runtime.pinned``) that OffloadStreamAdamW's state and SCO's native boundary pool are both carved from."""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch

from megatron_peakflat import _ext
from megatron_peakflat.runtime import host, machine, pinned

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


@pytest.mark.parametrize("total", [96 * 2**30, None])
@pytest.mark.parametrize("ranks, auto_local, planned_node", [(None, 1, 8), ("4", 4, 4), ("0", 1, 8), ("x", 1, 8)])
def test_auto_the_planner_and_the_peak_report_read_the_machine_through_the_one_probe(monkeypatch, total, ranks,
                                                                                     auto_local, planned_node):
    """``--peakflat auto``, the planner's machine figures and the runtime peak report read host memory and the ranks
    per node from ``runtime.machine``, each with its own default where it says nothing: auto one rank per node and
    2048 GiB, the planner (on a GPU machine) 2048 GiB, the peak report a node of 8 GPUs and 1024 GiB."""
    import argparse

    from megatron_peakflat import auto
    from megatron_peakflat.integration import peaks
    from megatron_peakflat.planner import build
    from megatron_peakflat.planner.megatron_args import megatron_parser

    gib = 2**30
    monkeypatch.setattr(machine, "meminfo_bytes", lambda field, path=machine.MEMINFO: total)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    monkeypatch.setenv("WORLD_SIZE", "2")
    world, local, _, host_bytes = auto._machine()
    assert (world, local, host_bytes) == (2, auto_local, total if total is not None else 2048 * gib)
    assert build.local_host_gib() == (None if total is None else 96.0)
    monkeypatch.setattr(build, "local_hbm_gib", lambda: 80.0)  # on a GPU machine the planner takes its RAM
    assert build.machine_gib(None, None) == (80.0, 96.0 if total is not None else 2048.0)
    ns = megatron_parser().parse_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 "
                                      "--vocab-size 512 --micro-batch-size 1".split())
    ns.world_size, ns.data_parallel_size = 1, 1
    monkeypatch.setattr(peaks, "_hbm_bytes", lambda: 80 * gib)
    monkeypatch.setattr(peaks, "_config", lambda args: __import__("megatron_peakflat").PeakflatConfig())
    peaks._cache.clear()
    try:
        run = peaks.prediction(argparse.Namespace(**vars(ns)))[0].run
    finally:
        peaks._cache.clear()
    assert (run.host_bytes_per_node, run.gpus_per_node) == (total if total is not None else 1024 * gib, planned_node)


def test_usable_cores_follow_the_affinity_mask_else_every_core(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        assert machine.usable_cores() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert machine.usable_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert machine.usable_cores() == 1


def _cxx_only_extension():
    ext = _ext.load()
    if ext is None or getattr(ext, "with_cuda", False):
        pytest.skip("needs the extension built without CUDA (its regions are registered through torch)")
    return ext


@pytest.mark.parametrize("owner", ["optimizer", "sco"])
def test_a_cxx_only_region_is_registered_through_torch_once_and_unregistered_when_it_goes(monkeypatch, owner):
    """Both owners' regions are one class: where CUDA is and the extension cannot pin, the whole region is
    registered through torch in one call, and unregistered when the owner lets it go."""
    from megatron_peakflat.optimizer.host_memory import HostRegion
    from megatron_peakflat.sco import NativeHostPool

    ext = _cxx_only_extension()
    registered, unregistered = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "register_host_memory", lambda ptr, n: registered.append((ptr, n)) or "")
    monkeypatch.setattr(pinned, "unregister_host_memory", unregistered.append)
    if owner == "optimizer":
        thing = HostRegion(4096, pin=True, ext=ext)
        region = thing
    else:
        thing = NativeHostPool(4096, pin=True, module=ext)
        region = thing._region
    assert thing.pinned and region.pin_error == ""
    assert registered == [(int(region._pool.base_address), 4096)]
    del thing, region
    gc.collect()
    assert unregistered == [registered[0][0]]


@pytest.mark.parametrize("owner, says", [("optimizer", "peakflat optimizer: pinning 4.00 KiB of host memory failed"),
                                         ("sco", "peakflat sco: native host pool is pageable")])
def test_a_failed_registration_leaves_the_region_pageable_and_each_owner_says_so(monkeypatch, caplog, owner, says):
    from megatron_peakflat.optimizer.host_memory import HostRegion
    from megatron_peakflat.sco import NativeHostPool

    ext = _cxx_only_extension()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "register_host_memory", lambda ptr, n: "cudaHostRegister returned 2")
    with caplog.at_level(logging.WARNING, logger="megatron_peakflat"):
        thing = HostRegion(4096, pin=True, ext=ext) if owner == "optimizer" else NativeHostPool(4096, pin=True,
                                                                                                 module=ext)
    assert not thing.pinned
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(says) and "cudaHostRegister returned 2" in said[0], said
    if owner == "sco":
        slot = thing.acquire(100)
        assert slot is not None and slot.nbytes == 100 and not slot.buffer.any()
