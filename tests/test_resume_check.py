"""The start-up check against a checkpoint whose optimizer state another chain of optimizers saved.

Megatron chains one optimizer per gradient-reduction group: the experts get their own when EP > 1 or
ETP != TP. Resuming across that boundary (EP 2 -> 1, or 1 -> 2) fails inside Megatron's
``ChainedOptimizer.load_state_dict`` after the model is built, with the distributed optimizer or without
(seen on CPU: "KeyError: 'optimizer'", "Expected 2 entries in state dict, but got 4", "Could not find
parameter group"). ``integration/resume.py`` refuses it before the model is built and names the fixes.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from megatron_peakflat import PeakflatConfig, PeakflatConfigError
from megatron_peakflat.integration import resume
from megatron_peakflat.testing.subproc import MODEL_BUILT, TINY_GPT_ARGS, logged, run_module
from tests.conftest import needs_pretrain_entry


def _args(ep: int = 1, tp: int = 1, etp: int | None = None, **kw) -> SimpleNamespace:
    base = dict(load="/ckpt", num_experts=4, moe_layer_freq=1, pipeline_model_parallel_size=1,
                tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                overlap_param_gather_with_optimizer_step=False, use_megatron_fsdp=False)
    return SimpleNamespace(**{**base, **kw})


def _state(count: int, fmt: str = "torch_dist") -> dict:
    one = {"optimizer": {"param_groups": []}, "param_state_sharding_type": "fully_reshardable"}
    if count == 1:
        return {"optimizer": one}
    return {"optimizer": [one] * count if fmt == "torch" else {i: one for i in range(count)}}


def test_saved_count_reads_megatrons_three_layouts():
    assert resume.saved_optimizer_count(_state(1)) == 1
    assert resume.saved_optimizer_count(_state(2)) == 2
    assert resume.saved_optimizer_count(_state(3, fmt="torch")) == 3
    assert resume.saved_optimizer_count({"args": None}) is None  # saved with --no-save-optim


def test_the_count_follows_megatrons_rule():
    assert resume.optimizer_count(_args(ep=1)) == 1
    assert resume.optimizer_count(_args(ep=2)) == 2
    assert resume.optimizer_count(_args(ep=1, tp=2, etp=1)) == 2  # ETP != TP: expert process groups
    assert resume.optimizer_count(_args(ep=1, tp=2, etp=None)) == 1  # ETP defaults to TP
    assert resume.optimizer_count(_args(ep=4, num_experts=None)) == 1  # a dense model
    assert resume.optimizer_count(_args(ep=2, moe_layer_freq=[0, 0])) == 1  # no MoE layer
    assert resume.optimizer_count(_args(ep=2, overlap_param_gather_with_optimizer_step=True)) == 3
    # a pipeline stage may hold no MoE layer (one optimizer fewer), Megatron FSDP chains its own way: not predicted
    assert resume.optimizer_count(_args(ep=2, pipeline_model_parallel_size=2, moe_layer_freq=[0, 1])) is None
    assert resume.optimizer_count(_args(ep=2, pipeline_model_parallel_size=2)) is None
    assert resume.optimizer_count(_args(ep=2, use_megatron_fsdp=True)) is None


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("saved_ep,now_ep", [(2, 1), (1, 2), (1, 4)])
def test_moving_the_experts_into_or_out_of_their_own_optimizer_is_refused(saved_ep, now_ep, fmt):
    saved = _args(ep=saved_ep)
    state = _state(resume.optimizer_count(saved), fmt)
    with pytest.raises(PeakflatConfigError) as e:
        resume.check_optimizer_chain(_args(ep=now_ep), state, saved, release=False)
    assert e.value.flag == "--expert-model-parallel-size" and e.value.value == now_ep
    assert f"saved with --expert-model-parallel-size {saved_ep}," in e.value.problem
    assert "after the model is built" in e.value.problem
    assert f"resume with --expert-model-parallel-size {saved_ep}," in e.value.fix
    assert "--no-load-optim" in e.value.fix


def _refused(now: Any, state: dict, saved: Any, release: bool = False) -> bool:
    try:
        resume.check_optimizer_chain(now, state, saved, release=release)
    except PeakflatConfigError:
        return True
    return False


def test_the_same_chain_or_no_optimizer_state_to_load_passes():
    two = _state(2)
    assert _refused(_args(ep=1), two, _args(ep=2))  # the case below pass by what they change, not by default
    for now in (_args(ep=2), _args(ep=4), _args(ep=1, tp=2, etp=1)):  # all chain dense + experts
        assert not _refused(now, two, _args(ep=2)), now
    assert not _refused(_args(ep=1, tp=2), _state(1), _args(ep=1, tp=4))
    for now, saved, release in ((_args(ep=1, no_load_optim=True), _args(ep=2), False),
                                (_args(ep=1, finetune=True), _args(ep=2), False),
                                (_args(ep=1), _args(ep=2), True),
                                (_args(ep=1), _args(ep=2, no_save_optim=True), False)):
        assert not _refused(now, two, saved, release), (now, saved, release)
    assert not _refused(_args(ep=1), {"args": None}, _args(ep=2))
    assert not _refused(_args(ep=1, pipeline_model_parallel_size=2), two, _args(ep=2))


def test_another_dense_chain_names_its_own_flag():
    saved = _args(ep=1, overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(PeakflatConfigError) as e:
        resume.check_optimizer_chain(_args(ep=1), _state(2), saved, release=False)
    assert e.value.flag == "--overlap-param-gather-with-optimizer-step" and e.value.value is False
    assert "resume with --overlap-param-gather-with-optimizer-step on" in e.value.fix


def test_check_resume_runs_the_chain_check_on_what_it_reads(monkeypatch):
    monkeypatch.setattr(resume, "saved_state", lambda args: ({"args": _args(ep=2), **_state(2)}, False, "torch_dist"))
    cfg = PeakflatConfig.from_args(SimpleNamespace(), validate=False)
    with pytest.raises(PeakflatConfigError, match="holds the state of 2 chained optimizer"):
        resume.check_resume(_args(ep=1), cfg)
    resume.check_resume(_args(ep=2), cfg)


@needs_pretrain_entry
def test_pretrain_refuses_an_ep_change_megatrons_load_cannot_follow(tmp_path):
    """Saved at EP=2 on two CPU ranks with the distributed optimizer (fully reshardable), resumed at EP=1:
    refused before the model is built, naming both fixes; with --no-load-optim the same resume trains."""
    opt = ("--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
           "--peakflat-optimizer", "offload-stream", "--dist-ckpt-optim-fully-reshardable")
    common = (*TINY_GPT_ARGS, "--distributed-backend", "gloo", "--train-iters", "3", *opt)
    ckpt = str(tmp_path / "ep2")
    out = run_module("megatron_peakflat.testing.pretrain_dryrun", *common, "--expert-model-parallel-size", "2",
                     "--save", ckpt, "--save-interval", "2", "--exit-interval", "2", nproc=2, timeout=600)
    assert out.returncode == 0 and "successfully saved checkpoint" in out.stdout + out.stderr
    for extra, refused in (((), True), (("--no-load-optim",), False)):
        out = run_module("megatron_peakflat.testing.pretrain_dryrun", *common, "--expert-model-parallel-size", "1",
                         "--load", ckpt, *extra, nproc=2, timeout=600)
        text = out.stdout + out.stderr
        if refused:
            assert out.returncode != 0, text[-3000:]
            assert "--expert-model-parallel-size=1: the checkpoint in --load" in text, text[-3000:]
            assert "Fix: resume with --expert-model-parallel-size 2," in text and MODEL_BUILT not in text, text[-3000:]
        else:
            assert out.returncode == 0, text[-3000:]
            assert len(logged(text, "lm loss")) == 1, text[-3000:]


@needs_pretrain_entry
def test_pretrain_resumes_exactly_at_another_ep_within_the_expert_chain(tmp_path):
    """Saved at EP=2 on four CPU ranks (distributed optimizer, fully reshardable), resumed at EP=4: both chain
    a dense and an expert optimizer, the check lets it through, and the resumed step's loss equals the
    straight EP=2 run's (dropout off: its RNG streams follow the expert-parallel rank)."""
    common = (*TINY_GPT_ARGS, "--distributed-backend", "gloo", "--global-batch-size", "8", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--train-iters", "3", "--use-distributed-optimizer",
              "--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--peakflat-optimizer", "offload-stream",
              "--dist-ckpt-optim-fully-reshardable")
    ckpt = str(tmp_path / "ep2")

    def losses(*extra: str) -> list[float]:
        out = run_module("megatron_peakflat.testing.pretrain_dryrun", *common, *extra, nproc=4, timeout=600)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        return logged(text, "lm loss")

    straight = losses("--expert-model-parallel-size", "2")
    saved = losses("--expert-model-parallel-size", "2", "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    resumed = losses("--expert-model-parallel-size", "4", "--load", ckpt)
    assert len(straight) == 3 and saved == straight[:2]
    assert resumed == pytest.approx(straight[2:], rel=1e-6)
