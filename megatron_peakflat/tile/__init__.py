"""The tiled attention sublayer (no Megatron import).

- ``api.py``: ``tiled_self_attention``, the entry point (the CP schedule under a CP group of more than one rank);
- ``ops.py``: ``TileOps`` (the sublayer's three parts) and what both schedules share;
- ``attention.py``: the autograd Function ``TiledSelfAttention`` (query tiles along the sequence; only K, V and
  their gradient sums whole);
- ``context_parallel.py``: ``TiledSelfAttentionCP``, the same under context parallelism (tiles within each rank's
  two chunks, K and V all-gathered over the CP group, dK and dV reduce-scattered);
- ``bound.py``: the bytes the schedule keeps alive at its peak, and the provisional automatic tile size, as
  torch-free arithmetic (also the planner's);
- ``config.py``: ``TileConfig`` (``--peakflat-tile``, ``--peakflat-tile-tokens``);
- ``reference.py``: a plain-PyTorch sublayer and its ``TileOps``, for the tests.
"""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "TileOps": ".ops",
    "TiledSelfAttention": ".attention",
    "tiled_self_attention": ".api",
    "TiledSelfAttentionCP": ".context_parallel",
    "tiled_attention_peak_bytes": ".bound",
    "auto_tile_tokens": ".bound",
})
