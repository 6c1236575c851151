"""The moe-release fix (integration/moe_release.py) against Megatron's own MoE layers on CPU. Under recompute (full,
or ``--recompute-modules moe``), Megatron's alltoall and allgather dispatchers keep each MoE layer's recomputed
checkpoint input and its gradient alive after that layer's backward, through the step; with the fix they are freed,
the dispatchers hold no routing state between forwards, and the loss and every gradient are bitwise the same."""

from __future__ import annotations

import gc

import pytest

from megatron_peakflat.testing import run_distributed

S, B, H, V = 16, 2, 72, 1009
TH = S * B * H * 4  # one [tokens, hidden] fp32 tensor: no other storage of the tiny model has this size
LAYERS = 4
REGIMES = [("alltoall", "full"), ("allgather", "full"), ("alltoall", "moe"), ("allgather", "moe")]


def _run(rank: int, world: int) -> list[dict]:
    import torch

    from megatron_peakflat.integration import registry
    from megatron_peakflat.integration.moe_release import PER_FORWARD
    from megatron_peakflat.testing.live_bytes import LiveBytesMeter
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, gpt_batch, gpt_loss, megatron_on_cpu,
                                                        recompute_config, skew_router, tiny_transformer_config)

    out = []
    with megatron_on_cpu(rank, ep=world):
        for dispatcher, recompute in REGIMES:
            runs = []
            for skew in ("balanced", "all"):
                for fix in (False, True):
                    torch.manual_seed(7)
                    config = tiny_transformer_config(hidden_size=H, num_layers=LAYERS,
                                                     num_moe_experts=6 if world == 3 else 4,  # a multiple of EP
                                                     moe_token_dispatcher_type=dispatcher, **recompute_config(recompute))
                    model = build_tiny_gpt(config, vocab_size=V, seq_len=S).train()
                    skew_router(model, skew, seed=3 + rank)
                    if fix:
                        registry.apply_patches({"moe-release"})
                    held: list[int] = []
                    try:
                        with LiveBytesMeter() as meter:
                            def alive(born_by: int) -> int:
                                return sum(1 for n, born in meter._tracked.values() if n == TH and born <= born_by)

                            def settled(born_by: int, most: int) -> int:
                                # a collective's buffers die on gloo's worker thread, a moment after it returns
                                meter.wait_for(lambda: alive(born_by) <= most)
                                return alive(born_by)

                            def watch(_m, _args, output):
                                h = output[0] if isinstance(output, tuple) else output
                                if torch.is_grad_enabled() and h.requires_grad:  # the recompute, in backward
                                    # [tokens, hidden] storages from the forward still alive when layer 0's backward
                                    # begins: its own checkpoint input, and what the layers above failed to free
                                    h.register_hook(lambda g: held.append(
                                        settled(forward_end, 1 if fix else LAYERS)))

                            forward_end = 0
                            layer0 = model.decoder.layers[0]
                            handle = layer0.register_forward_hook(watch) if recompute == "full" else None
                            loss = gpt_loss(model, gpt_batch(S, B, V, seed=5 + rank))
                            forward_end = meter.allocations
                            value = loss.detach().clone()
                            state = [name for layer in model.decoder.layers for name in PER_FORWARD
                                     if getattr(layer.mlp.token_dispatcher, name, None) is not None]
                            loss.backward()
                            if handle is not None:
                                handle.remove()
                            del loss
                            gc.collect()
                            # every storage the step left, but the parameters' gradients and the loss's value
                            kept = {p.grad.untyped_storage()._cdata for p in model.parameters() if p.grad is not None}
                            kept.add(value.untyped_storage()._cdata)

                            def left_behind() -> int:
                                return sum(n for k, (n, _) in meter._tracked.items() if k not in kept)

                            after = settled(meter.allocations, 0 if fix else 2 * LAYERS)
                            if fix:
                                meter.wait_for(lambda: left_behind() < TH)
                            left = left_behind()
                    finally:
                        if fix:
                            registry.remove_patches()
                    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                    runs.append(dict(skew=skew, fix=fix, grads=grads, held=held, after=after, state=len(state),
                                     loss=value, left=left))
            out += [{"regime": (dispatcher, recompute), "skew": r["skew"], "fix": r["fix"], "held": r["held"],
                     "after": r["after"], "state": r["state"], "left": r["left"], **_compare(r, runs)} for r in runs]
    return out


def _compare(r: dict, runs: list[dict]) -> dict:
    """Loss and every gradient against the same routing's run without the fix (the results carry only this)."""
    import torch

    ref = next(x for x in runs if x["skew"] == r["skew"] and not x["fix"])
    same = torch.equal(r["loss"], ref["loss"]) and r["grads"].keys() == ref["grads"].keys() and all(
        torch.equal(r["grads"][k], ref["grads"][k]) for k in ref["grads"])
    return {"same": same, "n_grads": len(r["grads"])}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_moe_release_frees_the_recomputed_inputs_and_changes_no_gradient(world):
    """Four MoE layers, EP = world, balanced routing and every token on one expert, each dispatcher under full
    and MoE recompute. Without the fix, after the backward each layer still holds its checkpoint input and that
    input's gradient (8 [tokens, hidden] tensors), and under full recompute the three layers above layer 0 still
    hold their inputs when its backward begins; with it, none after the backward and only layer 0's own input
    then, no dispatcher holds probabilities or routing maps after the forward, and the step leaves nothing the size
    of the tokens but the parameters' gradients. Loss and every gradient bitwise equal either way."""
    results = run_distributed(_run, world, timeout=400)
    assert len(results) == world
    for rank, runs in enumerate(results):
        assert len(runs) == 4 * len(REGIMES)
        for r in runs:
            assert r["same"] and r["n_grads"] > 10, (rank, r)
            if r["fix"]:
                # nothing the size of the tokens is left: the rotary table and a few counts, under one [T, H]
                assert r["after"] == 0 and r["state"] == 0 and r["left"] < TH, (rank, r)
            else:
                assert r["after"] == 2 * LAYERS and r["state"] > 0 and r["left"] >= 2 * LAYERS * TH, (rank, r)
            if r["regime"][1] == "full":
                assert r["held"] == ([1] if r["fix"] else [1 + LAYERS - 1]), (rank, r)
