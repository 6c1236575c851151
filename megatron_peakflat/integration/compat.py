"""Megatron-Core's versions, in one place: the range megatron-peakflat supports, the releases it was checked on, and
what a release needs worked around. Everything else asks here (the registry's version guard, start-up, the
environment check, the pretrain entry point, the tests).

No Megatron import: the installed version is read from the distribution's metadata (or ``package_info``), so
that this module costs nothing and can be asked before Megatron is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from typing import Any

from ..config_base import PeakflatConfigError

__all__ = ["CHECKED_ON", "REQUIREMENT", "PRETRAIN_ENTRY_FROM", "MTP_FULL_RECOMPUTE_FROM", "OFFLOAD_FP32_FAILS_THROUGH",
           "megatron_core_version", "version_tuple", "at_least", "checked_since", "pip_spec",
           "unchecked_version_warning", "check_megatron_version", "check_args"]

log = logging.getLogger("megatron_peakflat")

CHECKED_ON = ("0.18.2", "0.19.2")
"""The releases the CPU suite (``make test``) passes on; the GPU tests and benchmarks ran on 0.19.2. megatron-core
0.17.1 lacks ``megatron.core.recompute`` and ``GPTModel.forward(output_processor=...)``, which the registry catches."""
REQUIREMENT = "megatron-core>=0.18.2,<0.20"
"""The install requirement (pyproject.toml's dependency, tests/test_compat.py): from the oldest release checked up to
the next minor release after the newest."""
PRETRAIN_ENTRY_FROM = (0, 19)
"""``python -m megatron_peakflat.pretrain`` builds the GPT with ``gpt_config_from_args``, new in 0.19; an older
release's ``pretrain()`` takes a model_provider from Megatron-LM's pretrain_gpt.py, which its wheel does not ship."""
MTP_FULL_RECOMPUTE_FROM = (0, 19)
"""Before 0.19 the MTP layer fails under full recompute: ``MultiTokenPredictionLayer.forward`` passes ``padding_mask``
to its ``_checkpointed_forward``, which takes no such argument (seen on CPU with 0.18.2)."""
OFFLOAD_FP32_FAILS_THROUGH = (0, 19, 2)
"""Up to this release Megatron's own offloaded optimizer fails on fp32 parameters: DistributedOptimizer hands
HybridDeviceOptimizer fp32 shards that are views of the parameters, and torch refuses them once the model is built
("can't optimize a non-leaf Tensor"; fixed on Megatron-LM's main by PR 6982). Later releases are left to Megatron."""


def megatron_core_version() -> str | None:
    """The installed megatron-core's version: its distribution's, else ``megatron.core.package_info``'s (a
    source checkout on PYTHONPATH); None when neither can be read."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(importlib.import_module("megatron.core.package_info").__version__)
    except (ImportError, AttributeError):
        return None


def version_tuple(text: str | None = None) -> tuple[int, ...] | None:
    """(major, minor, patch) of ``text``, by default the installed megatron-core's; None when unreadable."""
    text = megatron_core_version() if text is None else text
    return None if text is None else tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def at_least(version: tuple[int, ...]) -> bool:
    """Whether the installed megatron-core is ``version`` or later (False when it cannot be read)."""
    installed = version_tuple()
    return installed is not None and installed >= version


def checked_since(version: tuple[int, ...]) -> tuple[str, ...]:
    """The releases of ``CHECKED_ON`` from ``version`` on (what a patch that older releases lack was checked on)."""
    return tuple(v for v in CHECKED_ON if version_tuple(v) >= version)  # type: ignore[operator]


def pip_spec(since: tuple[int, ...] | None = None) -> str:
    """The pip requirement to install, quoted for a shell: ``REQUIREMENT``, or from ``since`` with its upper bound."""
    if since is None:
        return f"'{REQUIREMENT}'"
    return f"'megatron-core>={'.'.join(map(str, since))},{REQUIREMENT.split(',')[-1]}'"


def unchecked_version_warning(version: str | None) -> str | None:
    """The warning for a megatron-core ``version`` outside the checked range, from the lowest to the highest of
    ``CHECKED_ON`` (a local suffix such as ``+cu130`` ignored), or unreadable; None inside the range."""
    from packaging.version import InvalidVersion, Version

    lo, hi = min(CHECKED_ON, key=Version), max(CHECKED_ON, key=Version)
    checked = f"{lo} to {hi} (tested on {', '.join(CHECKED_ON)})"
    try:
        inside = version is not None and Version(lo) <= Version(Version(version).public) <= Version(hi)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    what = "could not be read" if version is None else f"is {version}"
    return (f"peakflat: the installed megatron-core {what}, outside the range these patches were checked on: "
            f"megatron-core {checked}. Each patched symbol is looked up and its signature checked at start-up, but "
            f"a patch may rely on behaviour that changed with no change of name or signature; install a "
            f"megatron-core in that range, or run the package's CPU tests against this one before training on it.")


_version_warned = False


def check_megatron_version() -> str | None:
    """Compare the installed megatron-core with ``CHECKED_ON``; outside the checked range, log one warning per
    process (never an error) and return it."""
    global _version_warned
    note = unchecked_version_warning(megatron_core_version())
    if note and not _version_warned:
        _version_warned = True
        log.warning(note)
    return note


def check_args(cfg: Any, args: Any) -> None:
    """Refuse, at start-up, Megatron flags that the installed megatron-core release fails on by itself (whatever
    peakflat does), naming the fix. ``cfg``: the PeakflatConfig; ``args``: Megatron's parsed args, read as a plain
    namespace. Run beside ``PeakflatConfig.validate(args)`` wherever a command line is judged as start-up does."""
    layers = getattr(args, "mtp_num_layers", None)
    if layers and getattr(args, "recompute_granularity", None) == "full":
        version = version_tuple()
        if version is not None and version < MTP_FULL_RECOMPUTE_FROM:
            raise PeakflatConfigError(
                "--mtp-num-layers", layers,
                f"megatron-core {'.'.join(map(str, version))}'s MTP layer fails under --recompute-granularity full at "
                "the first training step (\"_checkpointed_forward() got an unexpected keyword argument "
                "'padding_mask'\"; megatron-core 0.19 runs it)",
                "install megatron-core 0.19, or recompute selectively (SCO needs full recompute), or drop "
                "--mtp-num-layers")
    if (not cfg.enabled["optimizer"] and getattr(args, "optimizer_cpu_offload", False)
            and not (getattr(args, "bf16", None) or getattr(args, "fp16", None))):
        version = version_tuple()
        if version is not None and version <= OFFLOAD_FP32_FAILS_THROUGH:
            raise PeakflatConfigError(
                "--optimizer-cpu-offload", True,
                f"megatron-core {'.'.join(map(str, version))}'s offloaded optimizer fails on fp32 parameters (without "
                "--bf16 or --fp16) once the model is built (\"can't optimize a non-leaf Tensor\"; fixed on "
                "Megatron-LM's main by PR 6982)",
                "add --bf16, or add --peakflat-optimizer offload-stream (which runs fp32 parameters)")
