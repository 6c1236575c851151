"""What the tiled attention sublayer keeps alive at its peak, and the provisional automatic tile size.

Torch-free arithmetic, so that the planner can use it. Each term is a tensor that ``attention.py`` (or an op
it calls, as Megatron's are written: an input norm, one QKV projection, unfused RoPE, a flash-class attention,
the output projection with its residual add) allocates, named after it. Two kinds:

- whole-sequence terms (grow with the sequence): K and V; their fp32 gradient sums dK, dV; the gradients of
  the keys and values that the attention kernel returns for a tile's prefix (at most the whole sequence's);
  the sublayer's output (forward) or its incoming gradient and dx (backward); the parameters' fp32 gradient
  sums;
- per-tile terms (grow with the tile only): the recomputed tile's graph (norm output, mixed QKV, RoPE's saved
  rotation and result for q and k, the attention output and its softmax log-sum-exp, the projection's
  output), and the backward's tile gradients (the attention output's and q's, the kernel's fp32 dq
  accumulator, the cast dK/dV rows of the tile and the tile's k/v gradients, the mixed QKV's, the norm's and
  the tile's dx), plus the tile's parameter gradients in the parameter dtype before they are summed.

Under context parallelism (``context_parallel.py``, ``cp`` > 1; ``seq`` is then the rank's 2c tokens of a sequence
of ``cp x seq``) K, V, dK, dV and the attention's prefix gradients are the whole sequence's (gathered), and two
terms join: the rank's dK and dV in fp32 after the reduce-scatter (its 2c rows), and the one chunk of c rows
(fp32 at most) that the collectives' reordering holds while it swaps two chunks. A tile is then at most c tokens.

Every term is counted at once (they are not all alive together), so the total is an upper bound. An attention
kernel's scratch beyond these (scores it materialises, K and V repeated to the query heads, flash attention's dK
and dV expanded to the query heads over the prefix in its backward) is not the schedule's and is passed in as
``attention_workspace_bytes`` (the planner's ``tiled_attention_bytes`` sizes it for the kernel that runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TileTerms", "tiled_attention_terms", "tiled_attention_peak_bytes", "auto_tile_tokens",
           "AUTO_MIN_TILE", "AUTO_MAX_TILE", "attention_param_count"]

AUTO_MIN_TILE = 4096
"""The smallest tile ``auto_tile_tokens`` picks, so that each tile's GEMMs and attention stay large (a floor
chosen, not measured); a shorter sequence is one tile."""
AUTO_MAX_TILE = 16384
"""The largest tile ``auto_tile_tokens`` picks: the tile terms grow with the tile and the whole-sequence terms do
not, so a quarter of a long sequence would keep a quarter of the untiled working set alive (at 1M tokens of a
gpt-oss-20b layer, bf16, this bound's tile terms come to 31.6 GiB at 256K tokens, 2.0 GiB at 16K, beside 19.4 GiB of
whole-sequence terms). The attention's work is the same for any tile (each query attends its own prefix)."""


@dataclass(frozen=True)
class TileTerms:
    """The bound's terms in bytes, by name: ``whole`` grow with the sequence, ``tile`` with the tile only."""

    whole: dict[str, int] = field(default_factory=dict)
    tile: dict[str, int] = field(default_factory=dict)

    @property
    def whole_bytes(self) -> int:
        return sum(self.whole.values())

    @property
    def tile_bytes(self) -> int:
        return sum(self.tile.values())

    @property
    def total(self) -> int:
        return self.whole_bytes + self.tile_bytes


def attention_param_count(hidden: int, q_heads: int, kv_heads: int, head_dim: int) -> int:
    """Parameters of the sublayer (norm weight, QKV weight and bias, output weight and bias): an upper bound,
    biases counted whether or not the model has them."""
    qkv = (q_heads + 2 * kv_heads) * head_dim
    return hidden + qkv * hidden + qkv + q_heads * head_dim * hidden + hidden


def tiled_attention_terms(tile: int, seq: int, micro_batch: int, hidden: int, q_heads: int, kv_heads: int,
                          head_dim: int, dtype_bytes: int, *, attention_workspace_bytes: int = 0,
                          cp: int = 1) -> TileTerms:
    """The terms of ``tiled_attention_peak_bytes`` (same arguments), by name."""
    for name, value in (("tile", tile), ("seq", seq), ("micro_batch", micro_batch), ("hidden", hidden),
                        ("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes), ("cp", cp)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if cp > 1 and seq % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; {seq} tokens do not split")
    e, b, fp32 = dtype_bytes, micro_batch, 4
    t = min(tile, seq if cp == 1 else seq // 2)
    kv_whole = cp * seq * b * kv_heads * head_dim  # elements of K (or V) over the (gathered) sequence
    x_whole = seq * b * hidden
    params = attention_param_count(hidden, q_heads, kv_heads, head_dim)
    x_t, q_t, kv_t = t * b * hidden, t * b * q_heads * head_dim, t * b * kv_heads * head_dim
    mixed_t = q_t + 2 * kv_t
    whole = {
        "K and V": 2 * kv_whole * e,
        "dK and dV fp32 sums": 2 * kv_whole * fp32,
        "attention's dK and dV over a tile's prefix": 2 * kv_whole * e,
        "output (forward) / incoming gradient (backward)": x_whole * e,
        "dx": x_whole * e,
        "parameter gradient fp32 sums": params * fp32,
    }
    if cp > 1:
        kv_mine = seq * b * kv_heads * head_dim
        whole["rank's dK and dV fp32 after the reduce-scatter"] = 2 * kv_mine * fp32
        whole["a chunk held while the collectives reorder the layout"] = kv_mine // 2 * max(e, fp32)
    tile_terms = {
        "norm output": x_t * e + t * b * fp32,  # and its fp32 reciprocal RMS
        "mixed QKV": mixed_t * e,
        "RoPE rotation and result, q and k": 2 * (q_t + kv_t) * e,
        "RoPE temporaries (product terms)": 2 * q_t * e,
        "attention output": q_t * e,
        "softmax log-sum-exp": t * b * q_heads * fp32,
        "projection output and residual sum": 2 * x_t * e,
        "gradient of the attention output": q_t * e,
        "dq fp32 accumulator and dq": q_t * (fp32 + e),
        "tile's dK/dV rows cast, and k/v gradients": 4 * kv_t * e,
        "gradient of mixed QKV": mixed_t * e,
        "norm gradient and tile dx": 2 * x_t * e,
        "tile's parameter gradients": params * e,
        "attention kernel workspace": attention_workspace_bytes,
    }
    return TileTerms(whole=whole, tile=tile_terms)


def tiled_attention_peak_bytes(tile: int, seq: int, micro_batch: int, hidden: int, q_heads: int, kv_heads: int,
                               head_dim: int, dtype_bytes: int, *, attention_workspace_bytes: int = 0,
                               cp: int = 1) -> int:
    """Upper bound on the bytes the tiled sublayer of one layer allocates and holds at its peak (its backward),
    beyond its input x and the parameters.

    ``tile``, ``seq``: tokens (``seq``: this rank's); ``micro_batch``: sequences per micro-batch; ``hidden``: the model's hidden size;
    ``q_heads``, ``kv_heads``: attention heads of this rank (after tensor parallelism); ``head_dim``: per head;
    ``dtype_bytes``: the activations' element size (2 for bf16). ``attention_workspace_bytes``: scratch of the
    attention kernel per tile beyond its output, dq accumulator and log-sum-exp. ``cp``: the
    context-parallel size (``seq`` is then the rank's two chunks of a sequence of ``cp x seq`` tokens)."""
    return tiled_attention_terms(tile, seq, micro_batch, hidden, q_heads, kv_heads, head_dim, dtype_bytes,
                                 attention_workspace_bytes=attention_workspace_bytes, cp=cp).total


def auto_tile_tokens(seq: int) -> int:
    """The tile ``--peakflat-tile-tokens auto`` picks (provisional, until the planner chooses it): the largest
    power of two not above seq / 4, within ``AUTO_MIN_TILE`` .. ``AUTO_MAX_TILE`` tokens; a sequence of at most
    ``AUTO_MIN_TILE`` tokens is one tile."""
    if seq < 1:
        raise ValueError(f"seq must be at least 1, got {seq}")
    if seq <= AUTO_MIN_TILE:
        return seq
    tile = AUTO_MIN_TILE
    while tile * 2 <= min(seq // 4, AUTO_MAX_TILE):
        tile *= 2
    return tile
