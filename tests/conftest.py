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
    test's budgets must not see it (memory.host)."""
    yield
    from megatron_peakflat.memory import host

    host.reset()
