"""Run Megatron-Core 0.19 on CPU with gloo, for tests and dry runs only.

Megatron assumes CUDA in a few hundred places. ``install_cpu_shim()`` redirects exactly what a
small GPT/MoE model needs to train on CPU:

- ``torch.cuda.current_device()`` returns the CPU device; ``device='cuda'``, ``.cuda()`` and
  ``.to('cuda')`` land on the CPU through a TorchFunctionMode, and ``.type()`` reports
  ``torch.cuda.*Tensor`` so the optimizer's and DDP's type checks accept CPU tensors;
- CUDA streams and events become no-op stand-ins, and the device's properties a Hopper-class stand-in;
- the CUDA RNG state that Megatron's tracker forks is the CPU generator's state;
- ``maybe_move_tensor_to_cpu(as_numpy=True)`` returns numpy for CPU tensors (EP>1 split sizes);
- ``WrappedTorchNorm`` accepts sequence parallelism, its parameters tagged ``sequence_parallel``;
- on a machine with GPUs the process sees none (``CUDA_VISIBLE_DEVICES=""``, ``is_available()`` False), as
  on a CPU machine: code the shim does not cover (torch.compile's device checks, the allocator's
  statistics) would otherwise reach CUDA with the CPU device. Hiding works only before the process first
  asks CUDA for its devices, so ``run_distributed`` and the dry run start their CPU processes hidden.

This module must never be imported on the training path: it changes process-wide torch state.
Everything else here (``build_tiny_gpt`` etc.) is a convenience for tests.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "install_cpu_shim",
    "init_megatron_parallel",
    "destroy_megatron_parallel",
    "megatron_on_cpu",
    "recompute_config",
    "tiny_transformer_config",
    "build_tiny_gpt",
    "gpt_batch",
    "gpt_loss",
]

_INSTALLED = False
_CPU = torch.device("cpu")


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpu(TorchFunctionMode):
    """Maps every request for a CUDA device to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):  # pinning asks the CUDA driver (Megatron's RoPE under CP pins its indices)
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            rest = list(args[1:])
            if rest and _is_cuda(rest[0]):
                rest[0] = _CPU
            args = (args[0], *rest)
        if name == "type" and args and isinstance(args[0], torch.Tensor) and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if name == "pin_memory":
            return args[0]
        return func(*args, **kwargs)


class _DummyStream:
    def __init__(self, *a: Any, **k: Any) -> None:
        self.device = _CPU

    def wait_stream(self, *a: Any) -> None: ...
    def wait_event(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else torch.cpu.Event()

    def __enter__(self) -> "_DummyStream":
        return self

    def __exit__(self, *a: Any) -> None: ...


class _DummyEvent:
    def __init__(self, *a: Any, **k: Any) -> None: ...
    def record(self, *a: Any) -> None: ...
    def wait(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _CpuDeviceProperties:
    name = "CPU (Megatron-on-CPU shim)"
    major, minor = 9, 0
    total_memory = 0
    multi_processor_count = 1


def install_cpu_shim() -> None:
    """Redirect Megatron's CUDA assumptions to the CPU in this process. Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_initialized():
        raise RuntimeError("install_cpu_shim: this process has already initialised CUDA, and the shim maps CUDA to the "
                           "CPU; start it with CUDA_VISIBLE_DEVICES='' (run_distributed does for gloo ranks)")
    _INSTALLED = True
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cuda = torch.cuda
    cuda.is_available = lambda: False  # type: ignore[assignment]
    cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    cuda.Stream = _DummyStream  # type: ignore[assignment,misc]
    cuda.Event = _DummyEvent  # type: ignore[assignment,misc]
    cuda.current_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
    cuda.default_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
    cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
    cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    cuda.memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.max_memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    # Megatron's argument checks ask the device's architecture at TP or CP > 1 (get_device_arch_version): a
    # Hopper-class stand-in, so that they take the path of the GPUs this package is measured on
    cuda.get_device_properties = lambda *a, **k: _CpuDeviceProperties()  # type: ignore[assignment]
    cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
    cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
    torch._C._set_print_stack_traces_on_fatal_signal(False) if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal") else None

    mode = _CudaToCpu()
    mode.__enter__()  # stays active for the life of the process

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)

    from megatron.core.transformer.moe import moe_utils, token_dispatcher  # noqa: F401 - loaded for _rebind

    original_move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _rebind(original_move, maybe_move_tensor_to_cpu)

    from megatron.core.transformer import torch_norm

    class _SPTorchNorm:
        """WrappedTorchNorm that also accepts sequence parallelism (params tagged for the SP all-reduce)."""

        def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
            norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
            norm = norm_cls(normalized_shape=hidden_size, eps=eps)
            for p in norm.parameters():
                setattr(p, "sequence_parallel", bool(config.sequence_parallel))
            return norm

    from megatron.core.models import backends  # noqa: F401 - loaded, so that _rebind reaches its LNImpl

    _rebind(torch_norm.WrappedTorchNorm, _SPTorchNorm)


def _rebind(original: Any, replacement: Any) -> None:
    """Point every loaded Megatron module's name for ``original`` at ``replacement``.

    Modules bind what they import by name, and some resolve a choice at import (``gpt_layer_specs.LNImpl`` is
    ``WrappedTorchNorm`` without Apex/TE): patching the defining module alone misses whatever was imported
    before the shim, as in a rank forked from a process that had imported Megatron already.
    """
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "megatron" or name.startswith("megatron.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


def init_megatron_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, seed: int = 1234,
                           cpu: bool = True, **kwargs: Any) -> None:
    """``initialize_model_parallel`` on the already-initialised default group, plus Megatron's RNG.

    With ``cpu=True`` (tests) the CPU shim is installed first; ``cpu=False`` leaves CUDA alone.
    """
    if cpu:
        install_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **kwargs,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def destroy_megatron_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def megatron_on_cpu(rank: int, global_batch: int = 1, micro_batch: int = 1, **parallel: Any) -> Iterator[None]:
    """Inside a ``run_distributed`` rank: the CPU shim, Megatron's parallel state
    (``init_megatron_parallel(**parallel)``) and a constant micro-batch calculator (``global_batch`` sequences in
    micro-batches of ``micro_batch``, DP 1), both torn down on exit, so that the next case of the same process
    starts clean."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    install_cpu_shim()
    init_megatron_parallel(**parallel)
    init_num_microbatches_calculator(rank, None, global_batch, micro_batch, 1)
    try:
        yield
    finally:
        destroy_num_microbatches_calculator()
        destroy_megatron_parallel()


def recompute_config(regime: str, method: str = "uniform", num_layers: int = 1) -> dict[str, Any]:
    """TransformerConfig fields of a recompute regime: ``"full"`` (Megatron's full recompute, ``method`` over
    ``num_layers`` layers per checkpoint), or a module name, recomputed selectively (``--recompute-modules``)."""
    if regime == "full":
        return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=num_layers)
    return dict(recompute_granularity="selective", recompute_modules=[regime])


def tiny_transformer_config(**overrides: Any) -> Any:
    """A small fp32 MoE TransformerConfig for the local spec; any field can be overridden."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    base: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=96,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bf16=False,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        sequence_parallel=tp > 1,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        moe_permute_fusion=False,
    )
    base.update(overrides)
    if not base.get("num_moe_experts"):
        base.pop("moe_router_topk", None)
        base.pop("moe_ffn_hidden_size", None)
        base["num_moe_experts"] = None
        base.pop("moe_aux_loss_coeff", None)
        base.pop("moe_router_load_balancing_type", None)
    return TransformerConfig(**base)


def gpt_layer_spec(num_experts: int | None, experts: str = "sequential") -> Any:
    """Megatron's local GPT layer spec (what runs without Transformer Engine).

    ``experts="grouped"`` swaps the MoE layers' SequentialMLP for Megatron's TEGroupedMLP built on
    ``TorchGroupedLinear`` (TE's GroupedLinear parameter layout, in plain torch)."""
    from functools import partial

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if experts == "grouped":
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

        from .grouped_linear import TorchGroupedLinear

        spec.submodules.mlp.keywords["submodules"].experts = partial(
            TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedLinear))
    elif experts != "sequential":
        raise ValueError(f"experts={experts!r}: 'sequential' or 'grouped'")
    return spec


def build_tiny_gpt(config: Any, vocab_size: int = 128, seq_len: int = 16, moe: bool = True,
                   share_embeddings: bool = False, experts: str = "sequential", **kwargs: Any) -> Any:
    """A GPTModel on Megatron's local spec (``gpt_layer_spec``; ``experts`` as there). A list
    ``config.moe_layer_freq`` makes the layers it marks 0 dense (Megatron's decoder block spec, sequential experts).
    With ``config.mtp_num_layers`` its MTP layers are built from the last layer's spec."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if moe and isinstance(getattr(config, "moe_layer_freq", 1), list):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        if experts != "sequential":
            raise ValueError(f"experts={experts!r} with a per-layer moe_layer_freq: only 'sequential'")
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = gpt_layer_spec(config.num_moe_experts if moe else None, experts)
    if getattr(config, "mtp_num_layers", None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        kwargs.setdefault("mtp_block_spec", get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type="rope",
        **kwargs,
    )
    return model


def skew_router(model: Any, skew: str, seed: int) -> None:
    """Add a fixed offset to the router logits of every ``TopKRouter`` in ``model`` so that a share of the
    tokens prefers expert 1: ``"balanced"`` none, ``"hot95"`` 95%, ``"all"`` every token. The same ``seed``
    picks the same tokens, so a reference model and a patched one see the same routing."""
    share = {"balanced": 0.0, "hot95": 0.95, "all": 1.0}[skew]
    if share == 0.0:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    for i, m in enumerate(mod for mod in model.modules() if isinstance(mod, TopKRouter)):
        gating = m.gating

        def skewed(x: torch.Tensor, gating: Any = gating, layer: int = i) -> torch.Tensor:
            logits = gating(x)
            T = logits.reshape(-1, logits.shape[-1]).shape[0]
            g = torch.Generator().manual_seed(seed + layer)
            hot = (torch.rand(T, generator=g) < share).to(logits.dtype).view(*logits.shape[:-1], 1)
            bump = torch.zeros(logits.shape[-1], dtype=logits.dtype)
            bump[1] = 8.0
            return logits + hot * bump

        m.gating = skewed


def mtp_metrics() -> dict[str, torch.Tensor]:
    """Megatron's MTP metrics since the last call (each MTP layer's loss; in 0.19 its acceptance counts too),
    then cleared: the tracker is sized by a model's MTP depth, and the next model may differ."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    out = {k: v.detach().clone() for k, v in MTPLossLoggingHelper.tracker.items() if isinstance(v, torch.Tensor)}
    MTPLossLoggingHelper.tracker.clear()
    return out


def gpt_batch(seq_len: int, micro_batch: int, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens and next-token labels, with an explicit causal bool mask (True = masked out)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=g)
    loss_mask = torch.ones(micro_batch, seq_len)
    loss_mask[:, -2:] = 0.0
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq_len).unsqueeze(0).expand(micro_batch, -1).contiguous(),
        "attention_mask": mask.view(1, 1, seq_len, seq_len).expand(micro_batch, 1, -1, -1).contiguous(),
    }


def gpt_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Masked mean of the per-token loss, as Megatron's loss function averages it."""
    mask = batch["loss_mask"]
    losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=mask)
    return (losses.float() * mask).sum() / mask.sum()


def ddp_main_grads(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One training step's gradients of a Megatron ``DistributedDataParallel`` model on ``batch``: its grad buffer
    zeroed, forward and backward in train mode, the grad sync finished; each parameter's ``main_grad``, cloned, by
    name (what the optimizer would read)."""
    model.zero_grad_buffer()
    model.train()
    gpt_loss(model, batch).backward()
    model.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
