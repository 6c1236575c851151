"""Core attention algorithms that need no Megatron: causal attention over a context-parallel sequence."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    name: ".context_parallel" for name in ("context_parallel_attention", "gather_sequence", "split_sequence",
                                            "merge_sequence", "chunks_of_rank")
})
