"""The planner's rule for the word embeddings' gradient (``planner/model.py embedding_grad_held``), checked
against Megatron's own GPTModel on CPU: in each case, a [V, H] gradient is alive in the decoder layers'
backward exactly when the rule says autograd holds one, with Megatron's output layer and with Ring-DTP's."""

from __future__ import annotations

import pytest

from megatron_peakflat.planner.model import embedding_grad_held
from megatron_peakflat.testing import run_distributed
from tests.conftest import _megatron_core_at_least

V = 1000  # V x H x 4 B differs from every other tensor of the tiny model


def _held_in_layer_backward(rank: int, world: int) -> list[tuple[str, bool, bool]]:
    """For each case: (what, a V x H gradient alive at layer 0's output gradient, what the rule says)."""
    import torch

    import megatron_peakflat
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing.live_bytes import LiveBytesMeter
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, gpt_batch, gpt_loss, megatron_on_cpu,
                                                        tiny_transformer_config)
    from megatron_peakflat.vocab import VocabConfig

    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    with megatron_on_cpu(rank, tp=1):
        out = []
        for mtp in (0, 1):
            for tied in (False, True):
                for ring in (False, True):
                    destroy_moe_metrics_tracker()
                    torch.manual_seed(7)
                    over = dict(mtp_num_layers=mtp, mtp_loss_scaling_factor=0.3) if mtp else {}
                    config = tiny_transformer_config(num_moe_experts=None, **over)
                    model = build_tiny_gpt(config, vocab_size=V, seq_len=16, moe=False, share_embeddings=tied)
                    model.train()
                    emb = model.embedding.word_embeddings.weight
                    # what DDP gives a parameter: Ring-DTP adds the output layer's dW here (main_grad.py)
                    emb.main_grad, emb.grad_added_to_main_grad = torch.zeros_like(emb), False
                    if ring:
                        megatron_peakflat.apply(PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", grad="recompute"),
                                                               general=GeneralConfig(attention="local")))
                    seen: list[bool] = []

                    def held_now(meter: LiveBytesMeter, start: int) -> bool:
                        """A V x H storage allocated in backward that no parameter holds as its .grad."""
                        grads = {p.grad.untyped_storage()._cdata for p in model.parameters() if p.grad is not None}
                        return any(k not in grads and n == V * config.hidden_size * 4
                                   for k, n in meter.live_since(start).items())

                    try:
                        with LiveBytesMeter() as meter:
                            def watch(_m, _args, output):
                                h = output[0] if isinstance(output, tuple) else output
                                h.register_hook(lambda g: seen.append(held_now(meter, start)))

                            handle = model.decoder.layers[0].register_forward_hook(watch)
                            loss = gpt_loss(model, gpt_batch(seq_len=16, micro_batch=2, vocab_size=V, seed=3))
                            handle.remove()
                            start = meter.allocations
                            loss.backward()
                    finally:
                        if ring:
                            megatron_peakflat.remove()
                    assert len(seen) == 1, seen
                    rule = embedding_grad_held(True, config.num_layers, mtp, tied and not ring)
                    out.append((f"mtp={mtp} tied={tied} ring_dtp={ring}", seen[0], rule))
    return out


def test_embedding_gradient_hold_matches_megatron() -> None:
    (cases,) = run_distributed(_held_in_layer_backward, 1, timeout=240)
    assert len(cases) == 8
    assert [c for c in cases if c[1] != c[2]] == [], "\n".join(map(str, cases))
    # both outcomes occur, so the comparison can fail either way
    assert {c[1] for c in cases} == {True, False}, cases


@pytest.mark.parametrize("first,decoder,mtp,out,held", [
    (True, 4, 0, False, False),   # untied, no MTP: one use
    (True, 4, 1, False, True),    # MTP lookup's gradient waits through the decoder layers
    (True, 4, 0, True, True),     # tied output layer (Megatron's) at PP=1
    (False, 4, 0, True, False),   # last stage's copy, output layer only
    (False, 4, 1, False, False),  # last stage, untied: the MTP lookup is its copy's only use
    (False, 4, 1, True, True),    # last stage, tied: held through the MTP layer
    (False, 0, 2, False, True),   # two MTP lookups with an MTP layer between them
    (True, 0, 0, True, False),    # no layer between the uses
])
def test_embedding_grad_held_rule(first: bool, decoder: int, mtp: int, out: bool, held: bool) -> None:
    assert embedding_grad_held(first, decoder, mtp, out) is held


S, B, H = 16, 2, 72
TH = S * B * H * 4  # one [tokens, hidden] fp32 tensor: no other storage of the tiny model has this size
# (layers, MoE where 1; --recompute-method, or "moe" for --recompute-modules moe; --recompute-num-layers; MTP layers)
HELD_CASES = [
    ((1, 1, 1, 1), "uniform", 1, 0),
    ((0, 1, 0, 1), "uniform", 1, 0),
    ((1, 0, 1, 0), "uniform", 1, 0),
    ((1, 1, 1, 1), "uniform", 2, 0),
    ((1, 1, 1, 1), "block", 2, 0),
    ((1, 1), "uniform", 1, 1),
    ((1, 0), "uniform", 1, 1),
    ((1, 1, 1, 1), "uniform", 1, 2),
    ((1, 1, 1, 1), "moe", 0, 0),  # --recompute-granularity selective --recompute-modules moe
    ((0, 1, 0, 1), "moe", 0, 1),
]


def _mtp_under_full_recompute(case: tuple) -> bool:
    return case[3] > 0 and case[1] != "moe"


def _dispatcher_held(rank: int, world: int, cases: list[tuple]) -> list[tuple[tuple, tuple[int, int, int]]]:
    """For each of ``cases`` (of HELD_CASES), what Megatron's alltoall dispatcher keeps alive, as the [tokens, hidden]
    storages alive without moe-release less those alive with it: (born in forward, born in backward) when layer
    0's output gradient arrives in its recompute, and all of them once the backward is done."""
    import gc

    import torch

    from megatron_peakflat.integration import registry
    from megatron_peakflat.testing.live_bytes import LiveBytesMeter
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, gpt_batch, gpt_loss, megatron_on_cpu,
                                                        recompute_config, tiny_transformer_config)
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    with megatron_on_cpu(rank, ep=world):
        out = []
        for freq, method, n, mtp in cases:
            counts = {}
            for fix in (False, True):
                destroy_moe_metrics_tracker()
                MTPLossLoggingHelper.tracker.clear()  # sized by the first model's MTP layers
                torch.manual_seed(7)
                over = dict(mtp_num_layers=mtp, mtp_loss_scaling_factor=0.3) if mtp else {}
                rc = recompute_config("moe") if method == "moe" else recompute_config("full", method, n)
                config = tiny_transformer_config(hidden_size=H, num_layers=len(freq), moe_layer_freq=list(freq), **rc,
                                                 **over)
                model = build_tiny_gpt(config, vocab_size=V, seq_len=S).train()
                if fix:
                    registry.apply_patches({"moe-release"})
                at_layer0: list[tuple[int, int]] = []
                try:
                    with LiveBytesMeter() as meter:
                        def alive(after: int, before: int) -> int:
                            return sum(1 for size, born in meter._tracked.values()
                                       if size == TH and after < born <= before)

                        def watch(_m, _args, output):
                            h = output[0] if isinstance(output, tuple) else output
                            # full recompute: layer 0's recompute, in backward; selective: its forward
                            if torch.is_grad_enabled() and h.requires_grad and (method != "moe" or not forward_end):
                                h.register_hook(lambda g: at_layer0.append(
                                    (alive(0, forward_end), alive(forward_end, meter.allocations))))

                        forward_end = 0
                        handle = model.decoder.layers[0].register_forward_hook(watch)
                        loss = gpt_loss(model, gpt_batch(S, B, V, seed=5 + rank))
                        forward_end = meter.allocations
                        loss.backward()
                        handle.remove()
                        del loss
                        gc.collect()
                        after_backward = alive(0, meter.allocations)
                finally:
                    if fix:
                        registry.remove_patches()
                assert len(at_layer0) == 1, at_layer0
                counts[fix] = (*at_layer0[0], after_backward)
            out.append(((freq, method, n, mtp), tuple(a - b for a, b in zip(counts[False], counts[True]))))
    return out


@pytest.mark.parametrize("mtp_full", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        not _megatron_core_at_least((0, 19)),
        reason="megatron-core 0.18's MTP layer cannot run under full recompute (MultiTokenPredictionLayer."
               "_checkpointed_forward() got an unexpected keyword argument 'padding_mask')")),
])
def test_dispatcher_held_matches_megatron(mtp_full: bool) -> None:
    """``dispatcher_held`` against what moe-release frees in Megatron's GPTModel on CPU (alltoall dispatcher): dense
    and MoE layers in either order, full recompute (uniform and block, of 1 or 2 layers) and
    ``--recompute-modules moe``, 0 to 2 MTP layers, dense and MoE (``mtp_full``: the MTP layers under full
    recompute)."""
    from megatron_peakflat.planner.model import RunConfig, dispatcher_held

    todo = [c for c in HELD_CASES if _mtp_under_full_recompute(c) == mtp_full]
    (cases,) = run_distributed(_dispatcher_held, 1, todo, timeout=400)
    assert len(cases) == len(todo) >= 3
    wrong = []
    for (freq, method, n, mtp), measured in cases:
        run = (RunConfig(seq_len=S, recompute="selective", recompute_modules=("moe",)) if method == "moe" else
               RunConfig(seq_len=S, recompute="full", recompute_method=method, recompute_num_layers=n))
        moe = tuple(bool(x) for x in freq)
        rule = dispatcher_held(moe, (moe[-1],) * mtp, run)
        if rule != measured:
            wrong.append((freq, method, n, mtp, "measured", measured, "rule", rule))
    assert not wrong, "\n".join(map(str, wrong))
    # the cases differ, so the comparison can fail: all-MoE with four layers keeps 3 inputs, 2 gradients, 8 in all;
    # with two MTP layers 7, 6 and 16
    expected = ((((1, 1, 1, 1), "uniform", 1, 2), (7, 6, 16)) if mtp_full else
                (((1, 1, 1, 1), "uniform", 1, 0), (3, 2, 8)))
    assert dict(cases)[expected[0]] == expected[1]


def test_dispatcher_held_rule_without_full_recompute_is_empty() -> None:
    from megatron_peakflat.planner.model import RunConfig, dispatcher_held

    assert dispatcher_held((True,) * 4, (True,), RunConfig(seq_len=S, recompute="selective")) == (0, 0, 0)
    assert dispatcher_held((True,) * 4, (True,), RunConfig(seq_len=S, recompute="none")) == (0, 0, 0)


def _dispatcher_state(rank: int, world: int) -> list[tuple[str, int, int]]:
    """(dispatcher, bytes its MoE layers keep after the forward, layers) with Megatron's GPTModel, fp32."""
    import torch

    from megatron_peakflat.integration.moe_release import PER_FORWARD
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, gpt_batch, gpt_loss, megatron_on_cpu,
                                                        recompute_config, tiny_transformer_config)
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    with megatron_on_cpu(rank, ep=world):
        out = []
        for dispatcher in ("alltoall", "allgather"):
            destroy_moe_metrics_tracker()
            torch.manual_seed(7)
            config = tiny_transformer_config(hidden_size=H, num_layers=3, moe_layer_freq=[0, 1, 1],
                                             moe_token_dispatcher_type=dispatcher, **recompute_config("full"))
            model = build_tiny_gpt(config, vocab_size=V, seq_len=S).train()
            gpt_loss(model, gpt_batch(S, B, V, seed=5))
            kept, layers = 0, 0
            for layer in model.decoder.layers:
                d = getattr(layer.mlp, "token_dispatcher", None)
                if d is not None:
                    layers += 1
                    kept += sum(t.untyped_storage().nbytes() for t in (getattr(d, n, None) for n in PER_FORWARD)
                                if isinstance(t, torch.Tensor))
            out.append((dispatcher, kept, layers))
    return out


def test_dispatcher_state_matches_megatron() -> None:
    """``dispatcher_state`` against the bytes Megatron's alltoall dispatcher holds after a full-recompute forward of
    a dense layer and two MoE layers (4 experts, top-2, fp32): probabilities, routing and permutation maps. The
    allgather dispatcher keeps less (only the routed pairs' probabilities): the row, like the dispatch row, is
    the alltoall dispatcher's."""
    from megatron_peakflat.planner.model import RunConfig, dispatcher_state
    from megatron_peakflat.planner.shapes import ModelShape

    (cases,) = run_distributed(_dispatcher_state, 1, timeout=200)
    shape = ModelShape(name="tiny", hidden=H, layers=3, heads=4, kv_heads=4, head_dim=H // 4, ffn=128, vocab=V,
                       experts=4, topk=2, moe_ffn=96)
    per_layer = dispatcher_state(shape, RunConfig(seq_len=S, micro_batch=B, precision="fp32"))
    assert per_layer == S * B * (4 * 5 + 2 * 8)
    assert cases[0] == ("alltoall", 2 * per_layer, 2), (cases, per_layer)
    # allgather: [rows x top-k] probabilities, the local map and the permutation map
    assert cases[1] == ("allgather", 2 * S * B * (2 * 4 + 4 + 2 * 8), 2), cases


def _saved_by_mlp(rank: int, world: int) -> list[tuple[bool, str, int]]:
    """(MoE, --recompute-modules, bytes the layers' MLP or MoE saved for backward in the forward), fp32, 2 layers."""
    import torch

    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, gpt_batch, gpt_loss, megatron_on_cpu,
                                                        recompute_config, tiny_transformer_config)
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    with megatron_on_cpu(rank, ep=world):
        out = []
        for moe, module in ((False, "core_attn"), (False, "mlp"), (True, "core_attn"), (True, "moe")):
            destroy_moe_metrics_tracker()
            torch.manual_seed(7)
            config = tiny_transformer_config(hidden_size=H, num_layers=2, **recompute_config(module),
                                             **({} if moe else dict(num_moe_experts=None)))
            model = build_tiny_gpt(config, vocab_size=V, seq_len=S, moe=moe).train()
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            for layer in model.decoder.layers:
                hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                layer.mlp.register_forward_pre_hook(lambda _m, _a, h=hooks: h.__enter__())
                layer.mlp.register_forward_hook(lambda _m, _a, _o, h=hooks: h.__exit__(None, None, None))
            gpt_loss(model, gpt_batch(S, B, V, seed=5))
            out.append((moe, module, sum(saved.values())))
    return out


def test_selective_recompute_saves_only_the_modules_input() -> None:
    """What the planner assumes of ``--recompute-modules mlp`` and ``moe`` (``mlp_activations``,
    ``moe_nondispatch_activations``, and the dispatch row in the MoE phase), against Megatron's GPTModel on CPU:
    a recomputed dense MLP saves nothing inside itself (its checkpoint, outside it, keeps the norm's output, which
    the planner counts with the norm), and a recomputed MoE layer only its input, the norm's output
    ([tokens, hidden] per layer); without them both save far more."""
    from megatron_peakflat.planner.model import RunConfig, mlp_activations, moe_nondispatch_activations
    from megatron_peakflat.planner.shapes import ModelShape

    (cases,) = run_distributed(_saved_by_mlp, 1, timeout=200)
    got = {(moe, module): n for moe, module, n in cases}
    tokens_hidden = S * B * H * 4
    assert got[(False, "mlp")] == 0 and got[(True, "moe")] == 2 * tokens_hidden, got
    assert got[(False, "core_attn")] > 4 * tokens_hidden and got[(True, "core_attn")] > 10 * tokens_hidden, got
    shape = ModelShape(name="tiny", hidden=H, layers=2, heads=4, kv_heads=4, head_dim=H // 4, ffn=128, vocab=V,
                       experts=4, topk=2, moe_ffn=96, gated=False)
    norm = S * B * H * 2 * 4 + S * B * 4  # the pre-MLP norm's input and output, and its statistics
    for module, fn in (("mlp", lambda r: mlp_activations(shape, r, shape.ffn)),
                       ("moe", lambda r: moe_nondispatch_activations(shape, r))):
        plain, recomputed = (RunConfig(seq_len=S, micro_batch=B, precision="fp32", recompute="selective",
                                       recompute_modules=m) for m in (("core_attn",), (module,)))
        assert fn(recomputed) == norm < fn(plain), module
