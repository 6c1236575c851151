"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for Megatron's local spec.

Without Transformer Engine, Megatron's local spec builds ``DotProductAttention``, which materialises
the [b, heads, s, s] scores and their softmax: at 128K tokens that alone is hundreds of GiB, so long
context is out of reach before any of the four peaks matters. ``SDPAttention`` keeps
DotProductAttention's constructor, parameters and checkpoint layout and replaces only its forward:

- causal with no explicit mask -> ``is_causal=True`` (flash / memory-efficient kernels, O(s) memory);
- ``AttnMaskType.causal_bottom_right`` with fewer queries than keys (the tiled attention sublayer: the queries
  are the last positions of the keys) -> torch's ``causal_lower_right`` bias, as the context-parallel path attends
  a chunk; with as many queries as keys it is plain causal;
- grouped K/V heads go to the kernel as they are (``enable_gqa``) where flash runs, and are repeated to the query
  heads where it does not (fp32, an explicit mask), so that torch never falls back to its [s, s] math backend;
- an explicit bool mask (True = masked out) -> the same additive -10000 fill that Megatron's
  ``attention_mask_func`` applies, so fully masked rows behave as in Megatron;
- configurations it does not cover (packed sequences, sliding windows, non-vanilla softmax) hand
  back to DotProductAttention's own forward, logged once;
- q, k or v that is a view into a larger buffer (Megatron splits its packed QKV projection output into views; with
  RoPE, v stays one) is copied first (``own_storage``), as Transformer Engine's layout detection does: saved for
  backward, the view would keep the whole buffer alive beside the rotated q and k.

With context parallelism (``--context-parallel-size`` > 1, which DotProductAttention refuses) each rank
holds chunks r and 2CP-1-r of the sequence (Megatron's load-balanced layout); K and V are all-gathered over
the CP group and dK, dV reduce-scattered (``attention.context_parallel``, the semantics of TE's ``all_gather``
communication type, whatever ``--cp-comm-type`` says). A configuration it does not cover cannot be handed
back there: start-up refuses it (``config._check_sdpa_attention``) and a direct call raises.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
from typing import Any, Callable, Optional

import torch

from ..attention.context_parallel import _attend as attend_aligned
from ..attention.context_parallel import context_parallel_attention
from ..config_base import PeakflatConfigError
from ..planner.dataloader_mask import MASK_FAIL_BYTES, MASK_WARN_BYTES, check_dataloader_mask  # noqa: F401 (re-exported)

log = logging.getLogger("megatron_peakflat")

__all__ = ["transformer_engine_available", "wrap_local_core_attention", "sdpa_core_attention_class",
           "check_dataloader_mask"]

_MASK_FILL = -10000.0


def additive_mask(attention_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Megatron's bool mask (True = masked out) as SDPA's additive one, filled as ``attention_mask_func`` fills it."""
    if attention_mask is None:
        return None
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill_(attention_mask.to(torch.bool), _MASK_FILL)


def transformer_engine_available() -> bool:
    """True when Transformer Engine can be imported (its own attention is then left in place)."""
    return importlib.util.find_spec("transformer_engine") is not None


_CLASS: Any = None


def sdpa_core_attention_class() -> type:
    """Build (once) the DotProductAttention subclass whose forward runs torch SDPA."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import is_layer_window_attention

    class SDPAttention(DotProductAttention):
        """DotProductAttention with a torch-SDPA forward; same parameters, same results; with context
        parallelism too."""

        _handed_back = False
        _comm_type_logged = False

        def __init__(self, config: Any, *args: Any, cp_comm_type: Optional[Any] = None, **kwargs: Any) -> None:
            cp = config.context_parallel_size
            if cp > 1:  # DotProductAttention asserts CP == 1; build it on a copy that says 1, keep the real one
                one = copy.copy(config)
                one.context_parallel_size = 1
                super().__init__(one, *args, cp_comm_type=cp_comm_type, **kwargs)
                self.config = config
            else:
                super().__init__(config, *args, cp_comm_type=cp_comm_type, **kwargs)
            self.cp_comm_type = cp_comm_type
            group = getattr(self.pg_collection, "cp", None)
            if group is None and cp > 1:
                from megatron.core import parallel_state

                group = parallel_state.get_context_parallel_group()
            self.cp_group = group if cp > 1 else None

        def _unsupported(self, packed_seq_params: Any, attention_bias: Any) -> str | None:
            if packed_seq_params is not None:
                return "packed sequences"
            if attention_bias is not None:
                return "attention bias"
            if self.config.softmax_type != "vanilla":
                return f"softmax_type={self.config.softmax_type}"
            if is_layer_window_attention(self.config.window_size, self.config.window_attn_skip_freq, self.layer_number):
                return "sliding-window attention"
            return None

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Optional[torch.Tensor],
            attn_mask_type: Optional[Any] = None,
            attention_bias: Optional[torch.Tensor] = None,
            packed_seq_params: Optional[Any] = None,
        ) -> torch.Tensor:
            reason = self._unsupported(packed_seq_params, attention_bias)
            if reason is not None and self.cp_group is not None:
                raise PeakflatConfigError("--peakflat-attention", "sdpa", f"with --context-parallel-size "
                                          f"{self.config.context_parallel_size} it does not cover {reason}, and "
                                          "Megatron's DotProductAttention runs no context parallelism",
                                          "use Transformer Engine's attention (--transformer-impl "
                                          "transformer_engine), or --context-parallel-size 1")
            if reason is not None:
                if not SDPAttention._handed_back:
                    SDPAttention._handed_back = True
                    log.warning("peakflat: sdpa attention hands %s back to Megatron's DotProductAttention", reason)
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            query, key, value = own_storage(query), own_storage(key), own_storage(value)
            if self.cp_group is not None:
                return self._context_parallel(query, key, value, attention_mask, mask_type)
            sq, b, np_, hn = query.shape
            if mask_type == AttnMaskType.causal_bottom_right:
                mask_type = AttnMaskType.causal  # attend_aligned aligns fewer queries than keys to the last key
            bias = additive_mask(attention_mask, query.dtype)
            p = self.attention_dropout.p if self.training else 0.0
            fork = p > 0.0 and not self.config.sequence_parallel
            with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
                out = attend_aligned(query, key, value, self._scale(), p, bias,
                                     causal=mask_type == AttnMaskType.causal)
            return out.reshape(sq, b, np_ * hn)

        def _scale(self) -> float:
            """The scale DotProductAttention's scores get in the end: its softmax_scale, times the layer number under
            query-key layer scaling (which divided the scale by it, and whose softmax multiplies it back)."""
            scale = self.softmax_scale
            if self.config.apply_query_key_layer_scaling:
                scale = scale * self.layer_number
            return scale

        def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], mask_type: Any) -> torch.Tensor:
            """This rank's chunks (r, 2CP-1-r) against the whole sequence's K/V, gathered over the CP group. An
            explicit mask is the rank's query rows over the whole sequence ([b, 1, s/CP, s], as Megatron's
            ``get_batch_on_this_cp_rank`` cuts it), applied with the same additive fill as the CP=1 path."""
            if not SDPAttention._comm_type_logged and self.cp_comm_type not in (None, "all_gather"):
                SDPAttention._comm_type_logged = True
                log.info("peakflat: sdpa attention gathers K and V over the context-parallel group (all_gather) "
                         "whatever --cp-comm-type says (%s); the results are the same", self.cp_comm_type)
            sq, b, np_, hn = query.shape
            bias = additive_mask(attention_mask, query.dtype)
            if bias is None and mask_type != AttnMaskType.causal:
                raise PeakflatConfigError("--peakflat-attention", "sdpa", f"with --context-parallel-size "
                                          f"{self.config.context_parallel_size} it runs causal attention or an "
                                          f"explicit mask, and got mask type {mask_type} without a mask",
                                          "use Transformer Engine's attention, or --context-parallel-size 1")
            p = self.attention_dropout.p if self.training else 0.0
            fork = p > 0.0 and not self.config.sequence_parallel
            with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
                out = context_parallel_attention(query, key, value, self.cp_group, scale=self._scale(), dropout_p=p,
                                                 attn_bias=bias)
            return out.reshape(sq, b, np_ * hn)

    _CLASS = SDPAttention
    return _CLASS


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it where it is a view into a larger storage. Attention saves its inputs for
    backward; a saved view of Megatron's packed QKV projection output keeps all of it alive (q, k and v: with RoPE
    the q and k parts are dead copies by then), where the copy costs only the view's own size."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def wrap_local_core_attention(original: Callable[[Any], type]) -> Callable[[Any], type]:
    """Replacement for ``LocalSpecProvider.core_attention``: returns SDPAttention."""

    def core_attention(self: Any) -> type:
        return sdpa_core_attention_class()

    return core_attention
