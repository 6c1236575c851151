"""``python -m megatron_peakflat.testing.pretrain_dryrun <flags>``: the pretrain entry on CPU, one gloo rank.

A dry run of ``megatron_peakflat.pretrain`` for tests and for checking a command line without a
GPU (on a machine with GPUs, they are hidden from it): the CPU shim is installed, ``initialize_megatron``'s
CUDA assertion is satisfied for its duration only, torch.compile is off, and the data loader runs
in-process. Test use only.

``PEAKFLAT_DRYRUN_FUSED_ADAM=1`` makes Megatron's DistributedOptimizer save and load its checkpoints as it
does where Transformer Engine or apex provides FusedAdam (``distrib_optimizer.HAVE_APEX_OR_TE``): Adam's
step then travels only in the param groups. Those installs need a GPU; the CPU tests reach the branch so.
The ``PEAKFLAT_TEST_*`` hooks of ``testing.pretrain_hooks`` (a per-iteration trace, a SIGKILL inside an
iteration's forward, a faked ``MemAvailable``) are installed here too.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    # A CPU run on a machine with GPUs too: the shim maps Megatron's CUDA calls to the CPU, and a visible GPU
    # would let the code it does not cover (the optimizer's streams, the allocator's statistics) reach CUDA
    # with CPU tensors ("invalid argument to memory_allocated" under --optimizer-cpu-offload).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from .distributed import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    import torch

    if "torch._dynamo" in sys.modules and os.environ["TORCHDYNAMO_DISABLE"] == "1":
        # a rank forked with torch and Megatron imported (testing.forked_module): Megatron's fusions were wrapped
        # by torch.compile before the variable was set, and this turns the wrappers off as it would have
        torch._dynamo.config.disable = True
    from .megatron_cpu import install_cpu_shim

    install_cpu_shim()
    from megatron.training import initialize, training

    real_init = training.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True  # type: ignore[assignment]
        try:
            return real_init(*args, **kwargs)
        finally:
            torch.cuda.is_available = real  # type: ignore[assignment]

    training.initialize_megatron = initialize_megatron
    initialize.initialize_megatron = initialize_megatron
    # Megatron warms its fused kernels up on random "cuda" tensors of [seq / CP, micro-batch, hidden] after seeding
    # and before building the model: on a GPU they draw from the GPU's generator, here from the CPU one that
    # --use-cpu-initialization then initialises the weights from, so the weights would follow --seq-length and
    # --context-parallel-size. The CPU generator's state is kept across the warm-up, as a GPU leaves it.
    real_fusion = training.set_jit_fusion_options

    def set_jit_fusion_options(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return real_fusion(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    training.set_jit_fusion_options = set_jit_fusion_options
    if os.environ.get("PEAKFLAT_DRYRUN_FUSED_ADAM") == "1":
        from megatron.core.optimizer import distrib_optimizer

        distrib_optimizer.HAVE_APEX_OR_TE = True
    from megatron_peakflat.cli import pretrain

    from .pretrain_hooks import install

    install()  # the trace, fault and host-memory hooks that PEAKFLAT_TEST_* ask for (none by default)

    pretrain.main(with_cpu_flags(argv))


CPU_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--distributed-backend", "gloo"), ("--num-workers", "0"), ("--use-cpu-initialization",),
    ("--no-masked-softmax-fusion",), ("--no-bias-dropout-fusion",), ("--no-bias-swiglu-fusion",))
"""What a dry run adds to the command line where it lacks them: gloo, in-process loading, CPU initialisation, and
Megatron's fusions off (torch.compile is)."""


def with_cpu_flags(argv: list[str]) -> list[str]:
    """``argv`` as the dry run trains it (``CPU_FLAGS`` added), so that a plan of a dry run plans what runs."""
    return [*argv, *[a for flag in CPU_FLAGS if flag[0] not in argv for a in flag]]


if __name__ == "__main__":
    main(sys.argv[1:])
