"""Fixes for megatron-core installed from its pip wheel, applied only by ``megatron_peakflat.pretrain``.

The 0.19.2 wheel ships the compiled dataset helpers (``helpers_cpp``) but not the Makefile that
``initialize_megatron`` runs to build them, so ``compile_helpers`` exits the job at start-up.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable

log = logging.getLogger("megatron_peakflat")


def skip_compile_when_prebuilt(original: Callable[[], None]) -> Callable[[], None]:
    """Replacement for ``compile_helpers``: keep the prebuilt helpers when the wheel has them."""

    def compile_helpers() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            log.info("peakflat: using the dataset helpers prebuilt in the megatron-core wheel")
            return
        original()

    return compile_helpers
