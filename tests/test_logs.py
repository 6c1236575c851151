"""peakflat's logs on several ranks: rank 0 logs each decision once, a line that differs per rank comes from every
rank with its rank in front, and --peakflat-log-all-ranks brings back every rank's lines."""

from __future__ import annotations

import logging
import sys

import pytest

import megatron_peakflat
from megatron_peakflat import PeakflatConfig, PeakflatConfigError
from megatron_peakflat.config import GeneralConfig
from megatron_peakflat.integration import logs
from megatron_peakflat.optimizer.config import OptimizerConfig
from megatron_peakflat.testing import run_distributed


def _capture() -> tuple[list[str], logging.Handler]:
    """A handler on the package's logger (at INFO) that keeps every message reaching it, in order."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logs.log.addHandler(handler)
    logs.log.setLevel(logging.INFO)
    return lines, handler


def _log_worker(rank: int, world: int, all_ranks: bool) -> list[str]:
    """apply() with no component (its 'no component enabled' line is shared), then one shared and one per-rank
    line of our own, then remove() and one more shared line; every line that reaches a handler, in order."""
    lines, handler = _capture()
    megatron_peakflat.apply(PeakflatConfig(general=GeneralConfig(attention="local", log_all_ranks=all_ranks)))
    logs.log.info("peakflat test: shared decision")
    logs.info_once("peakflat test: %d tokens here", 100 + rank, per_rank=True)
    logs.log.warning("peakflat test: %s of host memory here", f"{rank} GiB", extra=logs.PER_RANK)
    megatron_peakflat.remove()
    logs.log.info("peakflat test: after remove")
    logs.log.removeHandler(handler)
    return lines


def test_rank_1_logs_only_its_per_rank_lines_with_its_rank():
    """World 2 over gloo: rank 1 prints none of the shared lines (apply's own and ours), and prints its per-rank
    lines prefixed ``[rank 1]``; rank 0 prints the shared lines as they are and its per-rank lines as ``[rank 0]``.
    remove() takes the filter away again."""
    rank0, rank1 = run_distributed(_log_worker, 2, False, timeout=120)
    assert rank0 == [
        "peakflat: no component enabled; Megatron runs unchanged",
        "peakflat test: shared decision",
        "[rank 0] peakflat test: 100 tokens here",
        "[rank 0] peakflat test: 0 GiB of host memory here",
        "peakflat test: after remove",
    ], rank0
    assert rank1 == [
        "[rank 1] peakflat test: 101 tokens here",
        "[rank 1] peakflat test: 1 GiB of host memory here",
        "peakflat test: after remove",
    ], rank1


def test_log_all_ranks_brings_back_every_ranks_lines_each_with_its_rank():
    """--peakflat-log-all-ranks: rank 1 prints the shared lines too, each saying it is rank 1's."""
    rank0, rank1 = run_distributed(_log_worker, 2, True, timeout=120)
    assert rank1 == [
        "[rank 1] peakflat: no component enabled; Megatron runs unchanged",
        "[rank 1] peakflat test: shared decision",
        "[rank 1] peakflat test: 101 tokens here",
        "[rank 1] peakflat test: 1 GiB of host memory here",
        "peakflat test: after remove",
    ], rank1
    assert rank0[:2] == ["[rank 0] peakflat: no component enabled; Megatron runs unchanged",
                         "[rank 0] peakflat test: shared decision"], rank0


def _pipeline_worker(rank: int, world: int) -> list[str]:
    """Megatron's parallel state at PP=2, DP=2 (ranks 0-1 the first stage, 2-3 the second), then one shared line
    (a decision the last stage makes, such as the loss's) and one per-rank line."""
    from megatron_peakflat.testing.megatron_cpu import destroy_megatron_parallel, init_megatron_parallel

    lines, handler = _capture()
    megatron_peakflat.apply(PeakflatConfig(general=GeneralConfig(attention="local")))
    init_megatron_parallel(pp=2)
    logs.log.info("peakflat test: this stage's decision")
    logs.log.info("peakflat test: %d tokens here", 10 * rank, extra=logs.PER_RANK)
    destroy_megatron_parallel()
    megatron_peakflat.remove()
    logs.log.removeHandler(handler)
    return lines


def test_each_pipeline_stage_logs_its_decisions_once_from_its_first_rank():
    """World 4 at PP=2: a line the last stage logs (its loss, its layers) reaches the log once, from that stage's
    first rank (2), which names itself; its data-parallel peer (3) and the first stage's (1) print no shared line."""
    got = run_distributed(_pipeline_worker, 4, timeout=180)
    assert got[0] == ["peakflat: no component enabled; Megatron runs unchanged", "peakflat test: this stage's decision",
                      "[rank 0] peakflat test: 0 tokens here"], got[0]
    assert got[1] == ["[rank 1] peakflat test: 10 tokens here"], got[1]
    assert got[2] == ["[rank 2] peakflat test: this stage's decision", "[rank 2] peakflat test: 20 tokens here"], got[2]
    assert got[3] == ["[rank 3] peakflat test: 30 tokens here"], got[3]


def test_the_flag_comes_from_the_general_config():
    """``--peakflat-log-all-ranks`` is GeneralConfig.log_all_ranks, derived from the dataclass like every flag."""
    import argparse

    ns = megatron_peakflat.add_args(argparse.ArgumentParser()).parse_args(["--peakflat-log-all-ranks"])
    assert ns.peakflat_log_all_ranks is True
    assert GeneralConfig.from_namespace(ns).log_all_ranks is True


def test_a_refused_apply_leaves_logging_as_it_was():
    """A configuration apply() refuses puts no filter on the logger (nor takes one off)."""
    assert not [f for f in logs.log.filters if isinstance(f, logs.RankFilter)]
    with pytest.raises(PeakflatConfigError):
        megatron_peakflat.apply(PeakflatConfig(optimizer=OptimizerConfig(impl="offload-stream", slots=5)))
    assert not [f for f in logs.log.filters if isinstance(f, logs.RankFilter)]


def test_pretrain_logs_in_megatrons_format_from_rank_0_only():
    """``python -m megatron_peakflat.pretrain`` sets up logging as Megatron's training does (its handler on stdout,
    ``LEVEL:logger:message``) with the rank filter already on, so that its first lines come from rank 0 only."""
    from megatron_peakflat.testing.forked_module import run_forked
    from megatron_peakflat.testing.subproc import ROOT, child_env

    out = {}
    for rank in ("0", "1"):  # a process each (logging's set-up is global), forked with torch and Megatron imported
        res = run_forked("tests._logging_probe", [], nproc=1, launcher=False, env=child_env(RANK=rank), cwd=ROOT,
                         timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        out[rank] = [ln for ln in res.stdout.splitlines() if "megatron_peakflat" in ln]
    assert out["0"] == ["INFO:megatron_peakflat:peakflat: shared", "INFO:megatron_peakflat:[rank 0] peakflat: mine"]
    assert out["1"] == ["INFO:megatron_peakflat:[rank 1] peakflat: mine"]


def test_bench_reads_peakflat_lines_under_megatrons_format_and_rank_prefix():
    """bench/pretrain_compare.py keeps what the components said they did from a log in Megatron's format, with or
    without a per-rank prefix, each line once."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.pretrain_compare import parse_log

    text = "\n".join([
        "INFO:megatron_peakflat:peakflat: patched megatron.core.optimizer.HybridDeviceOptimizer: ...",
        "INFO:megatron_peakflat:[rank 0] peakflat dispatch: first MoE layer call: 4096 tokens here, K=2 chunks",
        "INFO:megatron_peakflat:[rank 1] peakflat dispatch: first MoE layer call: 4096 tokens here, K=2 chunks",
        "WARNING:megatron_peakflat:[rank 1] peakflat sco: --peakflat-sco-budget 8 GiB exceeds 4 GiB; clamped",
        "peakflat vocab: Ring-DTP loss (schedule=auto, block=auto, kernel=auto); logits are not built",
        "INFO:megatron_peakflat:peakflat SCO: TorchHostPool host pool (a log of 0.1.0)",
    ])
    assert parse_log(text)["peakflat_lines"] == [
        "peakflat dispatch: first MoE layer call: 4096 tokens here, K=2 chunks",
        "peakflat sco: --peakflat-sco-budget 8 GiB exceeds 4 GiB; clamped",
        "peakflat vocab: Ring-DTP loss (schedule=auto, block=auto, kernel=auto); logits are not built",
        "peakflat SCO: TorchHostPool host pool (a log of 0.1.0)",
    ]
