"""PipelinedLLEP inside Megatron-Core (CPU, gloo): exact against Megatron's own alltoall dispatcher.

Per world size (1, 2, 4 with EP = world), one process group runs every case: a tiny GPT with MoE
on the local spec (SequentialMLP) is built with Megatron's dispatcher; the same weights are loaded
into a second model built after ``megatron_peakflat.apply`` (PipelinedLLEP); both run the same batch.
The loss and the gradient of every parameter (embeddings, attention, router, every expert, output
layer) must agree to 1e-5 relative, for balanced routing, 95% and 100% of tokens on one expert,
K = 1, 2, 7 chunks, with ``--recompute-modules moe`` and full recompute, with Megatron's fused
weighted swiglu, with shared-expert overlap, with token dropping (capacity factor), under
Megatron DDP with overlapped grad reduce (world 1, 2), and TP=2 + SP with EP=2 (world 4); the per-expert path
with an expert's rows in pieces, at world 1 and 3.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from megatron_peakflat.testing import max_rel_error, run_distributed
from megatron_peakflat.testing.megatron_cpu import skew_router

SEQ, MB, VOCAB = 16, 2, 64  # 32 tokens per rank, top-2: 64 token-expert pairs per rank


def _ref_and_patched(config, dispatch, experts: str = "sequential") -> tuple:  # noqa: ANN001
    """Megatron's own model, then the same weights built with PipelinedLLEP (``dispatch``) patched in."""
    import megatron_peakflat
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.testing import megatron_cpu as mc

    ref = mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, experts=experts)
    megatron_peakflat.apply(PeakflatConfig(dispatch=dispatch, general=GeneralConfig(attention="local")))
    model = mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, experts=experts)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _check_grads(name: str, ref, model, losses: list[torch.Tensor]) -> float:  # noqa: ANN001
    """Loss and every parameter's gradient of ``model`` within 1e-5 of ``ref``; returns the largest error."""
    errs = [max_rel_error(losses[1], losses[0])]
    for (n, mine), theirs in zip(model.named_parameters(), ref.parameters()):
        assert (mine.grad is None) == (theirs.grad is None), (name, n)
        if theirs.grad is not None:
            errs.append(max_rel_error(mine.grad, theirs.grad))
            assert errs[-1] <= 1e-5, (name, n, errs[-1])
    return max(errs)



def _swapped(model, num_layers: int) -> list:  # noqa: ANN001
    """The model's MoE layers, each of which must hold PipelinedLLEP's dispatcher."""
    from megatron_peakflat.integration.dispatch import PeakflatDispatcher

    swapped = [m for m in model.modules() if isinstance(getattr(m, "token_dispatcher", None), PeakflatDispatcher)]
    assert len(swapped) == num_layers, "every MoE layer must hold PipelinedLLEP's dispatcher"
    return swapped


def _both_steps(ref, model, skew: str, router_seed: int, batch_seed: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Skew both routers alike, run one forward and backward of each model on one batch (stats reset
    first); returns [reference loss, patched loss]."""
    from megatron_peakflat import stats
    from megatron_peakflat.testing import megatron_cpu as mc

    skew_router(ref, skew, router_seed)
    skew_router(model, skew, router_seed)
    batch = mc.gpt_batch(SEQ, MB, VOCAB, seed=batch_seed)
    stats.reset()
    losses = []
    for m in (ref, model):
        m.train()
        loss = mc.gpt_loss(m, batch)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _steps(ref, model, skew: str, router_seed: int, batch_seed: int, extra: dict, num_layers: int  # noqa: ANN001
           ) -> list[torch.Tensor]:
    """``_both_steps``; under full recompute twice (gradients add up in both models): the first step's
    recomputes confirm each layer's assumed output gradient, so the second's skip the MoE output, and
    check the gradient without reading it."""
    from megatron_peakflat import stats

    losses = _both_steps(ref, model, skew, router_seed, batch_seed)
    if extra.get("recompute_granularity") == "full":
        assert stats.snapshot()["dispatch"].get("dispatch_recompute_output_skipped") is None
        losses = _both_steps(ref, model, skew, router_seed, batch_seed + 100)
        snap = stats.snapshot()["dispatch"]
        assert snap.get("dispatch_recompute_output_skipped") == num_layers
        # Megatron's residual add passes the checkpoint's output gradient on as it is: no layer's check syncs
        assert snap.get("dispatch_recompute_checks_unsynced") == num_layers, snap
    return losses


def megatron_worker(rank: int, world: int) -> list[tuple[str, float, int]]:
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.testing import megatron_cpu as mc

    mc.install_cpu_shim()
    mc.init_megatron_parallel(ep=world)
    E = 4 * world if world < 4 else 8
    out = []
    cases = [
        ("balanced", 1, {}), ("balanced", 2, {}), ("balanced", 7, {}),
        ("hot95", 2, {}), ("hot95", 7, {}),
        ("all", 1, {}), ("all", 7, {}),
        ("hot95", 2, {"recompute_granularity": "selective", "recompute_modules": ["moe"]}),
        ("all", 2, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    ]
    if world == 1:
        swiglu = {"bias_activation_fusion": True, "gated_linear_unit": True,
                  "activation_func": torch.nn.functional.silu}
        shared = {"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_overlap": True}
        cases = [cases[i] for i in (0, 2, 3, 6, 7, 8)] + [("hot95", 2, swiglu), ("all", 2, shared),
                                                         ("hot95", 7, {"moe_expert_capacity_factor": 0.5})]
    elif world in (2, 3):
        cases = [cases[i] for i in (1, 3, 5, 7, 8)]
    else:
        cases = [cases[i] for i in (4, 6, 7)]
    caps = {1: 64, 2: 32, 7: 10}  # chunk_cap -> K at 32 tokens x top-2
    for skew, K, extra in cases:
        megatron_peakflat.remove()
        torch.manual_seed(1234)
        mc.init_megatron_parallel(ep=world, seed=1234)
        config = mc.tiny_transformer_config(num_moe_experts=E, **extra)
        overlap = world > 1 and K == 7  # the all-to-alls of neighbouring chunks in flight together
        ref_model, model = _ref_and_patched(config, DispatchConfig(
            impl="pipelined-llep", chunk_cap=caps[K], max_chunks=8, alpha=1.0, min_spill=0, imbalance_threshold=1.05,
            overlap=overlap, overlap_min_chunks=0,  # the cap alone sets K (the floor has its own test)
            max_foreign_experts=E))  # no hosting limit: at these tiny shapes 'auto' would move no weights
        swapped = _swapped(model, config.num_layers)
        assert all(m.config.moe_token_dispatcher_type == "alltoall" for m in swapped)
        plain = K != 7  # K=7 cases call the expert modules themselves; the others the plain-ops path
        for m in swapped:
            m.token_dispatcher.plain_experts = plain
        losses = _steps(ref_model, model, skew, 77 + rank, 5 + rank, extra, config.num_layers)
        assert all(m.token_dispatcher._bank.plain == plain for m in swapped)
        snap = stats.snapshot().get("dispatch", {})
        if "moe_expert_capacity_factor" in extra:  # dropped pairs: fewer than 32 x 2 to cut by the cap
            assert 2 <= snap.get("chunks", 0) < K, (K, snap)
        else:
            assert snap.get("chunks") == K, (K, snap)
        assert snap.get("experts") == ("grouped" if plain else "per-expert"), snap
        if "recompute_granularity" in extra:  # each layer's recompute ran its chunks' backward, as assumed
            assert snap.get("dispatch_recompute_calls") == config.num_layers, snap
            assert "dispatch_recompute_corrections" not in snap, snap
        else:
            assert "dispatch_recompute_calls" not in snap, snap
        name = f"{skew},K={K},{'+'.join(k for k in extra if k != 'recompute_method')},overlap={overlap},rank={rank}"
        out.append((name, _check_grads(name, ref_model, model, losses), int(snap.get("spilled_experts", 0))))
        megatron_peakflat.remove()
    if world <= 3:
        out.append(_ddp_case(rank, world, E))
    else:
        out.append(_tp_case(rank))
    mc.destroy_megatron_parallel()
    return out


def _tp_case(rank: int) -> tuple[str, float, int]:
    """TP=2 with sequence parallelism, EP=2, expert TP=1: each rank dispatches its sequence shard."""
    import megatron_peakflat
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.testing import megatron_cpu as mc

    megatron_peakflat.remove()
    mc.init_megatron_parallel(tp=2, ep=2, seed=1234)
    config = mc.tiny_transformer_config(num_moe_experts=4)
    ref, model = _ref_and_patched(config, DispatchConfig(impl="pipelined-llep", chunk_cap=10, min_spill=0,
                                                         imbalance_threshold=1.0))
    batch = mc.gpt_batch(SEQ, MB, VOCAB, seed=3)
    losses = []
    for m in (ref, model):
        loss = mc.gpt_loss(m, batch)
        loss.backward()
        losses.append(loss.detach())
    worst = _check_grads("tp2-ep2", ref, model, losses)
    megatron_peakflat.remove()
    return (f"tp2-ep2-sp,rank={rank}", worst, 0)


def _ddp_case(rank: int, world: int, E: int, experts: str = "sequential") -> tuple[str, float, int]:
    """Megatron DDP with overlapped grad reduce: main_grad after finish_grad_sync matches, 2 iterations."""
    import megatron_peakflat
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.testing import megatron_cpu as mc

    megatron_peakflat.remove()
    mc.init_megatron_parallel(ep=world, seed=1234)
    config = mc.tiny_transformer_config(num_moe_experts=E)
    ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True)
    ref_inner, inner = _ref_and_patched(config, DispatchConfig(impl="pipelined-llep", chunk_cap=10, min_spill=0,
                                                               imbalance_threshold=1.05, overlap=world > 1), experts)
    skew_router(ref_inner, "hot95", 5 + rank)
    skew_router(inner, "hot95", 5 + rank)
    models = [DistributedDataParallel(config, ddp_cfg, m) for m in (ref_inner, inner)]
    worst = 0.0
    for it in range(2):
        batch = mc.gpt_batch(SEQ, MB, VOCAB, seed=40 + it + rank)
        grads = [mc.ddp_main_grads(m, batch) for m in models]
        for n, g in grads[0].items():
            e = max_rel_error(grads[1][n], g)
            assert e <= 1e-5, ("ddp", it, n, e)
            worst = max(worst, e)
    # Without the distributed optimizer DDP leaves the weights where they were allocated: the first
    # grouped call packed each layer's experts into one buffer, so they form one grouped-GEMM run.
    for layer in inner.decoder.layers:
        bank = layer.mlp.token_dispatcher._bank
        order = bank.layout_order()
        runs = bank.call_runs(order, [None] * len(order))
        assert bank._packed and len(runs) == 1, (order, [(r.first, r.n) for r in runs])
    megatron_peakflat.remove()
    return (f"{experts},ddp-overlap,overlap={world > 1},rank={rank}", worst, 0)


def _assert_exact(per_rank: list, world: int, all_on_one: Callable[[str], bool]) -> None:
    """Every case within 1e-5; at world > 1 the all-tokens-on-one-expert cases spilled expert weights."""
    for rows in per_rank:
        for name, err, spilled in rows:
            assert err <= 1e-5, (name, err)
            if world > 1 and all_on_one(name):
                assert spilled > 0, name  # expert weights really moved to helper ranks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_against_megatron_alltoall(world):
    per_rank = run_distributed(megatron_worker, world, timeout=300)
    _assert_exact(per_rank, world, lambda name: name.startswith("all,"))
    if world > 1:
        assert any("overlap=True" in name for name, _, _ in per_rank[0])


def pieces_worker(rank: int, world: int) -> list[tuple[str, float, int, int]]:
    """The per-expert path with an expert's rows run in pieces (``segment_piece_rows``, its floor lowered to 2 rows
    in this process so that 32 tokens split): skewed routing, with the plain ops and with the expert modules."""
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.dispatch import bound
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.testing import megatron_cpu as mc

    mc.install_cpu_shim()
    bound.SEGMENT_PIECE_MIN_ROWS = 2
    E = 4 * world
    out = []
    for skew, plain in (("all", True), ("hot95", False), ("balanced", True)):
        megatron_peakflat.remove()
        torch.manual_seed(4321)
        mc.init_megatron_parallel(ep=world, seed=4321)
        config = mc.tiny_transformer_config(num_moe_experts=E)
        ref, model = _ref_and_patched(config, DispatchConfig(
            impl="pipelined-llep", chunk_cap=32, max_chunks=8, alpha=1.0, min_spill=0, imbalance_threshold=1.05,
            grouped_gemm=False, max_foreign_experts=E))
        for m in _swapped(model, config.num_layers):
            m.token_dispatcher.plain_experts = plain
        losses = _steps(ref, model, skew, 13 + rank, 17 + rank, {}, config.num_layers)
        snap = stats.snapshot()["dispatch"]
        assert snap.get("experts") == "per-expert", snap
        name = f"{skew},plain={plain},rank={rank}"
        out.append((name, _check_grads(name, ref, model, losses), int(snap.get("expert_calls_split", 0)),
                    int(snap.get("spilled_experts", 0))))
        megatron_peakflat.remove()
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_per_expert_pieces_exact_against_megatron(world):
    per_rank = run_distributed(pieces_worker, world, timeout=300)
    for rows in per_rank:
        for name, err, _, _ in rows:
            assert err <= 1e-5, (name, err)
    split: dict[str, int] = {}
    for rows in per_rank:
        for name, _, n, _ in rows:
            key = name.rsplit(",", 1)[0]
            split[key] = split.get(key, 0) + n
    assert all(n > 0 for key, n in split.items() if not key.startswith("balanced")), split  # pieces really ran


def auto_cap_worker(rank: int, world: int) -> list[tuple[str, float, int, int]]:
    """--peakflat-dispatch-chunk-cap auto takes each model's --moe-router-topk: with the auto cap shrunk to
    8 tokens' pairs and at least 16, 32 tokens per rank make K=2 at top-1 (the floor) and K=4 at top-2 and
    top-4; exact against Megatron."""
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.dispatch import config as dispatch_config
    from megatron_peakflat.testing import megatron_cpu as mc

    mc.install_cpu_shim()
    dispatch_config.AUTO_CAP_TOKENS, dispatch_config.AUTO_CAP_MIN_PAIRS = 8, 16  # this process only
    out = []
    for topk in (1, 2, 4):
        megatron_peakflat.remove()
        torch.manual_seed(99)
        mc.init_megatron_parallel(ep=world, seed=99)
        # 8 experts a rank: at top-4 a token still leaves experts out, so "hot95" really skews the routing
        config = mc.tiny_transformer_config(num_moe_experts=8 * world, moe_router_topk=topk,
                                            moe_router_pre_softmax=topk == 1)
        ref, model = _ref_and_patched(config, dispatch_config.DispatchConfig(
            impl="pipelined-llep", min_spill=0, overlap_min_chunks=0))
        losses = _steps(ref, model, "hot95", 21 + rank, 31 + rank, {}, config.num_layers)
        snap = stats.snapshot()["dispatch"]
        out.append((f"top-{topk},rank={rank}", _check_grads(f"top-{topk}", ref, model, losses),
                    snap["chunks"], snap["max_chunk_rows"]))
        megatron_peakflat.remove()
    mc.destroy_megatron_parallel()
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_auto_chunk_cap_follows_the_router_top_k(world):
    per_rank = run_distributed(auto_cap_worker, world, timeout=300)
    for rows in per_rank:
        for (name, err, K, rows_max), topk in zip(rows, (1, 2, 4)):
            cap = max(8 * topk, 16)
            assert err <= 1e-5, (name, err)
            assert K == 32 * topk // cap, (name, K)  # 32 x top-k pairs per source, cut at the cap
            assert rows_max <= world * cap + topk, (name, rows_max)


def grouped_worker(rank: int, world: int) -> list[tuple[str, float, int]]:
    """Megatron's TEGroupedMLP experts (TE's GroupedLinear layout, ``testing.grouped_linear``): PipelinedLLEP
    against Megatron's alltoall dispatcher driving TEGroupedMLP.forward, loss and every gradient."""
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.integration.dispatch import GroupedLinearBank, unsupported_reason
    from megatron_peakflat.testing import megatron_cpu as mc

    mc.install_cpu_shim()
    E = 4 * world if world < 4 else 8
    swiglu = {"bias_activation_fusion": True, "gated_linear_unit": True, "activation_func": torch.nn.functional.silu}
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    cases = [("balanced", 2, {}), ("all", 7, {}), ("hot95", 2, swiglu), ("all", 2, full)]
    caps = {1: 64, 2: 32, 7: 10}
    out = []
    for skew, K, extra in cases:
        megatron_peakflat.remove()
        torch.manual_seed(4321)
        mc.init_megatron_parallel(ep=world, seed=4321)
        config = mc.tiny_transformer_config(num_moe_experts=E, **extra)
        ref_model, model = _ref_and_patched(config, DispatchConfig(
            impl="pipelined-llep", chunk_cap=caps[K], max_chunks=8, min_spill=0, imbalance_threshold=1.05,
            overlap=world > 1 and K == 7, overlap_min_chunks=0, max_foreign_experts=E), experts="grouped")
        swapped = _swapped(model, config.num_layers)
        # Gradient-accumulation fusion (Megatron's default with TE or apex) changes nothing for these experts:
        # their weights' gradients are added into main_grad by PipelinedLLEP, never by the linear modules.
        # (Checked on the reference's layers, which still hold Megatron's alltoall dispatcher.)
        config.gradient_accumulation_fusion = True
        megatron_layers = [m for m in ref_model.modules() if hasattr(m, "token_dispatcher") and hasattr(m, "experts")]
        assert [unsupported_reason(m) for m in megatron_layers] == [None] * config.num_layers
        losses = _steps(ref_model, model, skew, 91 + rank, 11 + rank, extra, config.num_layers)
        assert all(isinstance(m.token_dispatcher._bank, GroupedLinearBank) for m in swapped)
        snap = stats.snapshot().get("dispatch", {})
        assert snap.get("chunks") == K, (K, snap)
        name = f"grouped,{skew},K={K},{'+'.join(k for k in extra if k != 'recompute_method')},rank={rank}"
        out.append((name, _check_grads(name, ref_model, model, losses), int(snap.get("spilled_experts", 0))))
        megatron_peakflat.remove()
    if world <= 2:
        out.append(_ddp_case(rank, world, E, experts="grouped"))
    mc.destroy_megatron_parallel()
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_te_grouped_experts_exact_against_megatron(world):
    per_rank = run_distributed(grouped_worker, world, timeout=300)
    _assert_exact(per_rank, world, lambda name: ",all," in name)


def dispatch_recompute_worker(rank: int, world: int, extra: dict) -> tuple[list[dict], list[bool], float, list[str]]:
    """Two steps of both models under full recompute with ``extra``: each step's dispatch stats, whether each
    MoE layer stopped fusing, the largest loss/gradient error (nan with dropout, whose masks the two models
    draw apart), and the log lines."""
    import logging

    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.testing import megatron_cpu as mc

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megatron_peakflat").addHandler(handler)
    logging.getLogger("megatron_peakflat").setLevel(logging.INFO)
    mc.install_cpu_shim()
    torch.manual_seed(1234)
    mc.init_megatron_parallel(ep=world, seed=1234)
    config = mc.tiny_transformer_config(num_moe_experts=4, recompute_granularity="full", recompute_method="uniform",
                                        **extra)
    ref, model = _ref_and_patched(config, DispatchConfig(
        impl="pipelined-llep", chunk_cap=32, max_chunks=8, min_spill=0, imbalance_threshold=1.05))
    swapped = _swapped(model, config.num_layers)
    snaps = []
    for step in range(2):
        losses = _both_steps(ref, model, "hot95", 77 + rank, 5 + rank + 100 * step)
        snaps.append(dict(stats.snapshot().get("dispatch", {})))
    err = float("nan") if config.hidden_dropout else _check_grads(str(extra), ref, model, losses)
    off = [bool(getattr(m.token_dispatcher, "peakflat_fuse_off", False)) for m in swapped]
    megatron_peakflat.remove()
    mc.destroy_megatron_parallel()
    return snaps, off, err, lines


def test_dispatch_recompute_with_two_moe_layers_in_one_checkpoint():
    """With both MoE layers in one checkpoint (--recompute-num-layers 2) the last one gets the checkpoint's
    output gradient: one fused recompute per checkpoint and step, never corrected, the output skipped from
    the second step on, and the gradients exact."""
    snaps, off, err, _ = run_distributed(dispatch_recompute_worker, 1, {"recompute_num_layers": 2}, timeout=300)[0]
    assert err <= 1e-5, err
    assert off == [False, False]
    for step, snap in enumerate(snaps):
        assert snap.get("dispatch_recompute_calls") == 1, (step, snap)
        assert "dispatch_recompute_corrections" not in snap, (step, snap)
    assert snaps[1].get("dispatch_recompute_output_skipped") == 1, snaps[1]


def test_dispatch_recompute_is_off_under_hidden_dropout():
    """Dropout after the MoE scales its output gradient: with hidden_dropout > 0 no layer fuses its recompute,
    and the log says why."""
    snaps, off, _, lines = run_distributed(dispatch_recompute_worker, 1,
                                           {"recompute_num_layers": 1, "hidden_dropout": 0.1}, timeout=300)[0]
    assert off == [True, True]
    for step, snap in enumerate(snaps):
        assert "dispatch_recompute_calls" not in snap, (step, snap)
    assert any("fused recompute off" in line and "hidden_dropout=0.1" in line for line in lines), lines


def handback_worker(rank: int, world: int) -> list[str]:
    import megatron_peakflat
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.integration.dispatch import PeakflatDispatcher
    from megatron_peakflat.testing import megatron_cpu as mc

    mc.install_cpu_shim()
    mc.init_megatron_parallel()
    megatron_peakflat.apply(PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep"),
                                           general=GeneralConfig(attention="local")))
    kinds = []
    for extra in ({}, {"moe_token_dispatcher_type": "allgather"}):
        config = mc.tiny_transformer_config(**extra)
        model = mc.build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ)
        kinds.append(sorted({type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")
                             and m.token_dispatcher is not None}))
        if not extra:
            assert any(isinstance(m.token_dispatcher, PeakflatDispatcher) for m in model.modules()
                       if hasattr(m, "token_dispatcher"))
    megatron_peakflat.remove()
    return kinds


def test_unsupported_configuration_hands_back_to_megatron():
    kinds = run_distributed(handback_worker, 1, timeout=120)[0]
    assert kinds[0] == ["PeakflatDispatcher"]
    assert kinds[1] == ["MoEAllGatherTokenDispatcher"]  # not alltoall: Megatron's own dispatcher stays


def _api_built_layer(experts=None, tp_size: int = 1, dispatcher=None, **extra):
    """A stand-in MoELayer as ``unsupported_reason`` reads it: config, token dispatcher and experts."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if dispatcher is None:
        dispatcher = object.__new__(MoEAlltoAllTokenDispatcher)
        dispatcher.tp_size = tp_size
    config = SimpleNamespace(**{"moe_token_dispatcher_type": "alltoall", "gradient_accumulation_fusion": False,
                                "bias_activation_fusion": False, **extra})
    return SimpleNamespace(config=config, token_dispatcher=dispatcher,
                           experts=object.__new__(SequentialMLP) if experts is None else experts)


def _sequential_experts(fc1_type: type | None = None, names=("linear_fc1.weight", "linear_fc2.weight"), **config):
    """A SequentialMLP stand-in whose first expert has linear layers of ``fc1_type`` (default Megatron's own)."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = object.__new__(SequentialMLP)
    mlp = SimpleNamespace(linear_fc1=object.__new__(fc1_type or ColumnParallelLinear),
                          linear_fc2=object.__new__(RowParallelLinear),
                          named_parameters=lambda: [(n, None) for n in names])
    experts.__dict__.update(local_experts=[mlp], config=_api_built_layer(**config).config)
    return experts


@pytest.mark.parametrize("extra, reason", [
    ({}, None),
    (dict(moe_pad_expert_input_to_capacity=True), "pad-to-capacity"),
    (dict(moe_router_padding_for_quantization=True), "router padding for quantization"),
    (dict(fp8="hybrid"), "fp8"),
    (dict(fp4="nvfp4"), "fp4"),
    (dict(moe_latent_size=512), "latent MoE projections"),
    (dict(overlap_dispatch_backward_with_experts_wgrad=True), "dispatch/wgrad overlap"),
    (dict(delay_wgrad_compute=True), "delayed wgrad"),
    (dict(add_bias_linear=True), "expert biases"),
    (dict(cuda_graph_impl="transformer_engine"), "CUDA graphs"),
    (dict(cuda_graph_impl="none"), None),
    (dict(transformer_impl="inference_optimized"), "inference-optimized transformer"),
    (dict(tp_size=2), "expert tensor parallelism > 1"),
])
def test_a_layer_built_through_the_api_keeps_megatrons_dispatcher_and_says_why(extra, reason):
    """A MoE layer built through the API (no start-up check) that PipelinedLLEP cannot run keeps Megatron's
    dispatcher, and the reason names what is in the way; a layer with none of them is taken."""
    from megatron_peakflat.integration.dispatch import unsupported_reason

    assert unsupported_reason(_api_built_layer(**extra)) == reason


def test_the_reason_names_a_dispatcher_or_experts_it_does_not_run():
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from megatron_peakflat.integration.dispatch import unsupported_reason

    allgather = _api_built_layer(dispatcher=object.__new__(MoEAllGatherTokenDispatcher),
                                 moe_token_dispatcher_type="allgather")
    assert unsupported_reason(allgather) == "moe_token_dispatcher_type is 'allgather', not 'alltoall'"
    other = _api_built_layer(experts=torch.nn.Identity())
    assert unsupported_reason(other) == "experts are Identity; SequentialMLP and TEGroupedMLP are supported"


@pytest.mark.parametrize("experts_kwargs, why", [
    (dict(), None),
    (dict(fc1_type=torch.nn.Linear), "linear layers Linear/RowParallelLinear"),
    (dict(names=("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight")), "expert parameters other than two weights"),
    (dict(use_te_activation_func=True), "use_te_activation_func (Transformer Engine activation modules)"),
    (dict(bias_activation_fusion=True, gated_linear_unit=False, activation_func=torch.nn.functional.gelu),
     "bias_activation_fusion without swiglu/quick-geglu"),
    (dict(expert_tensor_parallel_size=2), "expert tensor parallelism"),
])
def test_gradient_accumulation_fusion_is_refused_only_for_experts_run_through_their_modules(experts_kwargs, why):
    """With gradient-accumulation fusion the experts' linear layers would write main_grad in their own
    backward, so experts PipelinedLLEP cannot run as plain ops on their weights keep Megatron's dispatcher;
    without the fusion they are run through their modules and taken."""
    from megatron_peakflat.integration.dispatch import unsupported_reason

    experts = _sequential_experts(**experts_kwargs)
    fused = _api_built_layer(experts=experts, gradient_accumulation_fusion=True)
    expected = None if why is None else f"gradient-accumulation fusion with experts run through their modules ({why})"
    assert unsupported_reason(fused) == expected
    assert unsupported_reason(_api_built_layer(experts=experts)) is None


def test_startup_errors_name_the_flag():
    from types import SimpleNamespace

    from megatron_peakflat import PeakflatConfig, PeakflatConfigError
    from megatron_peakflat.dispatch.config import DispatchConfig

    cfg = PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep"))
    base = dict(num_experts=8, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
                expert_tensor_parallel_size=1)
    for bad, match in ((dict(num_experts=None), "no MoE"), (dict(expert_tensor_parallel_size=2), "expert tensor"),
                       (dict(expert_model_parallel_size=3), "divisible"),
                       (dict(moe_token_dispatcher_type="flex"), "alltoall"),
                       (dict(moe_pad_expert_input_to_capacity=True), "capacity"),
                       (dict(add_bias_linear=True), "--disable-bias-linear"), (dict(fp8="hybrid"), "--fp8-format"),
                       (dict(delay_wgrad_compute=True), "--delay-wgrad-compute"),
                       (dict(moe_latent_size=64), "--moe-latent-size"),
                       (dict(cuda_graph_impl="local"), "--cuda-graph-impl"),
                       (dict(use_te_activation_func=True), "--use-te-activation-func"),
                       (dict(moe_single_grouped_weight=True), "--moe-single-grouped-weight"),
                       (dict(transformer_impl="inference_optimized"), "inference_optimized"),
                       (dict(fine_grained_activation_offloading=True, offload_modules=["moe_act"]), "moe_act")):
        with pytest.raises(PeakflatConfigError, match="--peakflat-dispatch") as e:
            cfg.validate(SimpleNamespace(**{**base, **bad}))
        assert match in str(e.value)
    cfg.validate(SimpleNamespace(**base))
    # Megatron's defaults with Transformer Engine and apex: TE spec, grouped GEMM experts, gradient-accumulation
    # fusion; supported, so no error.
    cfg.validate(SimpleNamespace(**base, add_bias_linear=False, transformer_impl="transformer_engine",
                                 moe_grouped_gemm=True, gradient_accumulation_fusion=True, cuda_graph_impl="none",
                                 fine_grained_activation_offloading=True, offload_modules=["attn_norm"]))
