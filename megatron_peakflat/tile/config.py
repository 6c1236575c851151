"""Knobs of the tiled attention sublayer: ``--peakflat-tile`` and ``--peakflat-tile-tokens``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

from ..config_base import ComponentConfig, PeakflatConfigError, cuda_graph_flag, megatron_arg as _get


@dataclass(kw_only=True)
class TileConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "tile"
    MODE_FIELD: ClassVar[str] = "enabled"
    MODE_FLAG: ClassVar[str] = "tile"

    enabled: bool = False
    """Run each layer's self-attention sublayer (input norm, QKV, RoPE, attention, output projection, residual)
    over query tiles of the sequence: only K and V (and their gradients) stay whole, every other
    sequence-sized tensor lives for one tile. Costs one more attention forward per layer and step (three
    forwards and one backward under full recompute) and one more QKV projection. The router and the MLP run
    whole (MoE layers are chunked by --peakflat-dispatch)."""
    tokens: int | None = None
    """Tokens per query tile. 'auto' (provisional): the largest power of two not above a quarter of the
    sequence, from 4096 to 16384 tokens (a sequence of at most 4096 tokens is one tile)."""

    def validate(self) -> None:
        if self.tokens is not None and self.tokens < 1:
            raise PeakflatConfigError(self.flag("tokens"), self.tokens, "a tile holds at least one token",
                                      "pass a positive count such as --peakflat-tile-tokens 16384, or 'auto'")

    def tile_tokens(self, seq: int, cp: int = 1) -> int:
        """The tile the sublayer runs over ``seq`` tokens on this rank: the flag's value, or the automatic one (of
        ``seq``), and never more than the sequence (one tile); under context parallelism (``cp`` > 1) the rank's
        tokens are two chunks of the sequence and a tile never spans both, so never more than ``seq // 2``."""
        from .bound import auto_tile_tokens

        most = seq if cp == 1 else seq // 2
        return min(most, self.tokens if self.tokens is not None else auto_tile_tokens(seq))


    def check_against_megatron(self, args: Any) -> None:
        """Refuse, at start-up, what the tiled sublayer cannot run: sequence parallelism (the layer's input split
        over the tensor-parallel ranks), dropout (backward recomputes each tile and must draw the same numbers),
        Megatron's local DotProductAttention (it builds the causal mask square, not aligned to a tile's prefix),
        multi-latent attention (other projections), CUDA graphs, and under context parallelism a sequence that does
        not split into 2 x CP equal chunks. Context parallelism itself runs: tiles within each rank's two chunks, K
        and V gathered over the group (``context_parallel.py``)."""
        if not self.enabled:
            return
        flag, value = self.flag("enabled"), True
        cp, seq = _get(args, "context_parallel_size", 1) or 1, _get(args, "seq_length")
        if cp > 1 and seq and seq % (2 * cp):
            raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} each rank holds 2 of 2 x {cp} "
                                      f"= {2 * cp} equal chunks of the sequence, whose tiles it cuts, and "
                                      f"--seq-length {seq} does not split into them",
                                      f"pass a --seq-length that is a multiple of {2 * cp} (e.g. "
                                      f"{-(-seq // (2 * cp)) * 2 * cp}), or another --context-parallel-size")
        if _get(args, "sequence_parallel", False):
            raise PeakflatConfigError(flag, value, "--sequence-parallel splits the layer's input over the "
                                      "tensor-parallel ranks, and the tiles cut the whole sequence",
                                      f"drop --sequence-parallel, or drop {flag}")
        unmet = unmet_prerequisites(args, missing_as_default=False)
        if unmet:
            name, setting, why, fix = unmet[0]
            raise PeakflatConfigError(flag, value, f"{name} is {setting} {why}", f"pass {fix}, or drop {flag}")
        if _get(args, "multi_latent_attention", False):
            raise PeakflatConfigError(flag, value, "multi-latent attention projects queries, keys and values "
                                      "differently from the self-attention it tiles",
                                      f"drop --multi-latent-attention, or drop {flag}")
        graphs = cuda_graph_flag(args)
        if graphs:
            raise PeakflatConfigError(flag, value, f"{graphs} captures the layers, whose tiled sublayer recomputes "
                                      "in backward outside any graph", f"drop {graphs.split()[0]}, or drop {flag}")
        attention = _get(args, "peakflat_attention", "auto") or "auto"
        if _get(args, "transformer_impl") == "local" and not _local_spec_runs_sdpa(attention):
            raise PeakflatConfigError(flag, value, "Megatron's local DotProductAttention (--transformer-impl local "
                                      f"with --peakflat-attention {attention}) builds the causal mask for as many "
                                      "queries as keys, and a tile's queries are the last of its keys",
                                      "pass --peakflat-attention sdpa (torch SDPA aligns the mask to the tile), or "
                                      "use --transformer-impl transformer_engine")


PREREQUISITES: tuple[tuple[str, str, Any, str, str], ...] = (
    ("hidden_dropout", "--hidden-dropout", 0.1, "--hidden-dropout 0",
     "(Megatron's default is 0.1), and backward recomputes each tile, which would draw other dropout masks than the "
     "forward"),
    ("attention_dropout", "--attention-dropout", 0.1, "--attention-dropout 0",
     "(Megatron's default is 0.1), and backward recomputes each tile, which would draw other dropout masks than the "
     "forward"),
    ("create_attention_mask_in_dataloader", "--create-attention-mask-in-dataloader", True,
     "--no-create-attention-mask-in-dataloader",
     "(Megatron's default), so its dataloader builds an explicit attention mask, and a layer given a mask runs "
     "Megatron's own attention sublayer, untiled (a causal model needs no mask)"),
)
"""The Megatron settings the tiled sublayer needs off: (args dest, flag, Megatron's default, the flag that turns it
off, why). The one table behind the start-up check and the planner's fixes that name the tile."""


def unmet_prerequisites(args: Any, *, missing_as_default: bool = True) -> list[tuple[str, Any, str, str]]:
    """(flag, its value, why, the fix) for each of ``PREREQUISITES`` that ``args`` leaves on, in the table's order.
    A setting absent from ``args`` is Megatron's default where ``missing_as_default`` (a planner's partial line),
    else off (a namespace that never had it)."""
    out = []
    for dest, name, default, fix, why in PREREQUISITES:
        value = _get(args, dest, default if missing_as_default else None)
        if value:
            out.append((name, value, why, fix))
    return out


def _local_spec_runs_sdpa(attention: str) -> bool:
    """Whether Megatron's local spec gets the SDPA core attention (``apply``'s choice for 'auto': no TE)."""
    if attention != "auto":
        return attention == "sdpa"
    return importlib.util.find_spec("transformer_engine") is None
