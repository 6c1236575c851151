"""Lazy loader of the compiled extension ``megatron_peakflat._C`` (csrc/).

``load()`` imports the module built at install time (``pip install --no-build-isolation .``, ``make setup``).
Where there is none (``pip install .`` builds in an isolated environment without torch), it compiles the
sources that every install carries (``megatron_peakflat/_csrc``, or csrc/ in a source checkout) with
``torch.utils.cpp_extension``, once, into a cache keyed by the torch version, the CUDA version, the parts built
and a hash of the sources and flags (``build_dir()``); later processes load it from there without a compiler.
The CUDA parts are built when torch has CUDA, nvcc is found and a GPU is visible (``PEAKFLAT_CUDA=0/1`` forces
either way). ``PEAKFLAT_BUILD_EXT=0`` compiles nothing. Where it cannot be had, one warning says what falls back
to PyTorch and how to fix it. The result, module or None, is kept with its reason: one attempt per process.
Nothing here runs at package import: callers (the optimizer's constructor, SCO's native pool) call ``load()``.

Cache folder: ``$PEAKFLAT_EXT_CACHE``, else ``$XDG_CACHE_HOME/megatron_peakflat``, else
``~/.cache/megatron_peakflat``; one subfolder per key.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

from ._build import cuda_toolkit, cxx_runtime_link_args

__all__ = ["load", "require", "reason", "source", "ExtensionMissingError", "register_host_memory",
           "unregister_host_memory", "CARVE_ALIGN", "carve_end", "sources_dir", "cache_root", "build_dir",
           "needs_compile", "build_log", "FALLBACKS", "quiet_cpp_extension"]

log = logging.getLogger("megatron_peakflat")

_HERE = Path(__file__).resolve().parent
_MODULE = "megatron_peakflat_C"
_COMPLETE = "complete"
_CXX_FLAGS = ("-O3", "-ffp-contract=off")
_SOURCE_PATTERNS = ("*.cpp", "*.h", "*.cu", "*.cuh")
FALLBACKS = ("OffloadStreamAdamW's host Adam step and its bucket streams run their PyTorch versions (slower), and "
             "SCO's native host pool (--peakflat-sco-pool native) uses torch pinned tensors")
"""What runs instead of the extension: the only parts that use it."""
_BUILD_HINT = ("it is compiled on first use where a C++ compiler (g++) and ninja are found (pip install ninja); "
               "or build it at install time with `pip install --no-build-isolation .` next to the torch you run")

_state: dict[str, object] = {}


class ExtensionMissingError(RuntimeError):
    """A feature needs ``megatron_peakflat._C`` and it could not be loaded."""


def sources_dir() -> Path | None:
    """The extension's C++ sources: ``megatron_peakflat/_csrc`` in an installed wheel, csrc/ beside the package in
    a source checkout (an editable install); None when neither holds them."""
    for folder in (_HERE / "_csrc", _HERE.parent / "csrc"):
        if (folder / "bindings.cpp").is_file():
            return folder
    return None


def cache_root() -> Path:
    """Where JIT builds are kept: ``$PEAKFLAT_EXT_CACHE``, else the user's cache folder."""
    if os.environ.get("PEAKFLAT_EXT_CACHE"):
        return Path(os.environ["PEAKFLAT_EXT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_peakflat"


def quiet_cpp_extension() -> ModuleType:
    """``torch.utils.cpp_extension``, imported without the 'No CUDA runtime is found' note that its import logs on
    every machine without CUDA (where the build is C++ only, which the extension's own line says)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _cuda_parts() -> bool:
    """Whether this process's build includes the CUDA parts: torch has CUDA, a CUDA toolkit is found and a GPU is
    visible, unless ``PEAKFLAT_CUDA=0/1`` says. Points torch's CUDA_HOME at the toolkit it found."""
    import torch

    cpp_extension = quiet_cpp_extension()
    env = os.environ.get("PEAKFLAT_CUDA")
    want_cuda = env == "1" or (env is None and torch.cuda.is_available())
    with_cuda = want_cuda and torch.version.cuda is not None and shutil.which("nvcc") is not None
    toolkit = cuda_toolkit(cpp_extension.CUDA_HOME)
    if with_cuda and toolkit is not None and toolkit != cpp_extension.CUDA_HOME:
        cpp_extension.CUDA_HOME = toolkit  # read by cpp_extension.load when it runs
    if with_cuda and toolkit is None:
        # e.g. nvcc is a wrapper outside the toolkit: build C++ only; the optimizer then pins its host
        # region through torch.cuda.cudart() instead of the extension's own cudaHostRegister
        log.info("peakflat: no CUDA toolkit (nvcc and headers) under CUDA_HOME=%s or /usr/local/cuda; building "
                 "megatron_peakflat._C as C++ only", cpp_extension.CUDA_HOME)
        with_cuda = False
    return with_cuda


def _build_args(src: Path, with_cuda: bool) -> dict[str, object]:
    """``cpp_extension.load``'s arguments for the sources in ``src``."""
    sources = sorted(str(p) for p in src.glob("*.cpp"))
    defines = ["-DPEAKFLAT_WITH_CUDA"] if with_cuda else []
    if with_cuda:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # no device to ask: build for Hopper
        sources += sorted(str(p) for p in src.glob("*.cu"))
    return dict(name=_MODULE, sources=sources, extra_cflags=[*_CXX_FLAGS, *defines],
                extra_cuda_cflags=["-O3", *defines], extra_ldflags=cxx_runtime_link_args(), with_cuda=with_cuda)


def build_dir(src: Path, with_cuda: bool, args: dict[str, object] | None = None) -> Path:
    """The cache folder of this build: one per torch version, CUDA version, parts built (C++ only or with CUDA),
    Python version, and hash of the sources, flags and compiler, so that a change to any rebuilds."""
    import torch

    args = args if args is not None else _build_args(src, with_cuda)
    h = hashlib.sha256()
    for path in sorted(p for pattern in _SOURCE_PATTERNS for p in src.glob(pattern)):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr(sorted((k, v) for k, v in args.items() if k != "sources")).encode())
    h.update(os.environ.get("CXX", "c++").encode() + os.environ.get("TORCH_CUDA_ARCH_LIST", "").encode())
    key = (f"torch{torch.__version__}-cuda{torch.version.cuda or 'none'}-{'cpp+cuda' if with_cuda else 'cpp'}-"
           f"py{sys.version_info[0]}{sys.version_info[1]}-{h.hexdigest()[:16]}")
    return cache_root() / key


def _import_library(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_ninja() -> str | None:
    """ninja's path, putting the folder of the one pip installs (the ``ninja`` package, or this interpreter's bin
    folder of an unactivated venv) on PATH, where torch looks for it."""
    found = shutil.which("ninja")
    if found:
        return found
    folders = [str(Path(sys.executable).parent)]
    try:
        import ninja  # type: ignore[import-not-found]

        folders.insert(0, str(getattr(ninja, "BIN_DIR", "")))
    except ImportError:
        pass
    for folder in folders:
        if folder and shutil.which("ninja", path=folder):
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return shutil.which("ninja")
    return None


def needs_compile() -> bool:
    """Whether ``load()`` would compile: no extension from install time, the build on first use allowed, and no
    finished build for this torch, CUDA and source in the cache yet."""
    if "module" in _state or os.environ.get("PEAKFLAT_BUILD_EXT", "1") == "0":
        return False
    if importlib.util.find_spec("megatron_peakflat._C") is not None:
        return False
    src = sources_dir()
    if src is None:
        return False
    return not _built(build_dir(src, _cuda_parts()))


def _built(folder: Path) -> bool:
    """Whether ``folder`` holds a finished build (its library and the marker written after it)."""
    return (folder / _COMPLETE).is_file() and (folder / f"{_MODULE}.so").is_file()


class _CannotBuild(RuntimeError):
    """The JIT build cannot run here; the message says why and the fix."""


def _jit_build() -> tuple[ModuleType, str]:
    """The extension from the build cache, compiling it there first if needed; (module, how it was had)."""
    cpp_extension = quiet_cpp_extension()

    src = sources_dir()
    if src is None:
        raise _CannotBuild(f"this install holds no C++ sources (neither {_HERE / '_csrc'} nor {_HERE.parent / 'csrc'}); "
                           "reinstall megatron-peakflat from its source distribution or repository")
    with_cuda = _cuda_parts()
    args = _build_args(src, with_cuda)
    folder = build_dir(src, with_cuda, args)
    library = folder / f"{_MODULE}.so"
    parts = "C++ and CUDA" if with_cuda else "C++ only"
    if _built(folder):
        return _import_library(library), f"JIT-built ({parts}), loaded from the build cache {folder}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise _CannotBuild(f"no C++ compiler to compile it ({compiler!r} is not on PATH); install g++ (or set CXX)")
    if _find_ninja() is None:
        raise _CannotBuild("ninja, which torch.utils.cpp_extension compiles with, is not found; pip install ninja")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _CannotBuild(f"the build cache {folder} cannot be created ({e}); set PEAKFLAT_EXT_CACHE to a writable "
                           "folder") from e
    log.info("peakflat: compiling megatron_peakflat._C (%s) from %s into %s, once for this torch, CUDA and source "
             "(a minute or two)", parts, src, folder)
    start = time.perf_counter()
    module = cpp_extension.load(**args, build_directory=str(folder), verbose=False)
    (folder / _COMPLETE).write_text(f"{module.__file__}\n")
    return module, f"JIT-built ({parts}) from {src} into the build cache {folder} in {time.perf_counter() - start:.0f} s"


def load() -> ModuleType | None:
    """The extension module, or None: the module built at install time, else the JIT build from the cache
    (compiled there on first use). Tried once per process; the outcome is logged once (a warning naming what
    falls back and the fix when it is missing for a reason other than ``PEAKFLAT_BUILD_EXT=0``) and kept in
    ``reason()``."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    import torch  # noqa: F401  # loads libc10 and libtorch, which the extension links against

    module: ModuleType | None = None
    warn = False
    try:
        module = importlib.import_module("megatron_peakflat._C")
        why, how = "prebuilt megatron_peakflat._C (built at install time)", "prebuilt"
    except ImportError as e:
        why, how = f"megatron_peakflat._C is not built ({e})", "missing"
        if os.environ.get("PEAKFLAT_BUILD_EXT", "1") == "0":
            why += "; PEAKFLAT_BUILD_EXT=0: not compiled on first use either"
        else:
            try:
                module, why = _jit_build()
                how = "jit"
            except _CannotBuild as je:
                why, warn = f"megatron_peakflat._C cannot be compiled here: {je}", True
            except Exception as je:  # noqa: BLE001 - any build failure means "no extension", with the reason
                lines = [line for line in str(je).splitlines() if line.strip()]
                detail = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
                why, warn = f"compiling megatron_peakflat._C failed: {type(je).__name__}: {detail.strip()}", True
                _state["build_log"] = str(je)
    _state["module"], _state["reason"], _state["source"] = module, why, how
    if module is not None:
        log.info("peakflat: native extension megatron_peakflat._C: %s (CUDA parts: %s)", why,
                 "yes" if getattr(module, "with_cuda", False) else "no")
    elif warn:
        log.warning("peakflat: the native extension is unavailable: %s. Falling back: %s. To fix it: install a C++ "
                    "compiler and ninja where the job runs (the first use compiles the extension into %s), or build "
                    "it at install time with `pip install --no-build-isolation .`; "
                    "`python -m megatron_peakflat.check` shows the details. PEAKFLAT_BUILD_EXT=0 runs on the "
                    "fallbacks without this warning.", why, FALLBACKS, cache_root())
    else:
        log.info("peakflat: native extension unavailable, using the PyTorch fallbacks: %s", why)
    return module


def reason() -> str:
    """Why ``load()`` returned what it returned ('' before the first call)."""
    return str(_state.get("reason", ""))


def source() -> str:
    """How ``load()`` got the extension: 'prebuilt', 'jit' or 'missing' ('' before the first call)."""
    return str(_state.get("source", ""))


def build_log() -> str:
    """The failed JIT build's full error (the compiler's output), '' when none failed."""
    return str(_state.get("build_log", ""))


def require(feature: str) -> ModuleType:
    """The extension, or ExtensionMissingError naming ``feature`` and how to get it."""
    module = load()
    if module is None:
        raise ExtensionMissingError(f"{feature} needs the native extension megatron_peakflat._C: {reason()}. "
                                    f"To get it: {_BUILD_HINT}.")
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
