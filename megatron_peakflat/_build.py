"""Build rules of the native extension shared by ``setup.py`` and the JIT build in ``_ext.py``.

Standard library only: ``setup.py`` loads this file by its path, before the package (or its
dependencies) can be imported.
"""

from __future__ import annotations

import os

__all__ = ["cuda_toolkit", "cxx_runtime", "cxx_runtime_link_args"]


def cuda_toolkit(torch_cuda_home: str | None) -> str | None:
    """The CUDA toolkit to build against: torch's CUDA_HOME when it holds nvcc and the runtime headers,
    else /usr/local/cuda when that does (an nvcc on the PATH may be a wrapper script outside the toolkit,
    e.g. /usr/local/bin/nvcc, from which torch guesses CUDA_HOME=/usr/local); None when neither does."""
    for home in (torch_cuda_home, "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")) \
                and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    return None


def cxx_runtime(maps: str = "/proc/self/maps") -> str | None:
    """The shared C++ runtime (``libstdc++.so.6``) mapped into this process, which torch loaded; None where
    there is none (another platform, or torch not imported yet)."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith("libstdc++.so") and os.path.exists(path):
                    return path
    except OSError:
        return None
    return None


def cxx_runtime_link_args() -> list[str]:
    """Linker inputs that make the extension use torch's shared C++ runtime: that library's path, or nothing.

    Why: a compiler whose own library folder holds only the static ``libstdc++.a`` links a second copy of
    the C++ runtime into the extension (the H200 image's ``CXX=/opt/gcc/bin/g++`` does: the module then
    defines ``__cxa_throw`` itself and needs no ``libstdc++.so.6``). Every exception it threw, a failed
    ``TORCH_CHECK`` included, then ended the process with a segmentation fault instead of raising. Named
    before the driver's own ``-lstdc++``, the shared library resolves those symbols first, so the archive
    adds nothing. Call after ``import torch``.
    """
    path = cxx_runtime()
    return [path] if path else []
