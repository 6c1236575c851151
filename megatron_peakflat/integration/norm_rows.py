"""The whole-sequence norms in row slices (``--peakflat-tile``): Transformer Engine's norm kernels address
[rows, hidden] in 32-bit int (``planner.te_limits``), and the pre-MLP norm, the final norm and MTP's norms run over
the whole sequence on the rank, outside the tiled attention sublayer. Where rows x hidden passes the kernel's
limit (``te_limits.norm_slice_rows``, the rule start-up checks), the norm runs through ``tile.rows.row_sliced``:
the same values and gradients, each slice within the limit, forward and backward.

The hook: the layer's ``_forward_pre_mlp_layernorm``, the block's ``forward`` and the MTP layer's ``forward`` give their norm
modules (any module: TE's, or the local spec's) a sliced ``forward`` before calling Megatron's own, which then
calls the norm as always (``recompute_pre_mlp_layernorm``'s checkpoint and fine-grained offloading included).
That ``forward`` reads the live config at each call: with the tile off it is the module's own.

Only Transformer Engine's norms have the limit; ``forced_max_rows`` (tests) imposes one on any norm.

The planner adds nothing for it: a slice's temporaries (TE's output of one slice before it is written, its fp32
rsigma/mu of a slice's rows) are at most the output itself, which the unsliced norm also holds, and the output is
allocated once.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from .. import stats
from ..planner import te_limits
from ..tile.rows import row_sliced, slice_length
from . import state
from .logs import info_once

__all__ = ["wrap_forward_pre_mlp_layernorm", "wrap_block_forward", "wrap_mtp_forward", "slice_norm", "max_rows", "forced_max_rows"]

_forced: list[int] = []
_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@contextlib.contextmanager
def forced_max_rows(rows: int) -> Iterator[None]:
    """Within the block, every sliced norm (any module) takes at most ``rows`` rows at once: for the tests."""
    _forced.append(rows)
    try:
        yield
    finally:
        _forced.pop()


def _aligned(norm: Any, x: torch.Tensor) -> bool:
    """TE's ``is_ptr_aligned``: the input and the norm's parameters start on 16 bytes (its outputs do: fresh)."""
    return all(t.data_ptr() % 16 == 0 for t in (x, *norm.parameters()))


def max_rows(norm: Any, x: torch.Tensor) -> int | None:
    """The most rows ``norm`` may take at once for input ``x`` ([..., hidden]), or None where it takes them all:
    ``te_limits.norm_slice_rows`` for Transformer Engine's RMSNorm and LayerNorm, no limit for other norms."""
    rows = x.numel() // max(1, x.shape[-1])
    if _forced:
        return _forced[-1] if rows > _forced[-1] else None
    if not type(norm).__module__.startswith("transformer_engine"):
        return None
    normalization = "RMSNorm" if "RMSNorm" in type(norm).__name__ else "LayerNorm"
    precision = _PRECISION.get(x.dtype, "bf16")
    return te_limits.norm_slice_rows(rows, int(x.shape[-1]), normalization, precision, _aligned(norm, x))


def slice_norm(norm: Any, name: str) -> None:
    """Give ``norm`` (a module, or None) a ``forward`` that runs it in row slices where the tile is on and its input
    passes ``max_rows``; idempotent."""
    if norm is None or not isinstance(norm, torch.nn.Module) or "forward" in vars(norm):
        return
    own: Callable[..., Any] = norm.forward

    @functools.wraps(own)
    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = state.get()
        if cfg is None or not cfg.tile.enabled or args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return own(x, *args, **kwargs)
        most = max_rows(norm, x)
        if most is None:
            return own(x)
        per_position = x[0].numel() // x.shape[-1]
        info_once(f"peakflat tile: the {name} ({type(norm).__name__}) runs in row slices: "
                  f"{x.numel() // x.shape[-1]:,} rows x hidden {x.shape[-1]} past its kernel's limit, slices of "
                  f"{slice_length(per_position, most) * per_position:,} rows")
        stats.add("tile", "sliced_norm_calls", 1)
        return row_sliced(own, x, most)

    norm.forward = forward


def _slicing_first(norms: tuple[tuple[str, str], ...], what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A registry wrapper of a Megatron method that first gives the module's norms ``norms`` (attribute, log name)
    their sliced forward where needed, then calls the method."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            for attr, name in norms:
                slice_norm(getattr(self, attr, None), name)
            return original(self, *args, **kwargs)

        return method

    wrap.__doc__ = f"Replacement for ``{what}``: {', '.join(n for _, n in norms)} sliced where needed."
    return wrap


wrap_forward_pre_mlp_layernorm = _slicing_first((("pre_mlp_layernorm", "pre-MLP norm"),),
                                                "TransformerLayer._forward_pre_mlp_layernorm")
"""(Both the dense and the MoE layer's ``_forward_mlp`` call ``_forward_pre_mlp_layernorm``.)"""
wrap_block_forward = _slicing_first((("final_layernorm", "final norm"),), "TransformerBlock.forward")
wrap_mtp_forward = _slicing_first((("enorm", "MTP embedding norm"), ("hnorm", "MTP hidden norm"),
                                   ("final_layernorm", "MTP final norm")), "MultiTokenPredictionLayer.forward")
