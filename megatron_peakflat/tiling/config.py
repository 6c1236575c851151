"""Knobs of the tiled attention sublayer: ``--peakflat-tile`` and ``--peakflat-tile-tokens``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config_base import ComponentConfig, PeakflatConfigError


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

    def tile_tokens(self, seq: int) -> int:
        """The tile for a sequence of ``seq`` tokens on this rank: the flag's value, or the automatic one."""
        from .bound import auto_tile_tokens

        return self.tokens if self.tokens is not None else auto_tile_tokens(seq)
