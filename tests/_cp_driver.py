"""The driver of the two-rank context-parallel runs: every component at CP 2 against Megatron on the same tokens, and
a resume after SIGKILL at CP 2. ``tests/gpu/test_cp_gpu.py`` runs it on two GPUs (NCCL); ``tests/test_cp_driver.py``
runs the same code on two gloo ranks on CPU, so that the driver is proven before a GPU runs it.

A case (``Case``) is one comparison, run inside a ``run_distributed`` rank by ``rank_main``:

- fp32: ours (dispatch, vocab, SCO, optimizer at CP 2, and the tiled attention sublayer where ``Case.tile`` says;
  each rank fed its chunks as Megatron's get_batch_on_this_cp_rank cuts them) against unpatched Megatron at CP 1 fed the whole sequence, TF32 off: the loss, every parameter's
  reduced gradient and every parameter after the optimizer step (DESIGN.md's fp32 contract: 1e-5 relative).
- bf16: three runs on the same weights (the fp32 initial weights rounded to bf16): unpatched Megatron at CP 1 in fp32
  (the reference), ours at CP 2 in bf16 and Megatron's own CP 2 path in bf16 (Transformer Engine's CP attention on
  TE's layers; on the local spec Megatron has no CP attention of its own, so its path there is its layers with the
  SDPA attention alone). Ours must be no further from the reference than Megatron's own CP 2 path is, by the loss
  and by each parameter's gradient (DESIGN.md's bf16 contract), with one bf16 epsilon (2^-8) of slack for rounding.

``spec`` 'te' builds Megatron's Transformer Engine layer spec (``--cp-comm-type p2p``); 'local' the local spec with
the SDPA attention. The same process runs every case of its world; results are plain dicts (``run_distributed``
pickles them). Test use only.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

from megatron_peakflat.testing import max_rel_error
from tests.test_context_parallel import MB, V, _batch, _gather_reduced_grads, _worst
from tests.test_context_parallel import Case as _CPCase

BF16_SLACK = 2**-8
"""One bf16 epsilon: two bf16 computations of one step round differently by a unit or two."""
FP32_TOL = 1e-5
"""DESIGN.md's fp32 contract."""


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str = "fp32"
    """'fp32' (against CP 1 within FP32_TOL) or 'bf16' (against an fp32 reference, no worse than Megatron's CP 2)."""
    spec: str = "local"
    """'te': Transformer Engine's layers and CP attention; 'local': the local spec with the SDPA attention."""
    ep: int = 1
    skew: float = 0.0
    """Added to expert 1's router logit for every token (8 sends every token there)."""
    seq: int = 16
    tile: int = 0
    """Tokens per tile of --peakflat-tile in our run (0: off): each rank's chunks tiled, K and V gathered by the
    tiled sublayer, TE's or the SDPA attention run per tile with no CP group of its own."""
    bf16_slack: float = BF16_SLACK
    """The bf16 case's slack over Megatron's own CP 2 path, per loss and per gradient."""

    def cp_case(self) -> _CPCase:
        """The same batch cut as tests/test_context_parallel.py cuts it."""
        return _CPCase(self.name, cp=2, ep=self.ep, skew=self.skew, seq=self.seq)


def _skew(model, bump: float) -> None:
    """tests/test_context_parallel.py's skew (``bump`` on expert 1's router logit for every token) on the logits'
    own device."""
    if not bump:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    for m in model.modules():
        if isinstance(m, TopKRouter):
            def skewed(x, gating=m.gating):
                logits = gating(x)
                add = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
                add[1] = bump
                return logits + add

            m.gating = skewed


def _components(spec: str, tile: int = 0):
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.optimizer.config import OptimizerConfig
    from megatron_peakflat.sco.config import SCOConfig
    from megatron_peakflat.tile.config import TileConfig
    from megatron_peakflat.vocab.config import VocabConfig

    return PeakflatConfig(
        dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=8, max_chunks=8, min_spill=0),
        vocab=VocabConfig(impl="ring-dtp", block_size=16),
        sco=SCOConfig(enabled=True, prefetch=1),
        optimizer=OptimizerConfig(impl="offload-stream", bucket=3000, engine="gpu", slots=2),
        tile=TileConfig(enabled=tile > 0, tokens=tile or None),
        general=GeneralConfig(attention="sdpa" if spec == "local" else "auto"))


def _only_attention(spec: str):
    """Megatron's own CP path: nothing of ours on TE's layers; on the local spec the SDPA attention alone."""
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig

    return PeakflatConfig(general=GeneralConfig(attention="sdpa" if spec == "local" else "auto"))


def _init(cp: int, ep: int, rank: int, cpu: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel

    init_megatron_parallel(ep=ep, context_parallel_size=cp, seed=1234, cpu=cpu)
    dp = parallel_state.get_data_parallel_world_size()
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(rank, None, MB * dp, MB, dp)


def _model(case: Case, cp: int, dtype: str, offload: bool):
    """Megatron's DDP and DistributedOptimizer over a tiny MoE GPT of ``case.spec`` built from seed 7 in fp32; in bf16
    wrapped in Megatron's Float16Module (the weights are the fp32 ones rounded to bf16), as Megatron's get_model does."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_peakflat.testing.megatron_cpu import gpt_layer_spec, recompute_config, tiny_transformer_config

    destroy_moe_metrics_tracker()
    bf16 = dtype == "bf16"
    over = dict(recompute_config("full"), context_parallel_size=cp, bf16=bf16)
    if case.spec == "te":
        over.update(cp_comm_type="p2p")
    config = tiny_transformer_config(**over)
    config.finalize_model_grads_func = finalize_model_grads
    torch.manual_seed(7)
    if case.spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    else:
        spec = gpt_layer_spec(config.num_moe_experts)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=case.seq,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), position_embedding_type="rope")
    model.cuda()  # the CPU shim keeps it on the CPU
    model.train()
    _skew(model, case.skew)
    if bf16:
        model = Float16Module(config, model)
        config.params_dtype = torch.bfloat16
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                        grad_reduce_in_fp32=True), model)
    off = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, optimizer_offload_fraction=1.0) \
        if offload else {}
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=2e-3, weight_decay=0.1, clip_grad=1.0,
                                                 adam_eps=1e-3, use_distributed_optimizer=True, bf16=bf16,
                                                 params_dtype=config.params_dtype, **off), [ddp])
    return config, ddp, opt


def _round_to_bf16(ddp) -> None:
    """Round an fp32 model's weights through bf16 in place: the weights a bf16 model of the same seed holds."""
    with torch.no_grad():
        for p in ddp.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def _step(config, ddp, opt, batch: dict, device: torch.device):
    """One step through Megatron's schedule: (the loss over the whole batch, the reduced gradients, the parameters
    after the optimizer step), on the CPU for comparison."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_peakflat.cli.pretrain import loss_func

    batch = {k: (None if v is None else v.to(device)) for k, v in batch.items()}

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
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    _gather_reduced_grads(ddp)
    grads = {_name(n): p.main_grad.detach().float().cpu().clone() for n, p in ddp.named_parameters()}
    ok, _, _ = opt.step()
    assert ok
    params = {_name(n): p.detach().float().cpu().clone() for n, p in ddp.named_parameters()}
    return float(total[0] / total[1]), grads, params


def _name(n: str) -> str:
    """A parameter's name without Float16Module's ``module.`` level, so fp32 and bf16 models' names agree."""
    return n.replace("module.module.", "module.", 1)


def _run(case: Case, rank: int, cp: int, dtype: str, patch, offload: bool, cpu: bool, device: torch.device) -> dict:
    """One run: Megatron's parallel state at ``cp``, ``patch`` applied (None: unpatched), one step on this rank's
    share of the batch; in fp32 with the weights rounded through bf16 where the case is bf16 (the reference)."""
    import megatron_peakflat
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_peakflat import stats
    from megatron_peakflat.integration import sco as sco_integration
    from megatron_peakflat.integration.dispatch import PeakflatDispatcher
    from megatron_peakflat.optimizer import OffloadStreamAdamW

    megatron_peakflat.remove()
    _init(cp, case.ep, rank, cpu)
    if patch is not None:
        megatron_peakflat.apply(patch)
    try:
        sco_integration.reset()
        calls = stats.snapshot().get("vocab", {}).get("calls", 0)
        tile_before = dict(stats.snapshot().get("tile", {}))
        config, ddp, opt = _model(case, cp, dtype, offload)
        if dtype == "fp32" and case.dtype == "bf16":
            _round_to_bf16(ddp)
        on_expert1: list[float] = []
        for m in ddp.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(lambda mod, args, out: on_expert1.append(float(out[1][:, 1].float().mean())))
        cp_rank = parallel_state.get_context_parallel_rank() if cp > 1 else None
        batch = _batch(case.cp_case(), cp_rank, 100)
        if case.spec == "te":
            batch["attention_mask"] = None  # TE's causal kernels take none
        loss, grads, params = _step(config, ddp, opt, batch, device)
        off = sco_integration.offloader()
        attention = [m for m in ddp.modules() if "attention" in type(m).__name__.lower()
                     and (getattr(m, "cp_group", None) is not None or getattr(m, "cp_size", 1) > 1
                          or type(m).__name__.startswith("TE"))]
        ran = dict(
            dispatchers=sum(isinstance(m.token_dispatcher, PeakflatDispatcher)
                            for m in ddp.modules() if isinstance(m, MoELayer)),
            ep=parallel_state.get_expert_model_parallel_world_size(),
            vocab_calls=stats.snapshot().get("vocab", {}).get("calls", 0) - calls,
            sco_packed=0 if off is None else off.packed,
            optimizer=all(isinstance(o.optimizer, OffloadStreamAdamW)
                          for o in getattr(opt, "chained_optimizers", None) or [opt]),
            attention=sorted({type(m).__name__ for m in attention}),
            on_expert1=(min(on_expert1), max(on_expert1)) if on_expert1 else None,
            param_dtypes=sorted({str(p.dtype) for p in ddp.parameters()}),
            **{k: stats.snapshot().get("tile", {}).get(k, 0) - tile_before.get(k, 0)
               for k in ("tiled_calls", "untiled_calls")})
    finally:
        megatron_peakflat.remove()
    return dict(loss=loss, grads=grads, params=params, ran=ran)


def _errors(got: dict, want: dict) -> dict:
    """Relative errors of one run against another: the loss, the worst gradient (and its name) and each gradient."""
    assert got["grads"].keys() == want["grads"].keys() and want["grads"], sorted(set(got["grads"]) ^ set(want["grads"]))
    per = {k: max_rel_error(got["grads"][k], want["grads"][k]) for k in want["grads"]}
    return dict(loss=abs(got["loss"] - want["loss"]) / abs(want["loss"]), grad=_worst(got["grads"], want["grads"]),
                params=_worst(got["params"], want["params"]), per_grad=per)


def run_case(case: Case, rank: int, cpu: bool) -> dict:
    """The comparison of ``case`` on this rank (module docstring); errors and what ran, per run."""
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    if case.dtype == "fp32":
        ref = _run(case, rank, 1, "fp32", None, offload=False, cpu=cpu, device=device)
        ours = _run(case, rank, 2, "fp32", _components(case.spec, case.tile), offload=True, cpu=cpu, device=device)
        return dict(ours=_errors(ours, ref), ran=ours["ran"], reference_ran=ref["ran"])
    ref = _run(case, rank, 1, "fp32", None, offload=False, cpu=cpu, device=device)
    ours = _run(case, rank, 2, "bf16", _components(case.spec, case.tile), offload=True, cpu=cpu, device=device)
    megatron = _run(case, rank, 2, "bf16", _only_attention(case.spec), offload=False, cpu=cpu, device=device)
    return dict(ours=_errors(ours, ref), megatron=_errors(megatron, ref), ran=ours["ran"],
                megatron_ran=megatron["ran"], reference_ran=ref["ran"])


def rank_main(rank: int, world: int, cases: list[Case], cpu: bool) -> dict:
    """Every case of ``cases`` on this rank (a ``run_distributed`` function): TF32 off, the CPU shim where ``cpu``."""
    if cpu:
        from megatron_peakflat.testing.megatron_cpu import install_cpu_shim

        install_cpu_shim()
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return {case.name: run_case(case, rank, cpu) for case in cases}


def check(results: list[dict], cases: list[Case]) -> None:
    """Assert what every case must show on every rank (module docstring)."""
    assert len(results) == 2
    for rank, per_case in enumerate(results):
        for case in cases:
            r, where = per_case[case.name], (case.name, rank)
            ran = r["ran"]
            # every component ran at CP 2: PipelinedLLEP in both MoE layers, Ring-DTP, SCO, OffloadStreamAdamW
            assert ran["dispatchers"] == 2 and ran["ep"] == case.ep, (where, ran)
            assert ran["vocab_calls"] >= 1 and ran["sco_packed"] > 0 and ran["optimizer"], (where, ran)
            assert ran["attention"], (where, "no context-parallel attention module", ran)
            if case.spec == "local":
                assert "SDPAttention" in ran["attention"], (where, ran["attention"])
            else:
                assert any(n.startswith("TE") for n in ran["attention"]), (where, ran["attention"])
            assert r["reference_ran"]["dispatchers"] == 0 and not r["reference_ran"]["optimizer"], (where, "reference")
            if case.tile:  # every layer's sublayer tiled, in the forward and in the checkpoint's recompute
                assert ran["tiled_calls"] >= 4 and ran["untiled_calls"] == 0, (where, ran)
            assert r["reference_ran"]["tiled_calls"] == 0, (where, "reference tiled")
            if case.skew >= 8:
                assert ran["on_expert1"] == (1.0, 1.0), (where, ran["on_expert1"])
            e = r["ours"]
            if case.dtype == "fp32":
                assert ran["param_dtypes"] == ["torch.float32"], (where, ran["param_dtypes"])
                assert e["loss"] <= FP32_TOL, (where, "loss", e["loss"])
                assert e["grad"][0] <= FP32_TOL, (where, "gradient", e["grad"])
                assert e["params"][0] <= FP32_TOL, (where, "parameter after the step", e["params"])
                continue
            m = r["megatron"]
            assert ran["param_dtypes"] == ["torch.bfloat16"] == r["megatron_ran"]["param_dtypes"], (where, ran)
            assert r["megatron_ran"]["dispatchers"] == 0, (where, "Megatron's own path ran a component")
            # not a copy of the reference: bf16 rounding shows in both
            assert e["loss"] > 0 or e["grad"][0] > 0, (where, "bf16 run equals the fp32 reference", e)
            assert e["loss"] <= m["loss"] + case.bf16_slack, (where, "loss", e["loss"], m["loss"])
            for name, err in e["per_grad"].items():
                assert err <= m["per_grad"][name] + case.bf16_slack, (where, "gradient", name, err,
                                                                      m["per_grad"][name])


# resume after SIGKILL at CP 2 ---------------------------------------------------------------------------------------

RESUME_GLOBAL_BATCH = 4
RESTORED_RNG = ("python", "numpy", "tracker:model-parallel-rng", "tracker:data-parallel-rng")
"""RNG states Megatron's load restores on every rank (tests/test_resume_fault.py says which it does not; on a GPU
the CUDA generator is compared too)."""


def resume_args(spec: str, iters: int = 6) -> list[str]:
    """The pretrain entry's flags of the resume runs: the tiny MoE GPT at --context-parallel-size 2 on two ranks with
    every component, full recompute, no dropout, --deterministic-mode; ``spec`` 'te' on TE's layers and CP attention
    (``--cp-comm-type p2p``), 'local' on the local spec with the SDPA attention."""
    from megatron_peakflat.testing.subproc import TINY_GPT_ARGS

    layers = (["--transformer-impl", "transformer_engine", "--cp-comm-type", "p2p"] if spec == "te"
              else ["--transformer-impl", "local", "--peakflat-attention", "sdpa"])
    return [*TINY_GPT_ARGS, "--global-batch-size", str(RESUME_GLOBAL_BATCH), "--train-iters", str(iters),
            "--context-parallel-size", "2", *layers,
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
            "--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
            "--peakflat-dispatch", "pipelined-llep", "--peakflat-vocab", "ring-dtp", "--peakflat-sco",
            "--peakflat-optimizer", "offload-stream"]


def sigkill_then_resume(tmp_path, monkeypatch, module: str, args: list[str], *, saved_at: int, killed_at: int,
                        last: int, compared_rng: tuple[str, ...] = RESTORED_RNG, timeout: int = 500) -> None:
    """``module`` (the pretrain entry with ``testing.pretrain_hooks``' hooks) on two ranks under torchrun: ``last``
    iterations straight; again with ``--save`` every ``saved_at``, SIGKILLed inside the forward of ``killed_at``;
    again with ``--load``. Every rank's iterations after ``saved_at`` equal the straight run's bit for bit: the loss
    and grad norm ``train_step`` returned, the batches read, the samples consumed and ``compared_rng``."""
    from megatron_peakflat.testing.pretrain_hooks import read_trace
    from tests._helpers import run_to_kill_or_end

    def run(trace: str, *extra: str, kill_at: int | None = None) -> str:
        return run_to_kill_or_end(monkeypatch, module, *args, *extra, trace=trace, kill_at=kill_at, nproc=2,
                                  timeout=timeout)

    ckpt = str(tmp_path / "ckpt")
    save = ("--save", ckpt, "--save-interval", str(saved_at))
    run(str(tmp_path / "straight"))
    killed_text = run(str(tmp_path / "killed"), *save, kill_at=killed_at)
    assert "Signal 9 (SIGKILL)" in killed_text, killed_text[-4000:]
    for rank in (0, 1):
        with open(tmp_path / "killed" / f"killed.rank{rank}") as f:
            assert f.read().startswith(f"iteration {killed_at}, in the forward"), rank
        assert sorted(read_trace(str(tmp_path / "killed"), rank)) == list(range(1, killed_at))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(saved_at)
    resumed_text = run(str(tmp_path / "resumed"), *save, "--load", ckpt)
    assert f"at iteration {saved_at}" in resumed_text, resumed_text[-4000:]
    assert "components on: dispatch, vocab, sco, optimizer" in resumed_text, resumed_text[-4000:]
    for rank in (0, 1):
        straight = read_trace(str(tmp_path / "straight"), rank)
        resumed = read_trace(str(tmp_path / "resumed"), rank)
        assert sorted(straight) == list(range(1, last + 1)), rank
        assert sorted(resumed) == list(range(saved_at + 1, last + 1)), rank
        assert len({straight[i]["loss"]["lm loss"][0] for i in straight}) > 1, "training moved no loss"
        for it in range(saved_at + 1, last + 1):
            a, b, where = straight[it], resumed[it], f"rank {rank}, iteration {it}"
            assert b["loss"] == a["loss"], (where, a["loss"], b["loss"])  # float.hex: bitwise
            assert b["grad_norm"] == a["grad_norm"] and b["grad_norm"] is not None, where
            assert b["batches"] == a["batches"] and b["batches"], where
            assert b["consumed_before"] == a["consumed_before"] == (it - 1) * RESUME_GLOBAL_BATCH, where
            assert {k: b["rng"][k] for k in compared_rng} == {k: a["rng"][k] for k in compared_rng}, where


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
"""CUDA devices on this host: the GPU twins of this driver's cases need 2."""
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="Transformer Engine does not import (tools/te_to_device.sh installs it); the "
                              "local spec's cases run without it")


def needs_two_gpus(cpu_twin: str) -> pytest.MarkDecorator:
    """Skip a GPU test module on fewer than 2 CUDA devices, naming where its CPU twin runs (``cpu_twin``)."""
    return pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices on one host, found {GPUS} ({cpu_twin})")
