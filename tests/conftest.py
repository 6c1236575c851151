import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_host_promise_outlives_its_test():
    """An optimizer a test built and never stepped promises host memory until it is collected; the next
    test's budgets must not see it (runtime.host)."""
    yield
    from megatron_peakflat.runtime import host

    host.reset()


@pytest.fixture
def triton_interpreter():
    """``testing.subproc.run_interpreted`` (a script with ``TRITON_INTERPRET=1``); the test is skipped, naming the
    bug, where the installed Triton's interpreter cannot run the package's kernels (``interpreter_gap``)."""
    from megatron_peakflat.testing.subproc import interpreter_gap, run_interpreted

    gap = interpreter_gap()
    if gap:
        pytest.skip(f"{gap} (an interpreter bug; the compiled kernels are tested in tests/gpu)")
    return run_interpreted


def plan_sdpa_as_keeping_packed_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan local-spec runs as the SDPA attention ran before it copied views of the packed QKV output
    (``integration/attention.py`` ``own_storage``): v's view kept the whole buffer alive in attention's backward.
    For results measured before that copy (rows without ``sdpa_copies_packed_views``)."""
    from megatron_peakflat.planner import te_limits

    freed = te_limits.packed_qkv_freed

    def as_before(shape, args, preset=False):  # noqa: ANN001, ANN202
        return freed(shape, args, preset=preset) and getattr(args, "transformer_impl", None) != "local"

    monkeypatch.setattr(te_limits, "packed_qkv_freed", as_before)


@pytest.fixture
def sdpa_kept_packed_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan_sdpa_as_keeping_packed_views`` for a test's whole body."""
    plan_sdpa_as_keeping_packed_views(monkeypatch)


def _megatron_core_at_least(version: tuple[int, ...]) -> bool:
    """From the installed distribution's metadata, without importing Megatron into the test process."""
    from megatron_peakflat.integration import compat

    return compat.at_least(version)


needs_pretrain_entry = pytest.mark.skipif(
    not _megatron_core_at_least((0, 19)),
    reason="python -m megatron_peakflat.pretrain needs megatron-core >= 0.19: older wheels' pretrain() takes "
           "a model_provider from Megatron-LM's pretrain_gpt.py, which they do not ship")


def pytest_collection_finish(session):
    """Freeze what collection made (torch, Megatron and the test modules, imported): a full garbage collection, as
    the tests' own ``gc.collect()`` and Python's periodic ones run, then walks only what the tests make (it walked
    ~450k objects with Megatron imported, 0.24 s each on a 2-core machine)."""
    import gc

    gc.collect()
    gc.freeze()
