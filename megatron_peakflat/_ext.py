"""Lazy loader of the compiled extension ``megatron_peakflat._C`` (csrc/).

``load()`` imports the prebuilt module (``python setup.py build_ext --inplace`` or ``pip install``);
when it is missing and ``PEAKFLAT_JIT=1``, it builds csrc/ with ``torch.utils.cpp_extension.load``
(C++ only, plus the CUDA parts when torch has CUDA, nvcc is found and a GPU is visible; ``PEAKFLAT_CUDA=0/1``
forces either way).
The result, module or None, is cached with the reason, so the attempt happens once per process.
Nothing here runs at package import: callers (the optimizer's constructor) call ``load()``.
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

from ._build import cuda_toolkit, cxx_runtime_link_args

__all__ = ["load", "require", "reason", "ExtensionMissingError", "register_host_memory", "unregister_host_memory",
           "CARVE_ALIGN", "carve_end"]

log = logging.getLogger("megatron_peakflat")

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_BUILD_HINT = ("build it with `python setup.py build_ext --inplace` (or `pip install -e .`) from the repository root, "
               "or set PEAKFLAT_JIT=1 to compile csrc/ on first use")

_state: dict[str, object] = {}


class ExtensionMissingError(RuntimeError):
    """A feature needs ``megatron_peakflat._C`` and it could not be loaded."""


def _jit_build() -> ModuleType:
    import torch
    from torch.utils import cpp_extension

    sources = sorted(glob.glob(str(_CSRC / "*.cpp")))
    cuda_sources = sorted(glob.glob(str(_CSRC / "*.cu")))
    # CUDA parts only where they can be used (a visible GPU) unless PEAKFLAT_CUDA=1 forces them.
    env = os.environ.get("PEAKFLAT_CUDA")
    want_cuda = env == "1" or (env is None and torch.cuda.is_available())
    with_cuda = want_cuda and torch.version.cuda is not None and shutil.which("nvcc") is not None
    toolkit = cuda_toolkit(cpp_extension.CUDA_HOME)
    if with_cuda and toolkit is not None and toolkit != cpp_extension.CUDA_HOME:
        cpp_extension.CUDA_HOME = toolkit  # read by cpp_extension.load when it runs
    if with_cuda and toolkit is None:
        # e.g. nvcc is a wrapper outside the toolkit: build C++ only; the optimizer then pins its host
        # region through torch.cuda.cudart() instead of the extension's own cudaHostRegister
        log.info("peakflat: no CUDA toolkit (nvcc and headers) under CUDA_HOME=%s or /usr/local/cuda; JIT-building "
                 "megatron_peakflat._C as C++ only", cpp_extension.CUDA_HOME)
        with_cuda = False
    flags = ["-O3", "-ffp-contract=off"]
    defines = []
    if with_cuda:
        if not torch.cuda.is_available():
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # no device to ask: build for Hopper
        defines.append("-DPEAKFLAT_WITH_CUDA")
        sources += cuda_sources
    return cpp_extension.load(
        name="megatron_peakflat_C",
        sources=sources,
        extra_cflags=flags + defines,
        extra_cuda_cflags=["-O3"] + defines,
        extra_ldflags=cxx_runtime_link_args(),
        with_cuda=with_cuda,
        verbose=False,
    )


def load() -> ModuleType | None:
    """The extension module, or None (the reason is logged once and kept in ``reason()``)."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    import torch  # noqa: F401  # loads libc10 and libtorch, which the extension links against

    module: ModuleType | None = None
    why = ""
    try:
        module = importlib.import_module("megatron_peakflat._C")
        why = "prebuilt megatron_peakflat._C"
    except ImportError as e:
        why = f"megatron_peakflat._C is not built ({e})"
        if os.environ.get("PEAKFLAT_JIT") == "1":
            try:
                module = _jit_build()
                why = "JIT-built from csrc/ (PEAKFLAT_JIT=1)"
            except Exception as je:  # noqa: BLE001 - any build failure means "no extension", with the reason
                why += f"; JIT build failed: {type(je).__name__}: {je}"
    _state["module"], _state["reason"] = module, why
    if module is None:
        log.info("peakflat: native extension unavailable, using the PyTorch fallbacks: %s", why)
    else:
        log.info("peakflat: native extension loaded: %s (cuda=%s)", why, getattr(module, "with_cuda", False))
    return module


def reason() -> str:
    """Why ``load()`` returned what it returned ('' before the first call)."""
    return str(_state.get("reason", ""))


def require(feature: str) -> ModuleType:
    """The extension, or ExtensionMissingError naming ``feature`` and how to build it."""
    module = load()
    if module is None:
        raise ExtensionMissingError(f"{feature} needs the native extension megatron_peakflat._C: {reason()}. "
                                    f"To get it, {_BUILD_HINT}.")
    return module


CARVE_ALIGN = 256
"""Bytes to which a host region aligns each carve's start: the native ``HostPool.carve``'s ``kAlign``."""


def carve_end(used: int, nbytes: int) -> int:
    """Where ``nbytes`` carved from a region of which ``used`` bytes are taken end: the carve starts at the next
    multiple of ``CARVE_ALIGN``. A region checks this against its capacity before carving, so that a carve
    past the end is a MemoryError naming both sizes whichever pool it has."""
    return (used + CARVE_ALIGN - 1) // CARVE_ALIGN * CARVE_ALIGN + nbytes


def register_host_memory(ptr: int, nbytes: int) -> str:
    """Pin ``nbytes`` of host memory at ``ptr`` with one ``cudaHostRegister`` through torch's binding
    of the CUDA runtime; returns "" on success, else the error. A C++-only build of the extension
    (no ``PEAKFLAT_WITH_CUDA``) maps its host pools but cannot register them itself."""
    import torch

    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    return "" if int(err) == 0 else f"cudaHostRegister returned {err}"


def unregister_host_memory(ptr: int) -> None:
    """Undo ``register_host_memory`` (quietly at interpreter shutdown)."""
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001
        pass


def _reset_for_tests() -> None:
    _state.clear()
