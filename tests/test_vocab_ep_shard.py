"""``--peakflat-vocab-shard-over-ep``: the output layer's rows split over the expert-parallel group.

Megatron's GPTModel on CPU (gloo), TP=1, EP=2, each rank with its own tokens, trained for three steps
through Megatron's DDP, its optimizer (Adam, weight decay, gradient clipping; distributed or not) and
pipeline schedule, against the same model and data with peakflat off: the loss of every step after the
first and every parameter after the three steps equal (1e-5), and with the plain optimizer every
parameter's reduced and clipped gradient of the first step (1e-5); the output layer's shard against its
rows of the whole layer. World 2 (expert data-parallel size 1) and world 4 (2: the shard's gradient is
also reduced across replicas). Also: the checkpoint describes the shard as rows of the whole layer and
moves between sharded and whole models; Megatron's own pretrain loop trains and resumes with the flag
as without it; a forward that would need logits refuses; bad combinations fail at start-up naming the flag.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_peakflat import PeakflatConfig, PeakflatConfigError
from megatron_peakflat.testing import max_rel_error, run_distributed
from megatron_peakflat.testing.subproc import MODEL_BUILT, TINY_GPT_ARGS, logged, run_module
from tests.conftest import needs_pretrain_entry

V, SEQ, MB, STEPS = 128, 16, 2, 3


def _params(ddp) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.detach().clone() for n, p in ddp.named_parameters()}


def _grads(ddp) -> dict[str, torch.Tensor]:
    """The step's reduced (and clipped) gradients, as DDP's main_grad still holds them after the step."""
    return {n.removeprefix("module."): p.main_grad.detach().clone() for n, p in ddp.named_parameters()}


def _train(rank: int, peakflat_on: bool, grad: str, dist_opt: bool, mtp: bool = False):
    import megatron_peakflat
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.testing.megatron_cpu import build_tiny_gpt, mtp_metrics, tiny_transformer_config
    from megatron_peakflat.testing.train_loop import build_training, make_batches, train_steps
    from megatron_peakflat.vocab import VocabConfig

    if peakflat_on:
        megatron_peakflat.apply(PeakflatConfig(
            vocab=VocabConfig(impl="ring-dtp", shard_over_ep=True, block_size=16, grad=grad, chunk_tokens=128),
            general=GeneralConfig(attention="local")))
    try:
        torch.manual_seed(7)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(7)
        if mtp:
            from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

            destroy_moe_metrics_tracker()  # sized by the first model's MoE layer count; this one has one more
            mtp_metrics()
        config = tiny_transformer_config(**(dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3) if mtp else {}))
        model = build_tiny_gpt(config, vocab_size=V, seq_len=SEQ)
        # adam_eps well above the float noise of a near-zero gradient: with the default 1e-8, Adam turns the
        # summation-order noise of such an element into a sizeable step, and the parameters stop being comparable.
        setup = build_training(model, config, seq_len=SEQ, micro_batch=MB, use_distributed_optimizer=dist_opt,
                               adam_eps=1e-4)
        batches = make_batches(STEPS, SEQ, MB, V, seed=100 * rank)
        train_steps(setup, batches[:1])
        first_grads = _grads(setup.model[0])
        losses = train_steps(setup, batches[1:])
        metrics = mtp_metrics() if mtp else {}
        return losses, first_grads, _params(setup.model[0]), model.output_layer, metrics
    finally:
        megatron_peakflat.remove()


def _shard_checks(rank: int, world: int) -> list[str]:
    from megatron.core import parallel_state

    from megatron_peakflat import stats
    from megatron_peakflat.integration.vocab_shard import shard_of
    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel, install_cpu_shim

    install_cpu_shim()
    init_megatron_parallel(tp=1, ep=2)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    done = []
    for grad, dist_opt, mtp in (("in-forward", True, False), ("in-forward", False, False), ("recompute", False, False),
                                ("in-forward", False, True)):
        ref_losses, ref_grads, ref, _, ref_metrics = _train(rank, False, grad, dist_opt, mtp)
        calls = stats.snapshot().get("vocab", {}).get("calls", 0)
        losses, grads, ours, layer, metrics = _train(rank, True, grad, dist_opt, mtp)
        what = f"world={world} grad={grad} distributed_optimizer={dist_opt} mtp={mtp}"
        shard = shard_of(layer)
        assert shard is not None and shard.size == 2 and shard.rank == ep_rank, what
        assert stats.snapshot()["vocab"]["calls"] == calls + STEPS * (1 + mtp), what  # the MTP layer's loss too
        # the MTP layer's loss and acceptance counts as Megatron logs them (0.18.2: its loss only)
        assert set(metrics) == set(ref_metrics) and (not mtp or {"loss_values", "values"} & set(ref_metrics)), what
        for k in ref_metrics:
            assert max_rel_error(metrics[k], ref_metrics[k]) < 1e-5, (what, k, metrics[k], ref_metrics[k])
        # over the expert-parallel ranks, not one rank: the in-forward gradients' gather, else a ring
        # (with MTP the last call may be the MTP layer's loss, whose gradients are computed in backward, on a ring)
        rings = {"activations", "weights"}
        expected = ({"gather"} | (rings if mtp else set())) if grad == "in-forward" else rings
        assert stats.snapshot()["vocab"]["schedule"] in expected, (what, stats.snapshot()["vocab"]["schedule"])
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (what, losses, ref_losses)
        assert set(ours) == set(ref) == set(grads) == set(ref_grads), (what, set(ours) ^ set(ref))
        rows = slice(ep_rank * V // 2, (ep_rank + 1) * V // 2)
        # first step: the reduced, clipped gradient of every parameter; after three Adam steps, the parameters
        # (The distributed optimizer reduce-scatters: a rank's main_grad is reduced only where it owns the
        # optimizer state, and moving the output layer to the expert buffers moves those bounds: so the
        # gradients are compared under the plain optimizer, which all-reduces them.)
        checks = ([] if dist_opt else [(grads, ref_grads, 1e-5, "grad")]) + [(ours, ref, 1e-5, "param")]
        for got, want_all, tol, kind in checks:
            for name in want_all:
                want = want_all[name][rows] if name == "output_layer.weight" else want_all[name]
                assert got[name].shape == want.shape, (what, kind, name)
                err = max_rel_error(got[name], want)
                assert err < tol, (what, kind, name, err)
        assert grads["output_layer.weight"].abs().max() > 0, what
        done.append(what)

    # the checkpoint: rows of the whole [V, H] layer, replicated over the expert data-parallel ranks
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.testing.megatron_cpu import build_tiny_gpt, tiny_transformer_config
    from megatron_peakflat.vocab import VocabConfig
    import megatron_peakflat

    megatron_peakflat.apply(PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", shard_over_ep=True),
                                           general=GeneralConfig(attention="local")))
    try:
        model = build_tiny_gpt(tiny_transformer_config(), vocab_size=V, seq_len=SEQ)
        w = model.output_layer.weight
        assert w.allreduce is False and w.is_embedding_or_output_parameter  # Megatron's tags carried over
        sd = model.sharded_state_dict()
        st = sd["output_layer.weight"]
        assert tuple(st.global_shape) == (V, 64) and tuple(st.local_shape) == (V // 2, 64)
        assert tuple(st.global_offset) == (ep_rank * V // 2, 0)
        assert st.replica_id == (0, 0, parallel_state.get_expert_data_parallel_rank())
        # a forward that would hand the logits to Megatron refuses, naming the flag
        tokens = torch.zeros(1, SEQ, dtype=torch.long)
        with pytest.raises(RuntimeError, match="--peakflat-vocab-shard-over-ep"):
            model(tokens, torch.arange(SEQ).unsqueeze(0), None)
    finally:
        megatron_peakflat.remove()
    done.append("checkpoint")
    return done


@pytest.mark.parametrize("world", [2, 4, 8])  # 8: the paper's ranks (about 20 s on two cores)
def test_sharded_output_layer_trains_like_the_whole_one(world):
    results = run_distributed(_shard_checks, world, timeout=900)
    assert all(len(r) == 5 for r in results), results


def _megatron_args(**kw):
    base = dict(num_experts=8, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
                expert_tensor_parallel_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=128, mtp_num_layers=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("over, impl, words", [
    (dict(), "megatron", "--peakflat-vocab ring-dtp"),
    (dict(expert_model_parallel_size=1), "ring-dtp", "expert-parallel group"),
    (dict(tensor_model_parallel_size=2), "ring-dtp", "already vocab-parallel"),
    (dict(pipeline_model_parallel_size=2), "ring-dtp", "pipeline"),
    (dict(untie_embeddings_and_output_weights=False), "ring-dtp", "--untie-embeddings-and-output-weights"),
    (dict(expert_model_parallel_size=3, num_experts=9), "ring-dtp", "--make-vocab-size-divisible-by"),
    (dict(expert_tensor_parallel_size=2), "ring-dtp", "pass --expert-tensor-parallel-size 1"),
])
def test_bad_combinations_fail_at_startup_naming_the_flag(over, impl, words):
    from megatron_peakflat.vocab import VocabConfig

    cfg = PeakflatConfig(vocab=VocabConfig(impl=impl, shard_over_ep=True))
    with pytest.raises(PeakflatConfigError) as e:
        cfg.validate(_megatron_args(**over))
    assert "--peakflat-vocab-shard-over-ep" in str(e.value) and words in str(e.value), str(e.value)
    PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", shard_over_ep=True)).validate(_megatron_args())
    PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", shard_over_ep=True)).validate(_megatron_args(mtp_num_layers=1))


def _checkpoint_round_trip(rank: int, world: int, path: str) -> bool:
    import megatron_peakflat
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.testing.megatron_cpu import (build_tiny_gpt, init_megatron_parallel, install_cpu_shim,
                                                        tiny_transformer_config)
    from megatron_peakflat.vocab import VocabConfig

    install_cpu_shim()
    init_megatron_parallel(tp=1, ep=2)
    rows = slice(parallel_state.get_expert_model_parallel_rank() * V // 2, None)
    full = torch.arange(V * 64, dtype=torch.float32).view(V, 64)

    def build(sharded: bool):
        if sharded:
            megatron_peakflat.apply(PeakflatConfig(vocab=VocabConfig(impl="ring-dtp", shard_over_ep=True),
                                                   general=GeneralConfig(attention="local")))
        try:
            return build_tiny_gpt(tiny_transformer_config(), vocab_size=V, seq_len=SEQ)
        finally:
            megatron_peakflat.remove()

    # saved with the flag, loaded without it: the whole layer comes back
    model = build(True)
    with torch.no_grad():
        model.output_layer.weight.copy_(full[rows][: V // 2])
    dist_checkpointing.save(model.sharded_state_dict(), f"{path}/sharded")
    whole = build(False)
    whole.load_state_dict(dist_checkpointing.load(whole.sharded_state_dict(), f"{path}/sharded"))
    assert torch.equal(whole.output_layer.weight, full)
    # saved without it, loaded with it: each rank gets its rows
    with torch.no_grad():
        whole.output_layer.weight.mul_(-1)
    dist_checkpointing.save(whole.sharded_state_dict(), f"{path}/whole")
    model = build(True)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), f"{path}/whole"))
    assert torch.equal(model.output_layer.weight, -full[rows][: V // 2])
    return True


def test_checkpoint_moves_between_sharded_and_whole_layers(tmp_path):
    """Megatron's distributed checkpoint (torch_dist) of a sharded output layer loads into a model without
    the flag as the whole layer, and the other way round, exactly."""
    (tmp_path / "sharded").mkdir()
    (tmp_path / "whole").mkdir()
    assert all(run_distributed(_checkpoint_round_trip, 2, str(tmp_path), timeout=600))


# ---- through Megatron's own pretrain loop (CPU dry run, two gloo ranks under torchrun) --------------------

def _pretrain(*argv: str) -> str:
    out = run_module("megatron_peakflat.testing.pretrain_dryrun", *TINY_GPT_ARGS, "--expert-model-parallel-size", "2",
                     "--untie-embeddings-and-output-weights", "--distributed-backend", "gloo", *argv, nproc=2, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    return text


SHARD = ("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-shard-over-ep")


@needs_pretrain_entry
def test_pretrain_refuses_expert_tensor_parallelism_before_the_model_is_built():
    """TP=1, EP=2, --expert-tensor-parallel-size 2 on four CPU ranks (Megatron's allgather dispatcher, which gloo
    runs at ETP > 1): the shard's gradient would miss the other expert-tensor-parallel rank's tokens (it trained
    to another grad norm than the whole layer, 1.083 against 1.143, with nothing logged). Refused at start-up,
    naming the flag, the value and the fix."""
    out = run_module("megatron_peakflat.testing.pretrain_dryrun", *TINY_GPT_ARGS, "--train-iters", "1",
                     "--global-batch-size", "8", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                     "2", "--moe-token-dispatcher-type", "allgather", "--untie-embeddings-and-output-weights",
                     "--distributed-backend", "gloo", *SHARD, nproc=4, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert ("--peakflat-vocab-shard-over-ep=True: --expert-tensor-parallel-size is 2" in text
            and "Fix: pass --expert-tensor-parallel-size 1" in text), text[-3000:]
    assert MODEL_BUILT not in text


@needs_pretrain_entry
def test_pretrain_with_the_flag_trains_and_resumes_as_without_it(tmp_path):
    """``megatron_peakflat.pretrain`` (Megatron's own training loop, flags and checkpointing), EP=2 on two
    CPU ranks, with an MTP layer (its loss on the same shard): the same losses, MTP losses (1e-5) and grad norms
    (1e-4) with the flag as without it, and a run saved at iteration 2 and resumed continues as Megatron's own
    resumed run does (its distributed checkpoint holds the shard as rows of the whole layer). Iterations 1-2 come
    from the runs that save, 3-4 from the resumes."""
    saved, resumed = {}, {}
    mtp = ("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3")
    for name, extra in (("on", SHARD), ("off", ())):
        ckpt = str(tmp_path / name)
        saved[name] = _pretrain("--train-iters", "4", "--save", ckpt, "--save-interval", "2", "--exit-interval", "2",
                                *mtp, *extra)
        assert "successfully saved checkpoint" in saved[name]
        resumed[name] = _pretrain("--train-iters", "4", "--load", ckpt, *mtp, *extra)
    assert "output layer sharded over the expert-parallel group (EP=2): 128 of 256 rows" in saved["on"]
    assert "the 1 MTP layer loss(es) through Ring-DTP too" in saved["on"]
    assert "output layer sharded" not in saved["off"]
    for key, rel in (("lm loss", 1e-5), ("mtp_1 loss", 1e-5), ("grad norm", 1e-4)):
        for run in (saved, resumed):
            assert len(logged(run["off"], key)) == 2
            assert logged(run["on"], key) == pytest.approx(logged(run["off"], key), rel=rel)


def test_resume_check_refuses_only_a_toggle_the_optimizer_state_cannot_follow(monkeypatch):
    """The start-up check against --load's saved state: turning the flag on or off refuses where Megatron
    would load distributed-optimizer state that cannot follow it; the same flag, --no-load-optim, a release
    checkpoint, one saved with --no-save-optim, fully reshardable state (by the content metadata, or the
    saved args of a checkpoint without one), no distributed optimizer or nothing to read pass."""
    from megatron.core import dist_checkpointing

    from megatron_peakflat.integration import resume

    def check(saved_on: bool | None, now_on: bool, sharding: str | None = "dp_reshardable", release=False,
              fmt: str = "torch_dist", **kw) -> None:
        saved = SimpleNamespace(peakflat_vocab_impl="ring-dtp", peakflat_vocab_shard_over_ep=saved_on,
                                dist_ckpt_optim_fully_reshardable=kw.pop("reshardable", False),
                                no_save_optim=kw.pop("no_save_optim", None))
        found = None if saved_on is None else ({"args": saved}, release, fmt)
        monkeypatch.setattr(resume, "saved_state", lambda args: found)
        monkeypatch.setattr(dist_checkpointing, "load_content_metadata", lambda preloaded_state_dict=None: (
            None if sharding is None else {"distrib_optim_sharding_type": sharding}))
        args = SimpleNamespace(load="/ckpt", use_distributed_optimizer=kw.pop("dist_opt", True), **kw)
        cfg = PeakflatConfig.from_args(SimpleNamespace(peakflat_vocab_impl="ring-dtp",
                                                       peakflat_vocab_shard_over_ep=now_on), validate=False)
        resume.check_resume(args, cfg)

    for saved_on, now_on, kw in ((True, False, {}), (False, True, {}), (True, False, dict(sharding=None))):
        with pytest.raises(PeakflatConfigError) as e:
            check(saved_on, now_on, **kw)
        assert e.value.flag == "--peakflat-vocab-shard-over-ep" and e.value.value is now_on
        assert f"saved with it {'on' if saved_on else 'off'}" in str(e.value)
        assert f"{'add' if saved_on else 'drop'} --peakflat-vocab-shard-over-ep" in e.value.fix
        assert "--no-load-optim" in e.value.fix and "--dist-ckpt-optim-fully-reshardable" in e.value.fix
    for saved_on, now_on, kw in ((True, True, {}), (False, False, {}), (True, False, dict(no_load_optim=True)),
                                 (True, False, dict(release=True)), (True, False, dict(no_save_optim=True)),
                                 (True, False, dict(sharding="fully_reshardable")),
                                 (True, False, dict(sharding=None, reshardable=True)),
                                 (False, True, dict(dist_opt=False)), (None, True, {})):
        check(saved_on, now_on, **kw)
    # A --ckpt-format torch checkpoint keeps local shapes: no toggle loads, not even the weights alone.
    for saved_on, now_on, kw in ((True, False, {}), (False, True, dict(no_load_optim=True)),
                                 (True, False, dict(release=True, finetune=True)),
                                 (True, False, dict(sharding="fully_reshardable", dist_opt=False))):
        with pytest.raises(PeakflatConfigError) as e:
            check(saved_on, now_on, fmt="torch", **kw)
        assert e.value.flag == "--peakflat-vocab-shard-over-ep" and e.value.value is now_on
        assert f"--ckpt-format torch checkpoint in --load /ckpt was saved with it {'on' if saved_on else 'off'}" \
            in str(e.value)
        assert f"{'add' if saved_on else 'drop'} --peakflat-vocab-shard-over-ep" in e.value.fix
        assert "--ckpt-format torch_dist" in e.value.fix
    for saved_on, now_on in ((True, True), (False, False)):
        check(saved_on, now_on, fmt="torch")


def test_resume_check_reads_nothing_it_cannot_mirror(tmp_path):
    """No state is read where Megatron might load another checkpoint or format than --load's tracker names."""
    from megatron_peakflat.integration.resume import saved_state

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    for kw in (dict(non_persistent_ckpt_type="global"), dict(load=None), dict(load=str(tmp_path / "missing"))):
        assert saved_state(SimpleNamespace(**{"load": str(tmp_path), "ckpt_format": "torch_dist", **kw})) is None
    assert saved_state(SimpleNamespace(load=str(tmp_path), ckpt_format="torch_dist")) is None  # no iteration 2
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "mp_rank_00").mkdir()
    (tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not a checkpoint")
    assert saved_state(SimpleNamespace(load=str(tmp_path), ckpt_format="torch")) is None  # unreadable


def test_resume_check_reads_a_torch_format_checkpoint_as_megatron_finds_it(tmp_path):
    """A --ckpt-format torch checkpoint is told from what is on disk (whatever --ckpt-format says now, as
    Megatron's load tells it), rank 0's file found under any of Megatron's names for it (here the one with
    expert parallelism): the args come back with the format."""
    from argparse import Namespace

    from megatron_peakflat.integration.resume import saved_state

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    rank0 = tmp_path / "iter_0000003" / "mp_rank_00_000"
    rank0.mkdir(parents=True)
    args = Namespace(peakflat_vocab_impl="ring-dtp", peakflat_vocab_shard_over_ep=True)
    torch.save({"args": args, "model": {"w": torch.arange(6.0)}}, rank0 / "model_optim_rng.pt")
    for now in ("torch", "torch_dist"):
        state, release, fmt = saved_state(SimpleNamespace(load=str(tmp_path), ckpt_format=now))
        assert (fmt, release, state["args"]) == ("torch", False, args)
        assert torch.equal(state["model"]["w"], torch.arange(6.0))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    (tmp_path / "iter_0000003").rename(tmp_path / "release")
    assert saved_state(SimpleNamespace(load=str(tmp_path)))[1:] == (True, "torch")


_DIST_OPT = ("--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
             "--peakflat-optimizer", "offload-stream")


@needs_pretrain_entry
@pytest.mark.parametrize("extra, at_load, refusal", [
    ((), (), "--peakflat-vocab-shard-over-ep=False: the checkpoint in --load"),
    (("--dist-ckpt-optim-fully-reshardable",), (), None),
    (("--ckpt-format", "torch"), ("--no-load-optim",),
     "--peakflat-vocab-shard-over-ep=False: the --ckpt-format torch checkpoint in --load"),
], ids=["plain", "reshardable", "torch"])
def test_pretrain_refuses_at_startup_a_resume_that_turns_the_flag_off(tmp_path, extra, at_load, refusal):
    """Saved with the flag and the distributed optimizer, resumed without the flag: start-up refuses it before
    the model is built (the load itself failed with a shape mismatch after building it), naming the fixes;
    from a checkpoint saved with --dist-ckpt-optim-fully-reshardable the same resume trains. A --ckpt-format
    torch checkpoint is refused even with --no-load-optim (its model weights failed to load: local shapes).
    The optimizer is OffloadStreamAdamW (on this CPU shim Megatron's own distributed Adam does not resume:
    ``len(steps) == 1``)."""
    ckpt = str(tmp_path / "ckpt")
    saved = _pretrain("--train-iters", "3", "--save", ckpt, "--save-interval", "2", "--exit-interval", "2",
                      *_DIST_OPT, *extra, *SHARD)
    assert "successfully saved checkpoint" in saved
    out = run_module("megatron_peakflat.testing.pretrain_dryrun", *TINY_GPT_ARGS, "--expert-model-parallel-size",
                     "2", "--untie-embeddings-and-output-weights", "--distributed-backend", "gloo",
                     "--train-iters", "3", "--load", ckpt, *_DIST_OPT, *extra, *at_load,
                     "--peakflat-vocab", "ring-dtp", nproc=2, timeout=600)
    text = out.stdout + out.stderr
    if refusal is not None:
        assert out.returncode != 0, text[-3000:]
        assert refusal in text, text[-3000:]
        assert "saved with it on" in text and MODEL_BUILT not in text, text[-3000:]
    else:
        assert out.returncode == 0, text[-3000:]
        assert len(logged(text, "lm loss")) == 1, text[-3000:]


def test_resume_check_reads_the_checkpoint_megatron_will_load(tmp_path, monkeypatch):
    """A distributed checkpoint's common state is read from the iteration the tracker names, from --ckpt-step's
    iteration when one is given, and from release/ for a release checkpoint, which is reported as one."""
    from megatron.core import dist_checkpointing

    from megatron_peakflat.integration.resume import saved_state

    monkeypatch.setattr(dist_checkpointing, "check_is_distributed_checkpoint", lambda path: True)
    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", lambda path: {"read": path})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    args = SimpleNamespace(load=str(tmp_path), ckpt_format="torch_dist")
    assert saved_state(args) == ({"read": str(tmp_path / "iter_0000007")}, False, "torch_dist")
    args.ckpt_step = 5
    assert saved_state(args) == ({"read": str(tmp_path / "iter_0000005")}, False, "torch_dist")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    del args.ckpt_step
    assert saved_state(args) == ({"read": str(tmp_path / "release")}, True, "torch_dist")


def test_resume_check_passes_a_finetune_and_state_saved_fully_parallel_or_with_no_effect(monkeypatch):
    """Turning the flag off at a resume passes where Megatron loads no optimizer state (--finetune), where that
    state follows the new shapes (saved with --ckpt-fully-parallel-save by a megatron-core without content
    metadata: 'fully_sharded_model_space'), and where the saved flag had no effect (the vocab component off);
    the same resume without any of these is refused."""
    from megatron.core import dist_checkpointing

    from megatron_peakflat.integration import resume

    monkeypatch.setattr(dist_checkpointing, "load_content_metadata", lambda preloaded_state_dict=None: None)
    cfg = PeakflatConfig.from_args(SimpleNamespace(peakflat_vocab_impl="ring-dtp"), validate=False)

    def check(args: dict, saved: dict) -> None:
        saved = SimpleNamespace(**{"peakflat_vocab_impl": "ring-dtp", "peakflat_vocab_shard_over_ep": True, **saved})
        monkeypatch.setattr(resume, "saved_state", lambda a: ({"args": saved}, False, "torch_dist"))
        resume.check_resume(SimpleNamespace(load="/ckpt", use_distributed_optimizer=True, **args), cfg)

    with pytest.raises(PeakflatConfigError):
        check({}, {})
    check(dict(finetune=True), {})
    check({}, dict(ckpt_fully_parallel_save=True))
    check({}, dict(peakflat_vocab_impl="megatron"))


def test_apply_refuses_a_resume_the_optimizer_state_cannot_follow_before_patching(monkeypatch):
    """``apply(args)`` runs the resume check at start-up: a checkpoint saved with the flag on, resumed with it
    off, fails naming the flag, with nothing patched and no config made current."""
    from megatron.core import dist_checkpointing

    import megatron_peakflat
    from megatron_peakflat.integration import registry, resume, state
    from tests.test_config import parse_with_megatron

    saved = SimpleNamespace(peakflat_vocab_impl="ring-dtp", peakflat_vocab_shard_over_ep=True)
    monkeypatch.setattr(resume, "saved_state", lambda args: ({"args": saved}, False, "torch_dist"))
    monkeypatch.setattr(dist_checkpointing, "load_content_metadata",
                        lambda preloaded_state_dict=None: {"distrib_optim_sharding_type": "dp_reshardable"})
    ns = parse_with_megatron("--peakflat-vocab", "ring-dtp", "--peakflat-attention", "local", load="/ckpt")
    megatron_peakflat.remove()
    with pytest.raises(PeakflatConfigError) as e:
        megatron_peakflat.apply(ns)
    assert e.value.flag == "--peakflat-vocab-shard-over-ep" and "saved with it on" in str(e.value)
    assert registry.applied() == [] and state.get() is None
