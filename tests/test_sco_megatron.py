"""SCO inside Megatron-Core on CPU: GPTModel (MoE, local spec) under full recompute, through
Megatron's pipeline schedule, SCO on versus the unpatched path: loss and every gradient bitwise
equal; boundaries packed = layers per stage / recompute_num_layers x microbatches; budget held."""

from __future__ import annotations

import torch

from megatron_peakflat.testing.distributed import run_distributed

S, MB, V = 16, 2, 128


def _one_run(config, model, batches, pp: int):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for p in model.parameters():
        p.grad = None

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        out = m(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

        def loss_func(output_tensor):
            mask = b["loss_mask"]
            loss = (output_tensor.float() * mask).sum() / mask.sum()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=S, micro_batch_size=MB, forward_only=False)
    losses = torch.stack([d["lm loss"] for d in losses]) if losses else torch.empty(0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads


def _case(rank, pp, *, layers, method, rnl, microbatches, budget=None, moe=True):
    import megatron_peakflat
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.integration import recompute as sco_integration
    from megatron_peakflat.recompute.config import SCOConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.testing.megatron_cpu import build_tiny_gpt, gpt_batch, tiny_transformer_config
    from megatron.core import parallel_state

    over = dict(num_layers=layers, recompute_granularity="full", recompute_method=method,
                recompute_num_layers=rnl, pipeline_dtype=torch.float32)
    if not moe:
        over["num_moe_experts"] = None
    config = tiny_transformer_config(**over)
    torch.manual_seed(7)
    model = build_tiny_gpt(config, vocab_size=V, seq_len=S, moe=moe)
    model.train()
    batches = [gpt_batch(S, MB, V, seed=100 + i) for i in range(microbatches)]

    ref = _one_run(config, model, batches, pp)  # unpatched Megatron
    megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True, budget=budget, prefetch=1),
                                           general=GeneralConfig(attention="local")))
    sco_integration.reset()
    try:
        got = _one_run(config, model, batches, pp)
        off = sco_integration.offloader()
    finally:
        megatron_peakflat.remove()

    assert torch.equal(got[0], ref[0]), (got[0], ref[0])
    assert got[1].keys() == ref[1].keys() and len(ref[1]) > 0
    for n in ref[1]:
        assert torch.equal(got[1][n], ref[1][n]), n
    local_layers = layers // pp
    chunks = local_layers // rnl if method == "uniform" else rnl
    assert off is not None and off.packed == chunks * microbatches, (off.packed, chunks, microbatches)
    first_stage = parallel_state.is_pipeline_first_stage()
    boundary = S * MB * config.hidden_size * 4
    assert off.pool.in_use == 0 and off.offloaded_bytes_live == 0
    assert off.pool.reserved <= off.pool.budget
    if budget is None:
        per_group = chunks - 1 - (0 if first_stage else 1)  # last kept; a later stage's received input kept
        assert off.offloaded == max(per_group, 0) * microbatches, (off.offloaded, per_group)
    else:
        assert off.pool.peak_in_use <= budget and off.offloaded >= 1
    return {"rank": rank, "packed": off.packed, "offloaded": off.offloaded, "params": len(ref[1]),
            "peak_boundaries": off.pool.peak_in_use / boundary}


def _rank_main(rank, world_size, pp):
    from megatron_peakflat.testing.megatron_cpu import destroy_megatron_parallel, init_megatron_parallel, install_cpu_shim

    install_cpu_shim()
    init_megatron_parallel(pp=pp)
    try:
        out = []
        if pp == 1:
            out.append(_case(rank, pp, layers=4, method="uniform", rnl=1, microbatches=2))
            out.append(_case(rank, pp, layers=4, method="uniform", rnl=2, microbatches=2, moe=False))
            out.append(_case(rank, pp, layers=4, method="block", rnl=3, microbatches=2))
            out.append(_case(rank, pp, layers=4, method="uniform", rnl=1, microbatches=2, budget=S * MB * 64 * 4 + 100))
        else:
            out.append(_case(rank, pp, layers=6, method="uniform", rnl=1, microbatches=4))
            out.append(_case(rank, pp, layers=6, method="uniform", rnl=1, microbatches=3, budget=2 * S * MB * 64 * 4))
        return out
    finally:
        destroy_megatron_parallel()


def test_sco_megatron_world1():
    (res,) = run_distributed(_rank_main, 1, 1, timeout=240)
    assert [r["packed"] for r in res] == [8, 4, 6, 8]
    assert [r["offloaded"] for r in res] == [6, 2, 4, 2]
    assert res[3]["peak_boundaries"] == 1  # budget of one boundary (plus change)


def test_sco_megatron_world2_pp2():
    res = run_distributed(_rank_main, 2, 2, timeout=240)
    assert [r["packed"] for r in res[0]] == [12, 9] and [r["packed"] for r in res[1]] == [12, 9]
    assert res[0][0]["offloaded"] == 8 and res[1][0]["offloaded"] == 4
    # stage 0 has two microbatches in flight under 1F1B, 2 offloadable boundaries each: the budget of 2 binds
    assert res[0][1]["peak_boundaries"] == 2 and res[1][1]["peak_boundaries"] == 1
