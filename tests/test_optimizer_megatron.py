"""OffloadStreamAdamW inside Megatron's DistributedOptimizer, on CPU with gloo (world 2, DP 2).

- Training with ``--peakflat-optimizer offload-stream`` (Megatron's HybridDeviceOptimizer path:
  optimizer_cpu_offload + precision-aware optimizer) equals the unpatched Megatron distributed
  optimizer (torch AdamW on fp32 main params) in loss and in every parameter, 10 steps, lr changed
  at step 6, gradient clipping on.
- Checkpoint: save at step 5 (DistributedOptimizer.state_dict + save_parameter_state, Megatron's
  legacy --save path), build a fresh model and optimizer, load, run steps 6-10: bitwise equal to the
  uninterrupted run, for the 'gpu' and 'cpu' engines.
- Each DP rank's OffloadStreamAdamW holds only its shard.
"""

from __future__ import annotations

import os
import tempfile

import torch

from megatron_peakflat.testing.distributed import run_distributed

STEPS, SAVE_AT, VOCAB, SEQ = 10, 5, 128, 16


def _build(peakflat: bool, seed: int = 7):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_peakflat.testing.megatron_cpu import build_tiny_gpt, init_megatron_parallel, tiny_transformer_config

    init_megatron_parallel(seed=seed)
    config = tiny_transformer_config()
    model = build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                        grad_reduce_in_fp32=True), model)
    extra = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, optimizer_offload_fraction=1.0) if peakflat else {}
    opt_cfg = OptimizerConfig(optimizer="adam", lr=2e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                              adam_eps=1e-8, clip_grad=1.0, use_distributed_optimizer=True, bf16=False, **extra)
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    return ddp, opt


def _train_step(ddp, opt, step: int, rank: int):
    from megatron_peakflat.testing.megatron_cpu import gpt_batch, gpt_loss

    if step == 6:
        for g in opt.param_groups:
            g["lr"] = 1e-3
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = gpt_loss(ddp, gpt_batch(SEQ, 2, VOCAB, seed=100 * step + rank))
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok
    return loss.detach().clone(), float(grad_norm)


def _params(ddp) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ddp.named_parameters()}


def _rank_main(rank: int, world: int, ckpt_dir: str):
    import megatron_peakflat
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.optimizer import OffloadStreamAdamW
    from megatron_peakflat.optimizer.config import OptimizerConfig as PfOpt
    from megatron_peakflat.testing.megatron_cpu import install_cpu_shim

    install_cpu_shim()
    out: dict = {}

    # 1. unpatched Megatron
    megatron_peakflat.remove()
    ddp, opt = _build(peakflat=False)
    ref = [(*_train_step(ddp, opt, s, rank), _params(ddp)) for s in range(1, STEPS + 1)]

    for engine in ("gpu", "cpu"):
        cfg = PeakflatConfig(optimizer=PfOpt(impl="offload-stream", bucket=3000, engine=engine, slots=2))
        megatron_peakflat.apply(cfg)
        ddp, opt = _build(peakflat=True)
        inner = opt.optimizer
        assert isinstance(inner, OffloadStreamAdamW), type(inner)
        from megatron.core.optimizer.distrib_optimizer import HybridDeviceOptimizer

        assert isinstance(inner, HybridDeviceOptimizer)
        shard = sum(p.numel() for g in inner.param_groups for p in g["params"])
        total = sum(p.numel() for p in ddp.parameters())
        run = []
        ckpt = os.path.join(ckpt_dir, f"{engine}-rank{rank}")
        for s in range(1, STEPS + 1):
            run.append((*_train_step(ddp, opt, s, rank), _params(ddp)))
            if s == SAVE_AT:
                torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict()}, ckpt + ".pt")
                opt.save_parameter_state(os.path.join(ckpt_dir, f"{engine}-param-state.pt"))
        # resume from step 5 into a fresh model and optimizer (different init seed: all comes from the checkpoint)
        ddp2, opt2 = _build(peakflat=True, seed=99)
        sd = torch.load(ckpt + ".pt", weights_only=False)
        ddp2.load_state_dict(sd["model"])
        opt2.load_state_dict(sd["optimizer"])
        opt2.load_parameter_state(os.path.join(ckpt_dir, f"{engine}-param-state.pt"))
        resumed = [(*_train_step(ddp2, opt2, s, rank), _params(ddp2)) for s in range(SAVE_AT + 1, STEPS + 1)]
        out[engine] = dict(run=run, resumed=resumed, shard=shard, total=total)
        megatron_peakflat.remove()
    out["ref"] = ref
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def test_offload_stream_in_distributed_optimizer_world2():
    with tempfile.TemporaryDirectory() as d:
        results = run_distributed(_rank_main, 2, d, timeout=280)
    for rank, res in enumerate(results):
        ref = res["ref"]
        for engine in ("gpu", "cpu"):
            r = res[engine]
            assert r["shard"] < r["total"]  # each DP rank streams only its shard
            for s, ((l_ref, n_ref, p_ref), (l, n, p)) in enumerate(zip(ref, r["run"]), start=1):
                assert abs(l - l_ref).item() <= 1e-5 * abs(l_ref).item(), (rank, engine, s, l, l_ref)
                assert abs(n - n_ref) <= 1e-5 * abs(n_ref)
                assert set(p) == set(p_ref)
                for name in p_ref:
                    assert _rel(p[name], p_ref[name]) <= 1e-5, (rank, engine, s, name, _rel(p[name], p_ref[name]))
            for (l_a, n_a, p_a), (l_b, n_b, p_b) in zip(r["run"][SAVE_AT:], r["resumed"]):
                assert torch.equal(l_a, l_b) and n_a == n_b
                assert all(torch.equal(p_a[k], p_b[k]) for k in p_a)
