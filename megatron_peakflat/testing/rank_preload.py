"""Imported once by the rank launcher's fork server, so that each CPU rank starts with these modules loaded.

A spawned rank imported torch and Megatron (``megatron.training`` alone takes about 9 s on a 2-core machine)
before its test could begin; a rank forked from a server that imported them starts in well under a second.
Nothing here initialises CUDA, a process group, OpenMP's thread pool or Megatron's global state: a forked
child must find them untouched, as a spawned one would. Test use only.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from megatron_peakflat._ext import quiet_cpp_extension  # noqa: E402

quiet_cpp_extension()  # before Megatron's import of it, which would note 'No CUDA runtime is found' in every rank
try:
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.training  # noqa: F401
except ImportError:  # a machine without Megatron: the ranks import what they need themselves
    pass

import gc  # noqa: E402

# What the imports made lives as long as a rank: a full collection in a rank (the live-bytes meter's, Python's own)
# walked those ~450k objects each time, 0.24 s a collection on a 2-core machine; frozen, it walks what the rank made.
gc.freeze()
