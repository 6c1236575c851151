"""The moe-release fix (integration/moe_release.py) against Megatron's own MoE layers on CPU: under full recompute,
Megatron's alltoall dispatcher keeps each MoE layer's recomputed checkpoint input and its gradient alive after
that layer's backward; with the fix they are freed, and the loss and every gradient are bitwise the same."""

from __future__ import annotations

import pytest

from megatron_peakflat.testing import run_distributed

S, B, H, V = 16, 2, 72, 1009
TH = S * B * H * 4  # one [tokens, hidden] fp32 tensor: no other storage of the tiny model has this size


def _run(rank: int, world: int, layers: int) -> list[dict]:
    import torch

    from megatron_peakflat.integration import registry
    from megatron_peakflat.testing.live_bytes import LiveBytesMeter
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel, gpt_batch,
                                                        gpt_loss, init_megatron_parallel, install_cpu_shim,
                                                        skew_router, tiny_transformer_config)
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    install_cpu_shim()
    init_megatron_parallel(ep=world)
    init_num_microbatches_calculator(rank, None, 1, 1, 1)
    out = []
    try:
        for skew in ("balanced", "all"):
            for fix in (False, True):
                torch.manual_seed(7)
                config = tiny_transformer_config(hidden_size=H, num_layers=layers, recompute_granularity="full",
                                                 recompute_method="uniform", recompute_num_layers=1)
                model = build_tiny_gpt(config, vocab_size=V, seq_len=S).train()
                skew_router(model, skew, seed=3 + rank)
                if fix:
                    registry.apply_patches({"moe-release"})
                held: list[int] = []
                try:
                    with LiveBytesMeter() as meter:
                        def watch(_m, _args, output):
                            h = output[0] if isinstance(output, tuple) else output
                            if torch.is_grad_enabled() and h.requires_grad:  # the recompute, in backward
                                # [tokens, hidden] storages from the forward still alive when layer 0's backward
                                # begins: its own checkpoint input, and what the layers above failed to free
                                h.register_hook(lambda g: held.append(sum(
                                    1 for n, born in meter._tracked.values() if n == TH and born <= forward_end[0])))

                        forward_end = [0]
                        handle = model.decoder.layers[0].register_forward_hook(watch)
                        loss = gpt_loss(model, gpt_batch(S, B, V, seed=5 + rank))
                        forward_end[0] = meter.allocations
                        loss.backward()
                        handle.remove()
                finally:
                    if fix:
                        registry.remove_patches()
                grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                out.append(dict(skew=skew, fix=fix, loss=loss.detach().clone(), grads=grads, held=held))
    finally:
        destroy_num_microbatches_calculator()
        destroy_megatron_parallel()
    return [{"skew": r["skew"], "fix": r["fix"], "held": r["held"], **_compare(r, out)} for r in out]


def _compare(r: dict, runs: list[dict]) -> dict:
    """Loss and every gradient against the same routing's run without the fix (the results carry only these)."""
    import torch

    ref = next(x for x in runs if x["skew"] == r["skew"] and not x["fix"])
    same = torch.equal(r["loss"], ref["loss"]) and r["grads"].keys() == ref["grads"].keys() and all(
        torch.equal(r["grads"][k], ref["grads"][k]) for k in ref["grads"])
    return {"same": same, "n_grads": len(r["grads"]), "loss": float(r["loss"])}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_release_frees_the_recomputed_inputs_and_changes_no_gradient(world):
    """Four MoE layers, EP = world, balanced routing and every token on one expert. Without the fix, each of the
    three layers above layer 0 still holds its checkpoint input when layer 0's backward begins; with it, only
    layer 0's own input (the embedding output) is alive. Loss and every gradient bitwise equal either way."""
    results = run_distributed(_run, world, 4, timeout=300)
    assert len(results) == world
    for rank, runs in enumerate(results):
        assert len(runs) == 4
        for r in runs:
            assert r["same"] and r["n_grads"] > 10, (rank, r)
            assert len(r["held"]) == 1, (rank, r)
        off = {r["skew"]: r["held"][0] for r in runs if not r["fix"]}
        on = {r["skew"]: r["held"][0] for r in runs if r["fix"]}
        assert on == {"balanced": 1, "all": 1}, (rank, on)
        assert all(off[s] >= on[s] + 3 for s in off), (rank, off, on)
