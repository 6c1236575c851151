"""Build and install megatron-peakflat.

The extension ``megatron_peakflat._C`` is built from csrc/: the C++ sources always, the CUDA
sources too when torch has CUDA and nvcc is found (``PEAKFLAT_CUDA=0/1`` forces the choice).
``PEAKFLAT_BUILD_EXT=0`` skips the extension; the package then runs on its Python fallbacks and
says so when a feature would have used the extension. Install with
``pip install --no-build-isolation .`` so the extension builds against the torch you run.
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import find_packages, setup


def _extensions() -> tuple[list, dict]:
    if os.environ.get("PEAKFLAT_BUILD_EXT", "1") == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("megatron-peakflat: torch not importable at build time; building without megatron_peakflat._C")
        return [], {}
    cpp = sorted(glob.glob("csrc/*.cpp"))
    cu = sorted(glob.glob("csrc/*.cu"))
    if not cpp:
        return [], {}
    want_cuda = os.environ.get("PEAKFLAT_CUDA")
    has_nvcc = CUDA_HOME is not None and (shutil.which("nvcc") or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))
    use_cuda = bool(cu) and torch.version.cuda is not None and bool(has_nvcc)
    if want_cuda is not None:
        use_cuda = want_cuda == "1" and bool(cu)
    cxx = ["-O3", "-fopenmp"]  # the C++ standard is the one torch's headers ask for
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        ext = CUDAExtension(
            "megatron_peakflat._C",
            cpp + cu,
            include_dirs=[os.path.abspath("csrc")],
            define_macros=[("PEAKFLAT_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension("megatron_peakflat._C", cpp, include_dirs=[os.path.abspath("csrc")],
                           extra_compile_args=cxx, extra_link_args=["-fopenmp"])
    print(f"megatron-peakflat: building megatron_peakflat._C ({'C++ and CUDA' if use_cuda else 'C++ only'})")
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=bool(shutil.which("ninja")))}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron-peakflat",
    version="0.1.0",
    description="Bounded-memory schedules for long-context MoE training on Megatron-Core",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_peakflat", "megatron_peakflat.*"]),
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.17,<0.20",
        "numpy",
        "packaging",
        "triton; platform_system == 'Linux'",
    ],
    extras_require={
        "test": ["pytest", "pybind11", "ninja", "psutil"],
        "plot": ["matplotlib"],
        "te": ["transformer-engine[pytorch]"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["peakflat-plan=megatron_peakflat.plan:main"]},
)
