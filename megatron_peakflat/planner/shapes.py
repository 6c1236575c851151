"""Model shapes the planner knows by name: the published configs of public MoE models.

Each preset copies the numbers of the model's released ``config.json`` (Hugging Face), in
Megatron's vocabulary (hidden, ffn, moe-ffn, experts, top-k, ...). Cross-checked against the
public configs found with the search corpora: gpt-oss (``GptOssConfig``: 2880 hidden, 64 heads of
64, 8 kv heads, 201088 vocab, 36 layers x 128 experts / 24 layers x 32 experts, top-4,
2880 expert FFN), Qwen3-235B-A22B (MindSpeed / MaxText configs: 94 layers, 4096 hidden, 64 heads,
4 kv groups of 128, 128 experts top-8, 1536 expert FFN, 151936 vocab), DeepSeek-V3 (61 layers,
first 3 dense with 18432 FFN, 256 routed experts top-8 of 2048 plus one shared expert, MLA).
No torch import: the planner answers in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["MLA", "ModelShape", "PRESETS", "preset"]


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention dimensions (DeepSeek's --multi-latent-attention flags)."""

    q_lora_rank: int | None
    """--q-lora-rank; None: queries are projected directly."""
    kv_lora_rank: int
    """--kv-lora-rank."""
    qk_head_dim: int
    """--qk-head-dim (the no-position part of each query/key head)."""
    qk_pos_emb_head_dim: int
    """--qk-pos-emb-head-dim (the rotary part)."""
    v_head_dim: int
    """--v-head-dim."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know of a transformer, per Megatron flag."""

    name: str
    hidden: int
    """--hidden-size."""
    layers: int
    """--num-layers."""
    heads: int
    """--num-attention-heads."""
    kv_heads: int
    """--num-query-groups (== heads without GQA)."""
    head_dim: int
    """--kv-channels."""
    ffn: int
    """--ffn-hidden-size: the dense layers' MLP width."""
    vocab: int
    """--padded-vocab-size."""
    experts: int = 0
    """--num-experts (0: dense model)."""
    topk: int = 1
    """--moe-router-topk."""
    moe_ffn: int = 0
    """--moe-ffn-hidden-size."""
    shared_ffn: int = 0
    """--moe-shared-expert-intermediate-size (0: no shared expert)."""
    dense_layers: int = 0
    """Dense layers (--moe-layer-freq "([0]*k+[1]*(L-k))": DeepSeek's first_k_dense_replace; an integer N
    leaves L - ceil(L / N)). Without ``moe_pattern`` they are the leading layers; with it, its count of dense
    layers (set from it)."""
    moe_pattern: tuple[bool, ...] | None = None
    """Which layers are MoE, in order (from --moe-layer-freq), so that each pipeline stage counts its own;
    None: the first ``dense_layers`` are dense and the rest MoE (``layer_is_moe``)."""
    gated: bool = True
    """--swiglu: the first MLP linear is 2 x FFN wide."""
    mtp_layers: int = 0
    """--mtp-num-layers: multi-token prediction layers, each a copy of the last decoder layer's kind with its
    own eh_proj [H, 2H] and norms, and a loss of its own through the output layer."""
    tied_embeddings: bool = False
    """True unless --untie-embeddings-and-output-weights."""
    mla: MLA | None = None
    source: str = ""
    vocab_source: str = ""
    """Where the vocabulary came from (``tokenizer.vocab_from_flags``: the tokenizer's files, --vocab-size, GPT-2's
    default...), shown in the plan's header; empty for a preset's own."""

    def __post_init__(self) -> None:
        if self.moe_pattern is not None:
            object.__setattr__(self, "dense_layers", self.moe_pattern.count(False))

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def layer_is_moe(self) -> tuple[bool, ...]:
        """Each layer, in order: True where it is a MoE layer (none in a dense model)."""
        if not self.experts:
            return (False,) * self.layers
        if self.moe_pattern is not None:
            return self.moe_pattern
        dense = min(self.dense_layers, self.layers)
        return (False,) * dense + (True,) * (self.layers - dense)

    def with_(self, **kw: object) -> "ModelShape":
        return replace(self, **kw)


PRESETS: dict[str, ModelShape] = {
    "gpt-oss-20b": ModelShape(
        name="gpt-oss-20b", hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64, ffn=2880, vocab=201088,
        experts=32, topk=4, moe_ffn=2880, source="openai/gpt-oss-20b config.json"),
    "gpt-oss-120b": ModelShape(
        name="gpt-oss-120b", hidden=2880, layers=36, heads=64, kv_heads=8, head_dim=64, ffn=2880, vocab=201088,
        experts=128, topk=4, moe_ffn=2880, source="openai/gpt-oss-120b config.json"),
    "qwen3-235b-a22b": ModelShape(
        name="qwen3-235b-a22b", hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128, ffn=12288,
        vocab=151936, experts=128, topk=8, moe_ffn=1536, source="Qwen/Qwen3-235B-A22B config.json"),
    "deepseek-v3": ModelShape(
        name="deepseek-v3", hidden=7168, layers=61, heads=128, kv_heads=128, head_dim=128, ffn=18432,
        vocab=129280, experts=256, topk=8, moe_ffn=2048, shared_ffn=2048, dense_layers=3,
        mla=MLA(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128),
        source="deepseek-ai/DeepSeek-V3 config.json (671B, without its MTP layer: add --megatron-args "
               "'--mtp-num-layers 1')"),
}
_ALIASES = {"deepseek-v3-671b": "deepseek-v3", "qwen3-235b": "qwen3-235b-a22b"}


def preset(name: str) -> ModelShape:
    """The preset called ``name`` (case-insensitive); KeyError listing the known names otherwise."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise KeyError(name)
    return PRESETS[key]
