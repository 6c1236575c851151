"""Ring-DTP inside Megatron's GPTModel on CPU: loss and every parameter's gradient equal the unpatched
model's (fp32, 1e-5 relative), TP=1 and TP=2 (SP on with MoE; SP off, dense; shared embeddings; MuP's
logit scale), with
gradients recomputed in backward or computed with the loss (in-forward, for the gradient of the masked
mean, one microbatch), and the output layer is never called (no logits)."""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing import max_rel_error, run_distributed
from tests._helpers import no_logits

V = 130  # V / TP = 65 rows per shard at TP=2: odd, not a multiple of the block size


def _vocab(world: int) -> int:
    """65 rows per shard at TP = world (and 130 at TP=1): odd, not a multiple of the block size."""
    return 65 * max(2, world)


def _shape(world: int) -> tuple[int, dict]:
    """Tokens per sequence and the widths a TP of ``world`` divides (sequence parallelism splits the sequence;
    heads and FFN columns split over TP): the tiny model's own, or at TP=3 one of 18 tokens, 6 heads of 16."""
    if world != 3:
        return 16, {}
    return 18, dict(hidden_size=96, num_attention_heads=6, ffn_hidden_size=192, moe_ffn_hidden_size=96)



def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = p.grad.detach().clone()
            p.grad = None
    return out


def _same_grads(what: str, ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """The same parameters got gradients, each equal to the reference's (fp32, 1e-5 relative)."""
    assert set(ours) == set(ref), (what, set(ours) ^ set(ref))
    for k in ref:
        assert max_rel_error(ours[k], ref[k]) < 1e-5, (what, k, max_rel_error(ours[k], ref[k]))


def _megatron_checks(rank: int, world: int) -> list[str]:
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, gpt_batch, gpt_loss, megatron_on_cpu,
                                                        tiny_transformer_config)
    from megatron_peakflat.vocab import VocabConfig

    with megatron_on_cpu(rank, global_batch=3, micro_batch=3, tp=world):  # one micro-batch of 3 sequences
        V = _vocab(world)
        seq, shape = _shape(world)
        variants = [("moe", dict(), dict(moe=True), ["auto"] if world == 1 else ["activations"]),
                    ("shared-emb", dict(), dict(moe=True, share_embeddings=True),
                     ["auto"] if world == 1 else ["weights"])]
        # MuP (width x2): Megatron scales the logits by mup_output_mult = 0.5; Ring-DTP scales the hidden states.
        mup = dict(use_mup=True, mup_base_hidden_size=32)
        variants.append(("mup", mup, dict(moe=True), ["auto"] if world == 1 else ["activations"]))
        if world > 1:
            variants.append(("dense-no-sp", dict(num_moe_experts=None, sequence_parallel=False), dict(moe=False),
                             ["activations", "weights"]))
        done = []
        for vi, (name, cfg_over, build_kw, schedules) in enumerate(variants):
            for schedule, grad in [(s, "recompute") for s in schedules] + [("auto", "in-forward")]:
                torch.manual_seed(1234 + vi)
                model = build_tiny_gpt(tiny_transformer_config(**shape, **cfg_over), vocab_size=V, seq_len=seq,
                                       **build_kw)
                batch = gpt_batch(seq_len=seq, micro_batch=3, vocab_size=V, seed=vi)
                ref_loss = gpt_loss(model, batch)
                ref_loss.backward()
                ref = _grads(model)

                calls = stats.snapshot().get("vocab", {}).get("calls", 0)
                vocab = VocabConfig(impl="ring-dtp", schedule=schedule, block_size=16, grad=grad, chunk_tokens=128)
                megatron_peakflat.apply(PeakflatConfig(vocab=vocab, general=GeneralConfig(attention="local")))
                try:
                    model.output_layer.forward = no_logits
                    loss = gpt_loss(model, batch)
                    loss.backward()
                    ours = _grads(model)
                finally:
                    del model.output_layer.forward
                    megatron_peakflat.remove()
                what = f"{name} tp={world} schedule={schedule} grad={grad}"
                assert stats.snapshot()["vocab"]["calls"] == calls + 1, what
                assert stats.snapshot()["vocab"]["grad"] == grad, what
                assert not stats.snapshot()["vocab"].get("hint_corrections"), what
                assert max_rel_error(loss.detach(), ref_loss.detach()) < 1e-5, (what, float(loss), float(ref_loss))
                _same_grads(what, ours, ref)
                done.append(what)
                # unpatched again: the original forward runs, builds logits and gives the reference's loss
                logits_built = []
                hook = model.output_layer.register_forward_hook(lambda _m, _a, out: logits_built.append(out[0].shape))
                again = gpt_loss(model, batch)
                hook.remove()
                assert logits_built and logits_built[0][-1] * world == V, (what, logits_built)
                assert max_rel_error(again.detach(), ref_loss.detach()) < 1e-5, (what, float(again), float(ref_loss))
    return done


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gpt_model_loss_and_grads_match_megatron(world: int) -> None:
    out = run_distributed(_megatron_checks, world, timeout=180)
    assert all(len(o) == len(out[0]) > 0 for o in out)


def _mtp_checks(rank: int, world: int) -> list[str]:
    """GPTModel with MTP layers: the main loss, every parameter's gradient (the MTP layers', the shared
    output weight's through both heads) and the MTP metrics Megatron logs (each layer's loss, its
    acceptance counts) equal the unpatched model's, and the output layer is never called."""
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, gpt_batch, gpt_loss, megatron_on_cpu,
                                                        mtp_metrics, tiny_transformer_config)
    from megatron_peakflat.vocab import VocabConfig

    with megatron_on_cpu(rank, global_batch=3, micro_batch=3, tp=world):  # one micro-batch of 3 sequences
        V = _vocab(world)
        seq, shape = _shape(world)
        done = []
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        dense = dict(num_moe_experts=None, sequence_parallel=False)  # TP=2 without SP: tokens sliced per ring rank
        variants = [(1, False, "recompute", {}), (2, True, "in-forward", {}), (1, True, "recompute", dense)]
        for vi, (depth, tied, grad, over) in enumerate(variants):
            destroy_moe_metrics_tracker()  # Megatron's MoE metrics are sized by the first model's layer count
            torch.manual_seed(4321 + vi)
            config = tiny_transformer_config(mtp_num_layers=depth, mtp_loss_scaling_factor=0.3, **shape, **over)
            model = build_tiny_gpt(config, vocab_size=V, seq_len=seq, share_embeddings=tied,
                                   moe=config.num_moe_experts is not None)
            model.train()
            batch = gpt_batch(seq_len=seq, micro_batch=3, vocab_size=V, seed=50 + vi)
            mtp_metrics()
            ref_loss = gpt_loss(model, batch)
            ref_loss.backward()
            ref, ref_metrics = _grads(model), mtp_metrics()

            calls = stats.snapshot().get("vocab", {}).get("calls", 0)
            megatron_peakflat.apply(PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", block_size=16, grad=grad,
                                                                       chunk_tokens=128),
                                                   general=GeneralConfig(attention="local")))
            try:
                model.output_layer.forward = no_logits
                loss = gpt_loss(model, batch)
                loss.backward()
                ours, metrics = _grads(model), mtp_metrics()
            finally:
                del model.output_layer.forward
                megatron_peakflat.remove()
            what = f"mtp={depth} tied={tied} tp={world} grad={grad} {'dense, no SP' if over else 'MoE'}"
            assert stats.snapshot()["vocab"]["calls"] == calls + 1 + depth, what
            assert max_rel_error(loss.detach(), ref_loss.detach()) < 1e-5, (what, float(loss), float(ref_loss))
            assert any(".mtp." in k or k.startswith("mtp.") for k in ref), (what, sorted(ref))
            _same_grads(what, ours, ref)
            # 0.19 logs each MTP layer's loss ("loss_values") and acceptance counts; 0.18.2 its loss ("values")
            assert set(metrics) == set(ref_metrics) and {"loss_values", "values"} & set(ref_metrics), (
                what, set(ref_metrics))
            for k in ref_metrics:
                assert max_rel_error(metrics[k], ref_metrics[k]) < 1e-5, (what, k, metrics[k], ref_metrics[k])
            if "correct_values" in ref_metrics:
                assert float(ref_metrics["total_values"].sum()) > 0, what
            done.append(what)
    return done


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mtp_heads_loss_grads_and_metrics_match_megatron(world: int) -> None:
    out = run_distributed(_mtp_checks, world, timeout=240)
    assert all(len(o) == 3 for o in out)


def test_wrapper_passes_processor_only_when_enabled_with_labels() -> None:
    from types import SimpleNamespace

    from megatron_peakflat.config import PeakflatConfig
    from megatron_peakflat.integration import state
    from megatron_peakflat.integration.vocab import ring_output_processor, wrap_gpt_forward
    from megatron_peakflat.vocab import VocabConfig

    seen = []

    def original(self, *args, **kwargs):
        seen.append(kwargs.get("output_processor"))
        return "out"

    fwd = wrap_gpt_forward(original)

    def model(**cfg):
        base = dict(mtp_num_layers=None, use_mup=False)
        base.update(cfg)
        return SimpleNamespace(config=SimpleNamespace(**base), post_process=True,
                               output_layer=SimpleNamespace(bias=None))

    labels = torch.zeros(2, 3, dtype=torch.long)
    try:
        state.set_current(None)
        assert fwd(model(), 1, 2, 3, labels=labels) == "out" and seen[-1] is None
        state.set_current(PeakflatConfig(vocab=VocabConfig(impl="megatron")))
        fwd(model(), 1, 2, 3, labels=labels)
        assert seen[-1] is None
        state.set_current(PeakflatConfig(vocab=VocabConfig(impl="ring-dtp")))
        fwd(model(), 1, 2, 3)  # no labels: logits wanted, original path
        assert seen[-1] is None
        fwd(model(), 1, 2, 3, None, labels)  # labels given positionally
        assert seen[-1].func is ring_output_processor
        fwd(model(), 1, 2, 3, labels=labels)
        assert seen[-1].func is ring_output_processor
        fwd(model(mtp_num_layers=1), 1, 2, 3, labels=labels)  # MTP: Ring-DTP too (MTPHead in process_mtp_loss)
        assert seen[-1].func is ring_output_processor
        biased = model()
        biased.output_layer.bias = torch.zeros(V)
        fwd(biased, 1, 2, 3, labels=labels)  # an output-layer bias: handed back to Megatron
        assert seen[-1] is None
    finally:
        state.set_current(None)


def test_megatron_loss_gradient_follows_the_schedule() -> None:
    """The per-token gradient the in-forward schedule is told: Megatron's schedule divides the masked sum
    by the token count and the microbatches (unless calculate_per_token_loss) and scales by
    grad_scale_func; without a global microbatch count it is unknown (None: recompute)."""
    from types import SimpleNamespace

    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    from megatron_peakflat.integration.vocab import megatron_loss_gradient

    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    cfg = SimpleNamespace(grad_scale_func=lambda t: t * 8.0, calculate_per_token_loss=False)
    assert megatron_loss_gradient(None, cfg) is None
    destroy_num_microbatches_calculator()
    assert megatron_loss_gradient(mask, cfg) is None  # no calculator
    init_num_microbatches_calculator(0, None, 8, 2, 1)  # 4 microbatches
    try:
        assert torch.equal(megatron_loss_gradient(mask, cfg), mask * (8.0 / 4 / 4))
        per_token = SimpleNamespace(grad_scale_func=None, calculate_per_token_loss=True)
        assert torch.equal(megatron_loss_gradient(mask, per_token), mask)
    finally:
        destroy_num_microbatches_calculator()


def test_in_forward_falls_back_to_recompute_after_a_hint_correction() -> None:
    """Under --peakflat-vocab-grad auto, once a hint missed the loss's real gradient (a correction in this
    process's stats), later calls recompute instead of computing the gradients in the forward pass."""
    from types import SimpleNamespace

    from megatron_peakflat import stats
    from megatron_peakflat.integration.vocab import _resolve_grad
    from megatron_peakflat.vocab import VocabConfig

    cfg = VocabConfig(impl="ring-dtp", grad="auto")
    mask = torch.ones(2, 3)
    config = SimpleNamespace(grad_scale_func=None, calculate_per_token_loss=True)
    stats.reset()
    try:
        grad, hint = _resolve_grad(cfg, True, mask, config)
        assert grad == "in-forward" and torch.equal(hint, mask)
        stats.add("vocab", "hint_corrections", 1)
        assert _resolve_grad(cfg, True, mask, config) == ("recompute", None)
    finally:
        stats.reset()


def test_token_split_keeps_every_row() -> None:
    """Without sequence parallelism each ring rank takes a near-even slice of the tokens: the slices
    start at 0, end at the token count and never differ by more than one row."""
    from megatron_peakflat.integration.vocab import _bounds

    assert _bounds(45, 2) == [0, 22, 45]
    assert _bounds(7, 3) == [0, 2, 4, 7]
    assert _bounds(8, 4) == [0, 2, 4, 6, 8]
    assert _bounds(2, 4) == [0, 0, 1, 1, 2]
