"""The native extension ``megatron_peakflat._C`` (csrc/): the build logic only; the package's metadata is in
pyproject.toml.

Every install ships csrc/ inside the package (``megatron_peakflat/_csrc``), so that the extension can be compiled
on first use, against the torch the job runs with, into a cache (``megatron_peakflat._ext``). Where torch is
importable at build time (``pip install --no-build-isolation .``, ``make setup``), the extension is also built now:
the C++ sources always; with CUDA (``PEAKFLAT_WITH_CUDA``: CUDA runtime calls such as the bucket stream engine, and
csrc/*.cu if any) when torch has CUDA, a CUDA toolkit (nvcc and its headers) is found and a GPU is visible, the
rule of the JIT build too. ``PEAKFLAT_CUDA=0/1`` forces the choice (1: e.g. a build node without a GPU).
``PEAKFLAT_BUILD_EXT=0`` builds nothing, now or on first use; the package then runs on its Python fallbacks.
Under pip's build isolation (``pip install .``) torch is not importable here, and the first use builds it.
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


def _build_rules():
    """megatron_peakflat/_build.py, loaded by its path: the package's imports are not available yet."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_peakflat", "_build.py")
    spec = importlib.util.spec_from_file_location("_peakflat_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions() -> tuple[list, dict]:
    if os.environ.get("PEAKFLAT_BUILD_EXT", "1") == "0":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("megatron-peakflat: torch is not importable in this build environment (pip's build isolation): "
              "megatron_peakflat._C will be compiled on first use, against the torch the job runs with "
              "(install with --no-build-isolation to compile it now)")
        return [], {}
    rules = _build_rules()
    cpp = sorted(glob.glob("csrc/*.cpp"))
    cu = sorted(glob.glob("csrc/*.cu"))
    if not cpp:
        return [], {}
    want_cuda = os.environ.get("PEAKFLAT_CUDA")
    toolkit = rules.cuda_toolkit(cpp_extension.CUDA_HOME) if torch.version.cuda is not None else None
    if want_cuda is None:
        use_cuda = toolkit is not None and torch.cuda.is_available()
    else:
        use_cuda = want_cuda == "1"
        if use_cuda and toolkit is None:
            raise RuntimeError(
                f"megatron-peakflat: PEAKFLAT_CUDA=1, but no CUDA build is possible (torch CUDA {torch.version.cuda}, "
                f"CUDA_HOME={cpp_extension.CUDA_HOME}, and no nvcc plus include/cuda_runtime_api.h there or under "
                f"/usr/local/cuda). Set CUDA_HOME to the CUDA toolkit, or PEAKFLAT_CUDA=0 for the C++-only extension.")
    cxx = ["-O3", "-fopenmp"]  # the C++ standard is the one torch's headers ask for
    runtime = rules.cxx_runtime_link_args()
    link = ["-fopenmp", *runtime]
    if use_cuda:
        if toolkit != cpp_extension.CUDA_HOME:
            # CUDAExtension and BuildExtension read the module's CUDA_HOME when they run
            cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = toolkit
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        ext = CUDAExtension(
            "megatron_peakflat._C",
            cpp + cu,
            include_dirs=[os.path.abspath("csrc")],
            define_macros=[("PEAKFLAT_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=link,
        )
    else:
        ext = CppExtension("megatron_peakflat._C", cpp, include_dirs=[os.path.abspath("csrc")],
                           extra_compile_args=cxx, extra_link_args=link)
    shown = runtime[0] if runtime else "the compiler's default"
    print(f"megatron-peakflat: building megatron_peakflat._C ({f'C++ and CUDA, toolkit {toolkit}' if use_cuda else 'C++ only'}; "
          f"C++ runtime {shown})")
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=bool(shutil.which("ninja")))}


class _BuildPyWithSources(build_py):
    """build_py that also copies csrc/ into the package as ``megatron_peakflat/_csrc``: the sources of the JIT
    build in an installed wheel (an editable install reads csrc/ where it is)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = os.path.join(self.build_lib, "megatron_peakflat", "_csrc")
        os.makedirs(target, exist_ok=True)
        for path in _sources(("*.cpp", "*.h", "*.cu", "*.cuh")):
            self.copy_file(path, os.path.join(target, os.path.basename(path)))


def _sources(patterns: tuple[str, ...]) -> list[str]:
    root = os.path.dirname(os.path.abspath(__file__))
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(root, "csrc", pattern)))


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = _BuildPyWithSources

setup(ext_modules=ext_modules, cmdclass=cmdclass)
