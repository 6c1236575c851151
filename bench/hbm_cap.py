"""Run a module as on a GPU with less memory (benchmarks only): ``python -m bench.hbm_cap MODULE ARGS...`` with
``PEAKFLAT_BENCH_HBM_GIB`` set, e.g. under torchrun: ``-m bench.hbm_cap megatron_peakflat.pretrain <flags>``.

It holds PyTorch's caching allocator to that many GiB of each device it uses
(``torch.cuda.set_per_process_memory_fraction``, set when the process picks its device or first asks for the
device's memory) and reports that total from ``torch.cuda.mem_get_info``, so the planner, ``--peakflat auto`` and the
allocator all see the smaller card. The CUDA context and NCCL's own buffers lie outside the allocator and are not
capped. A row measured this way names the real card and the cap (``extra.hbm_cap_gib``) and is never put in a ratio
with a row of a card that really has that memory.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch


def install(cap_gib: float) -> None:
    """Cap every CUDA device this process uses at ``cap_gib`` GiB (idempotent per device)."""
    cap = int(cap_gib * 2**30)
    real_info, real_set_device = torch.cuda.mem_get_info, torch.cuda.set_device
    capped: set[int] = set()

    def _index(device: object) -> int:
        if device is None:
            return torch.cuda.current_device()
        if isinstance(device, int):
            return device
        return torch.device(device).index or 0

    def mem_get_info(device: object = None) -> tuple[int, int]:
        index = _index(device)
        free, total = real_info(index)
        if index not in capped and total > cap:
            torch.cuda.set_per_process_memory_fraction(cap / total, index)
            capped.add(index)
        used = total - free
        return max(0, min(free, cap - used)), min(total, cap)

    def set_device(device: object) -> None:
        real_set_device(device)
        mem_get_info(_index(device))

    torch.cuda.mem_get_info = mem_get_info
    torch.cuda.set_device = set_device


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m bench.hbm_cap MODULE [ARGS...] (with PEAKFLAT_BENCH_HBM_GIB set)")
    cap = os.environ.get("PEAKFLAT_BENCH_HBM_GIB")
    if not cap:
        raise SystemExit("bench.hbm_cap: set PEAKFLAT_BENCH_HBM_GIB to the GiB per device to emulate")
    install(float(cap))
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
