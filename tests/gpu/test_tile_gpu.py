"""The tiled attention sublayer on one GPU, on both specs a Megatron user trains with: Transformer Engine's layer
(TE's attention with the bottom-right causal mask, its norm fused into the QKV projection) and the local spec with
the SDPA core attention (``--peakflat-attention sdpa``), with GQA and RoPE, each against its own untiled layer.

One Megatron ``TransformerLayer`` built from ``get_gpt_layer_with_transformer_engine_spec`` or
``get_gpt_layer_local_spec`` (dense MLP), run forward and backward with ``--peakflat-tile`` off and on, the same
weights and inputs. fp32: the output, dx and
every parameter's gradient within 1e-5 (relative to each tensor's largest entry) of the untiled layer. bf16:
each no further from the fp32 untiled layer than the untiled bf16 layer is, plus one bf16 epsilon (2^-8): the
tiles sum in another order than the whole sequence, and a wrong mask or position is off by O(1).
CPU: skipped (tests/test_tile_megatron.py runs the SDPA path on CPU in fp32); the TE case also without TE.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.integration.attention import transformer_engine_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU runs the SDPA path in "
                                "tests/test_tile_megatron.py)")
_NEEDS_TE = pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine")
CASES = [pytest.param("te", False, marks=_NEEDS_TE), pytest.param("te", True, marks=_NEEDS_TE),
         ("local", False), ("local", True)]
"""(spec, per_kv_head): each spec also with one call per K/V head (``attention.calls``): the SDPA attention's own
split, and on TE the tiled sublayer's split of TE's attention (integration/tile.py ``te_kv_head_calls``)."""
CORE_ATTENTION = {"te": "TEDotProductAttention", "local": "SDPAttention"}

SEQ, MB, HIDDEN, HEADS, GROUPS, TILE = 1000, 2, 256, 8, 2, 256  # 4 tiles, the last one shorter


def _layer_run(layer, x, rope, dy):  # noqa: ANN001
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
    out.backward(dy)
    return [out.detach().float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()]


def _layer_spec(spec: str):  # noqa: ANN202
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    if spec == "te":
        return get_gpt_layer_with_transformer_engine_spec()
    from megatron_peakflat.integration.attention import sdpa_core_attention_class

    layer_spec = get_gpt_layer_local_spec()
    layer_spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention_class()
    return layer_spec


def _worker(rank: int, world: int, spec: str, per_kv_head: bool = False) -> dict:
    import megatron_peakflat
    from megatron_peakflat.attention import calls
    from megatron_peakflat import stats
    from megatron_peakflat.config import PeakflatConfig
    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel
    from megatron_peakflat.tile.config import TileConfig
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_megatron_parallel(cpu=False, seed=1234)
    if per_kv_head:  # the call per K/V head, which runs from GROUPED_CALL_MIN_KEYS keys on
        calls.GROUPED_CALL_MIN_KEYS = 1
    layers, runs = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, ffn_hidden_size=4 * HIDDEN, hidden_dropout=0.0,
                                   attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                   gradient_accumulation_fusion=False, add_bias_linear=True, add_qkv_bias=True)
        torch.manual_seed(5)
        # .to(dtype) as Megatron's Float16Module does: the local spec's torch norms ignore params_dtype
        layer = build_module(_layer_spec(spec), config=config, layer_number=1).cuda().to(dtype)
        if dtype == torch.bfloat16:  # the fp32 layer's weights, rounded
            layer.load_state_dict({k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                                   for k, v in layers[torch.float32].state_dict().items()})  # TE's _extra_state
        layers[dtype] = layer.train()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, MB, HIDDEN, generator=g).cuda()
    dy = torch.randn(SEQ, MB, HIDDEN, generator=g).cuda()
    rope = RotaryEmbedding(kv_channels=HIDDEN // HEADS, rotary_percent=1.0)(SEQ).cuda()
    for dtype, layer in layers.items():
        runs[(dtype, False)] = _layer_run(layer, x.to(dtype), rope, dy.to(dtype))
        megatron_peakflat.apply(PeakflatConfig(tile=TileConfig(enabled=True, tokens=TILE)))
        stats.reset()
        try:
            runs[(dtype, True)] = _layer_run(layer, x.to(dtype), rope, dy.to(dtype))
            snap = stats.snapshot().get("tile", {})
            assert snap.get("tiled_calls") == 1, snap
            assert (snap.get("te_kv_head_calls", 0) > 0) == (spec == "te" and per_kv_head), snap
        finally:
            megatron_peakflat.remove()
    core = layers[torch.float32].self_attention.core_attention
    assert type(core).__name__ == CORE_ATTENTION[spec], type(core).__name__

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    want = runs[(torch.float32, False)]
    fp32 = [err(a, b) for a, b in zip(runs[(torch.float32, True)], want)]
    bf16 = [(err(a, w), err(r, w)) for a, r, w in zip(runs[(torch.bfloat16, True)], runs[(torch.bfloat16, False)],
                                                       want)]
    return {"fp32": fp32, "bf16": bf16, "tensors": len(want)}


@pytest.mark.parametrize("spec,per_kv_head", CASES)
def test_tiled_layer_matches_untiled_layer(spec: str, per_kv_head: bool, monkeypatch: pytest.MonkeyPatch):
    from megatron_peakflat.testing.distributed import run_distributed

    # fp32 math in the spawned rank: Transformer Engine's fp32 GEMMs otherwise run in TF32, whose 10-bit mantissa
    # rounds the tiled and the whole-sequence GEMMs apart by 2.8e-5 (docs/evidence/gpu_tile_te_h100.txt)
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    (out,) = run_distributed(_worker, 1, spec, per_kv_head, backend="nccl", timeout=300)
    assert out["tensors"] > 6
    assert max(out["fp32"]) <= 1e-5, out["fp32"]
    for tiled, untiled in out["bf16"]:
        assert tiled <= untiled + 2**-8, out["bf16"]
