"""Context parallelism with every component on, against unpatched Megatron at CP 1: Megatron's GPTModel (MoE, local
spec, full recompute) on CPU with gloo, through Megatron's DDP, DistributedOptimizer and pipeline schedule.

The patched run has all four components on (--peakflat-dispatch pipelined-llep, --peakflat-vocab ring-dtp,
--peakflat-sco, --peakflat-optimizer offload-stream) and --peakflat-attention sdpa at --context-parallel-size CP,
each rank fed its share of the sequence (chunks r and 2CP-1-r, as Megatron's get_batch_on_this_cp_rank cuts it).
The reference is unpatched Megatron (DotProductAttention, the alltoall dispatcher, its own output layer and loss,
torch AdamW in the DistributedOptimizer) at CP 1 on the same ranks, each fed the whole sequence (the same batch on
every data-parallel rank, so both runs train on one global batch). After one step the loss, every parameter's
gradient (reduced over DP x CP) and every parameter after the optimizer step must agree within 1e-5.

Cases (grouped per launched world): world 2: CP 2; CP 2 with an MTP layer (against CP 1 with the MTP loss counted
over the whole sequence, and against Megatron's own per-rank MTP reduction at CP 2); CP 2 with every token on one
expert and with most tokens on one expert; a resume of the CP 2 run from a checkpoint saved after its first step.
World 4: CP 4 (per-token loss, a masked tail, the dataloader's explicit mask); CP 2 x EP 2; CP 2 x TP 2 with
sequence parallelism. And the pretrain entry at CP 2 on two ranks against CP 1, resumed from its CP 2 checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field

import pytest
import torch

from megatron_peakflat.planner.model import RunConfig
from megatron_peakflat.testing import max_rel_error, run_distributed
from megatron_peakflat.testing.subproc import TINY_GPT_ARGS, logged, run_module
from tests.conftest import needs_pretrain_entry

S, MB, V = 16, 2, 128
HIDDEN = 64  # tiny_transformer_config's
TOL = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    cp: int
    tp: int = 1
    ep: int = 1
    mtp: int = 0
    skew: float = 0.0
    """Added to expert 1's router logit for every token: 8 sends every token there, 0.15 most of them."""
    per_token_loss: bool = False
    """Megatron's --calculate-per-token-loss; the batch then keeps gpt_batch's masked tail (unequal token counts
    per CP rank), which the default mean-of-means reduction would weigh differently from CP 1."""
    explicit_mask: bool = False
    """The dataloader's [b, 1, s, s] causal mask, cut to each rank's query rows, in place of none."""
    steps: int = 1
    resume: bool = False
    reference_at_cp: bool = False
    """Compare with Megatron at the same CP (its own layers, with only the SDPA attention, which Megatron needs for
    CP without Transformer Engine and which the other cases check against CP 1) instead of CP 1."""
    global_mtp_tokens: bool = False
    """Megatron divides each MTP loss by the tokens of this CP rank (``roll_tensor``'s count), so under CP the MTP
    gradients are a mean of per-rank means, not CP 1's mean (rank 0 holds the sequence's last token, which the roll
    masks): 12% apart on one MTP layer here. With this, both runs (a test-only wrap of ``roll_tensor``) count the
    whole sequence's tokens, which makes CP 1 the reference again for the MTP heads."""
    extra: dict = field(default_factory=dict)
    seq: int = S
    """Tokens per sequence: a multiple of 2 x CP (Megatron's load-balanced chunks)."""


WORLD_CASES = {
    2: [Case("cp2", 2, steps=2, resume=True), Case("cp2-mtp", 2, mtp=1, explicit_mask=True, global_mtp_tokens=True),
        Case("cp2-mtp-megatrons-cp-loss", 2, mtp=1, reference_at_cp=True),
        Case("cp2-all-tokens-on-one-expert", 2, skew=8.0), Case("cp2-skewed", 2, skew=0.15)],
    # odd CP; with every token on one expert the reference is Megatron at CP 3: there the saturated router's
    # gradient of Megatron at CP 3 is itself about 8e-5 (relative) from Megatron's at CP 1 in fp32
    3: [Case("cp3", 3, seq=24), Case("cp3-all-tokens-on-one-expert", 3, seq=24, skew=8.0, reference_at_cp=True)],
    4: [Case("cp4", 4, per_token_loss=True, explicit_mask=True), Case("cp2xep2", 2, ep=2),
        Case("cp2xtp2-sp", 2, tp=2)],
}


def _components():
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.optimizer.config import OptimizerConfig
    from megatron_peakflat.sco.config import SCOConfig
    from megatron_peakflat.vocab.config import VocabConfig

    return PeakflatConfig(
        dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=8, max_chunks=8, min_spill=0),  # several chunks
        vocab=VocabConfig(impl="ring-dtp", block_size=16),
        sco=SCOConfig(enabled=True, prefetch=1),
        optimizer=OptimizerConfig(impl="offload-stream", bucket=3000, engine="gpu", slots=2),
        general=GeneralConfig(attention="sdpa"))


def _skew(model, bump: float) -> None:
    """Add ``bump`` to expert 1's router logit for every token: position-independent, so the CP run's routing is the
    reference's token for token."""
    if not bump:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    for m in model.modules():
        if isinstance(m, TopKRouter):
            def skewed(x, gating=m.gating):
                logits = gating(x)
                add = torch.zeros(logits.shape[-1], dtype=logits.dtype)
                add[1] = bump
                return logits + add

            m.gating = skewed


def _batch(case: Case, cp_rank: int | None, seed: int) -> dict:
    """The whole batch (``cp_rank`` None) or that CP rank's share of it."""
    from megatron_peakflat.attention.context_parallel import split_sequence
    from megatron_peakflat.testing.megatron_cpu import gpt_batch

    b = gpt_batch(case.seq, MB, V, seed=seed)
    if not case.per_token_loss:
        b["loss_mask"] = torch.ones_like(b["loss_mask"])
    if cp_rank is None:
        return b
    out = {k: split_sequence(b[k], case.cp, cp_rank, dim=1) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    out["attention_mask"] = split_sequence(b["attention_mask"], case.cp, cp_rank, dim=2) if case.explicit_mask else None
    return out


def _gather_reduced_grads(ddp) -> None:
    """Under the distributed optimizer each rank's grad buffer holds its own shard reduced; all-gather the shards so
    that every parameter's main_grad is the reduced gradient on every rank (the step reads only its own shard)."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for bg in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]:
        group = bg.intra_distributed_optimizer_instance_group
        size, rank = group.size(), group.rank()
        for bucket in bg.buckets:
            mine = shard_buffer(bucket.grad_data, size)[rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, mine, group=group)


def _build(case: Case, cp: int, offload: bool, seed: int = 7):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_peakflat.testing.megatron_cpu import build_tiny_gpt, recompute_config, tiny_transformer_config

    destroy_moe_metrics_tracker()
    over = dict(recompute_config("full"), context_parallel_size=cp,
                calculate_per_token_loss=case.per_token_loss, **case.extra)
    if case.mtp:
        over.update(mtp_num_layers=case.mtp, mtp_loss_scaling_factor=0.3)
    config = tiny_transformer_config(**over)
    config.finalize_model_grads_func = finalize_model_grads
    torch.manual_seed(seed)
    model = build_tiny_gpt(config, vocab_size=V, seq_len=case.seq)
    model.train()
    _skew(model, case.skew)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                        grad_reduce_in_fp32=True), model)
    offload = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True,
                   optimizer_offload_fraction=1.0) if offload else {}
    # Adam's eps at 1e-3 keeps the update's dependence on the gradient linear: at 1e-8 the first step is about
    # lr x sign(g), and an element whose gradient is at rounding level (the CP run sums in another order) would
    # move a whole lr either way
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=2e-3, weight_decay=0.1, clip_grad=1.0,
                                                 adam_eps=1e-3, use_distributed_optimizer=True, bf16=False,
                                                 **offload), [ddp])
    return config, ddp, opt


def _step(case: Case, config, ddp, opt, batch: dict) -> tuple[float, dict, dict]:
    """One step through Megatron's schedule: (the loss over the whole batch, reduced gradients, parameters after)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_peakflat.cli.pretrain import loss_func

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], loss_mask=b["loss_mask"])
        return out, lambda t: loss_func(b["loss_mask"], t)

    ddp.zero_grad_buffer()
    opt.zero_grad()
    reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=[ddp],
                                          num_microbatches=1, seq_length=batch["tokens"].shape[1],
                                          micro_batch_size=MB, forward_only=False)
    total = torch.stack([r["lm loss"] for r in reports]).sum(0).double()
    # Megatron's training log sums the loss and the token count over DP x CP; every DP rank saw the same batch
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    _gather_reduced_grads(ddp)
    grads = {n: p.main_grad.detach().clone() for n, p in ddp.named_parameters()}
    ok, _, _ = opt.step()
    assert ok
    params = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    return float(total[0] / total[1]), grads, params


def _worst(got: dict, want: dict) -> tuple[float, str]:
    assert got.keys() == want.keys() and want, (sorted(set(got) ^ set(want)))
    return max((max_rel_error(got[k], want[k]), k) for k in want)


def _init(case: Case, cp: int, rank: int):
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel

    init_megatron_parallel(tp=case.tp, ep=case.ep, context_parallel_size=cp, seed=1234)
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(rank, None, MB * dp, MB, dp)


def _run_case(rank: int, case: Case, ckpt_dir: str) -> dict:
    import megatron_peakflat
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_peakflat import stats
    from megatron_peakflat.integration import sco as sco_integration
    from megatron_peakflat.integration.dispatch import PeakflatDispatcher
    from megatron_peakflat.optimizer import OffloadStreamAdamW

    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig

    seeds = [100 + i for i in range(case.steps)]
    # 1. unpatched Megatron at CP 1, the whole sequence on every rank (or at the case's CP, its share)
    megatron_peakflat.remove()
    if case.reference_at_cp:
        _init(case, case.cp, rank)
        megatron_peakflat.apply(PeakflatConfig(general=GeneralConfig(attention="sdpa")))
        try:
            config, ddp, opt = _build(case, case.cp, offload=False)
            cp_rank = parallel_state.get_context_parallel_rank()
            ref = [_step(case, config, ddp, opt, _batch(case, cp_rank, s)) for s in seeds]
        finally:
            megatron_peakflat.remove()
    else:
        _init(case, 1, rank)
        config, ddp, opt = _build(case, 1, offload=False)
        ref = [_step(case, config, ddp, opt, _batch(case, None, s)) for s in seeds]
    del ddp, opt

    # 2. every component on, CP ranks each holding their chunks
    _init(case, case.cp, rank)
    megatron_peakflat.apply(_components())
    try:
        sco_integration.reset()
        calls = stats.snapshot().get("vocab", {}).get("calls", 0)
        config, ddp, opt = _build(case, case.cp, offload=True)
        cp_rank = parallel_state.get_context_parallel_rank()
        tokens_seen: list[int] = []
        for m in ddp.modules():
            if isinstance(m, MoELayer):
                m.register_forward_pre_hook(lambda mod, args: tokens_seen.append(args[0].shape[0] * args[0].shape[1]))
        attention = [m for m in ddp.modules() if type(m).__name__ == "SDPAttention"]
        from megatron.core.transformer.moe.router import TopKRouter

        on_expert1: list[float] = []  # share of the tokens each router call sends to expert 1
        for m in ddp.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(lambda mod, args, out: on_expert1.append(float(out[1][:, 1].float().mean())))
        got = []
        for i, s in enumerate(seeds):
            got.append(_step(case, config, ddp, opt, _batch(case, cp_rank, s)))
            if i == 0:  # one micro-batch: every boundary offloaded in the step was alive at once
                first = sco_integration.offloader()
                sco_first = (first.offloaded, first.offloaded_bytes_peak) if first is not None else (0, 0)
            if case.resume and i == 0:
                path = os.path.join(ckpt_dir, f"{case.name}-rank{rank}.pt")
                torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict()}, path)
                opt.save_parameter_state(os.path.join(ckpt_dir, f"{case.name}-param-state.pt"))
        off = sco_integration.offloader()
        ran = dict(
            dispatchers=sum(isinstance(m.token_dispatcher, PeakflatDispatcher)
                            for m in ddp.modules() if isinstance(m, MoELayer)),
            ep_group_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_dp=parallel_state.get_expert_data_parallel_world_size(),
            tokens_seen=sorted(set(tokens_seen)),
            on_expert1=(min(on_expert1), max(on_expert1)),
            vocab_calls=stats.snapshot().get("vocab", {}).get("calls", 0) - calls,
            sco_packed=0 if off is None else off.packed,
            sco_first=sco_first,
            optimizer=all(isinstance(o.optimizer, OffloadStreamAdamW)
                          for o in getattr(opt, "chained_optimizers", None) or [opt]),
            cp_attention=len(attention) > 0 and all(m.cp_group is not None for m in attention),
        )
        resumed = None
        if case.resume:
            config2, ddp2, opt2 = _build(case, case.cp, offload=True, seed=99)  # other initial weights: the checkpoint decides
            sd = torch.load(os.path.join(ckpt_dir, f"{case.name}-rank{rank}.pt"), weights_only=False)
            ddp2.load_state_dict(sd["model"])
            opt2.load_state_dict(sd["optimizer"])
            opt2.load_parameter_state(os.path.join(ckpt_dir, f"{case.name}-param-state.pt"))
            resumed = [_step(case, config2, ddp2, opt2, _batch(case, cp_rank, s)) for s in seeds[1:]]
    finally:
        megatron_peakflat.remove()

    out = dict(ran, loss=[], grads=[], params=[])
    for (rl, rg, rp), (gl, gg, gp) in zip(ref, got):
        out["loss"].append(abs(gl - rl) / abs(rl))
        out["grads"].append(_worst(gg, rg))
        out["params"].append(_worst(gp, rp))
    out["trained"] = max(max_rel_error(got[-1][2][k], got[0][2][k]) for k in got[0][2]) if case.steps > 1 else None
    if resumed is not None:
        out["resume"] = [(abs(a[0] - b[0]) / abs(b[0]), _worst(a[1], b[1]), _worst(a[2], b[2]))
                         for a, b in zip(resumed, got[1:])]
    return out


def _rank_main(rank: int, world: int, ckpt_dir: str) -> dict:
    from megatron_peakflat.testing.megatron_cpu import install_cpu_shim

    install_cpu_shim()
    out = {}
    for case in WORLD_CASES[world]:
        with _whole_sequence_mtp_tokens(case.global_mtp_tokens):
            out[case.name] = _run_case(rank, case, ckpt_dir)
    return out


@contextlib.contextmanager
def _whole_sequence_mtp_tokens(on: bool):
    """Test only: Megatron's MTP ``roll_tensor`` returns, for the loss mask, the whole sequence's token count over
    CP (all-reduced, / CP: each rank's loss is averaged over CP in the gradients) instead of its own rank's."""
    if not on:
        yield
        return
    import torch.distributed as dist
    from megatron.core.transformer import multi_token_prediction as mtp

    original = mtp.roll_tensor

    def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        rolled, total = original(tensor, shifts, dims, cp_group, packed_seq_params)
        if cp_group is not None and cp_group.size() > 1 and tensor.is_floating_point():
            total = total.clone()
            dist.all_reduce(total, group=cp_group)
            total = total / cp_group.size()
        return rolled, total

    mtp.roll_tensor = roll_tensor
    try:
        yield
    finally:
        mtp.roll_tensor = original


def _layer_tokens(case: Case) -> int:
    """Tokens each rank's MoE layers see: the rank's s/CP share of the micro-batch, / TP under sequence parallelism."""
    return case.seq * MB // case.cp // case.tp


@pytest.mark.parametrize("world", sorted(WORLD_CASES))
def test_every_component_under_context_parallelism_equals_megatron_at_cp1(world):
    with tempfile.TemporaryDirectory() as d:
        results = run_distributed(_rank_main, world, d, timeout=600)
    assert len(results) == world
    for rank, per_case in enumerate(results):
        for case in WORLD_CASES[world]:
            r = per_case[case.name]
            where = (case.name, rank)
            # each component ran, on the rank's share of the sequence
            assert r["dispatchers"] == 2 + case.mtp and r["ep_group_size"] == case.ep, (where, r)  # MTP: MoE too
            assert r["tokens_seen"] == [_layer_tokens(case)], (where, r["tokens_seen"])
            # the planner's per-rank tokens and expert groups are the ones the run had
            planned = RunConfig(seq_len=case.seq, micro_batch=MB, tp=case.tp, cp=case.cp, ep=case.ep,
                                dp=world // (case.tp * case.cp))
            assert planned.layer_rows == _layer_tokens(case) and planned.expert_dp == r["expert_dp"], (where, r)
            assert r["vocab_calls"] >= case.steps * (1 + case.mtp), (where, r["vocab_calls"])  # main head + MTP
            assert r["sco_packed"] > 0 and r["optimizer"] and r["cp_attention"], (where, r)
            offloaded, peak_bytes = r["sco_first"]  # SCO's boundaries are the rank's [s/CP (/TP), b, h] share
            assert offloaded >= 1 and peak_bytes == offloaded * _layer_tokens(case) * HIDDEN * 4, (where, r["sco_first"])
            if case.skew >= 8:
                assert r["on_expert1"] == (1.0, 1.0), (where, r["on_expert1"])  # every token, every layer
            elif case.skew:
                # more than balanced routing's half (top-2 of 4), not every token
                assert 0.5 < r["on_expert1"][0] and r["on_expert1"][1] < 1.0, (where, r["on_expert1"])
            for step, (loss, (grad, gname), (param, pname)) in enumerate(zip(r["loss"], r["grads"], r["params"])):
                assert loss <= TOL, (where, step, "loss", loss)
                assert grad <= TOL, (where, step, "gradient", gname, grad)
                assert param <= TOL, (where, step, "parameter after the step", pname, param)
            if case.steps > 1:
                assert r["trained"] > 1e-4, where  # the second step compared parameters that moved
            if case.resume:
                assert len(r["resume"]) == case.steps - 1
                for loss, (grad, gname), (param, pname) in r["resume"]:
                    assert loss == 0 and grad == 0 and param == 0, (where, "resumed", loss, gname, grad, pname, param)


@needs_pretrain_entry
def test_pretrain_at_cp2_with_every_component_trains_as_cp1_and_resumes(tmp_path):
    """``python -m megatron_peakflat.pretrain`` (its CPU dry run, two gloo ranks) with the four components and the
    SDPA attention: at --context-parallel-size 2 (the batch cut by Megatron's get_batch_on_this_cp_rank, the
    dataloader's mask included) the logged loss of each iteration equals the CP 1 run's (one rank, the same global
    batch), and a run resumed from the distributed checkpoint saved at CP 2 after iteration 2 logs iteration 3's."""
    common = (*TINY_GPT_ARGS, "--distributed-backend", "gloo", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--adam-eps", "1e-3", "--use-distributed-optimizer", "--optimizer-cpu-offload",
              "--use-precision-aware-optimizer", "--peakflat-optimizer", "offload-stream",
              "--peakflat-dispatch", "pipelined-llep", "--peakflat-vocab", "ring-dtp", "--peakflat-sco",
              "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
              "--peakflat-attention", "sdpa", "--dist-ckpt-optim-fully-reshardable")
    ckpt = str(tmp_path / "cp2")

    def losses(*extra: str, nproc: int = 2) -> list[float]:
        out = run_module("megatron_peakflat.testing.pretrain_dryrun", *common, *extra, nproc=nproc, timeout=600)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        assert "components on: dispatch, vocab, sco, optimizer" in text, text[-3000:]
        return logged(text, "lm loss")

    straight = losses("--context-parallel-size", "1", "--train-iters", "3", nproc=1)  # the same global batch
    saved = losses("--context-parallel-size", "2", "--train-iters", "3", "--save", ckpt, "--save-interval", "2",
                   "--exit-interval", "2")
    resumed = losses("--context-parallel-size", "2", "--train-iters", "3", "--load", ckpt)
    assert len(straight) == 3 and len(saved) == 2 and len(resumed) == 1
    assert saved + resumed == pytest.approx(straight, rel=1e-5), (saved, resumed, straight)
    assert len(set(straight)) == 3  # training moved the loss, so the later iterations compare trained weights
