"""SCO benchmark on one GPU: a Megatron GPT (local spec, torch-SDPA attention) under full recompute
(uniform, 1 layer), forward + backward of one long sequence, three ways on the same model and tokens:

- ``megatron-full-recompute``: Megatron's own full recompute (SCO off);
- ``peakflat``: SCO on with the flags' defaults (budget: a share of free host RAM; prefetch 1);
- ``save-on-cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the step.

Writes bench/results/sco.json. Each row's ``exact`` says whether its loss and every gradient equal
the SCO-off run bitwise. The peakflat row also carries the boundary bytes moved off the device at
peak and the predicted peak reduction ((chunks - 1 - prefetch) boundaries), to compare with the
measured one. Usage (one H200, ~2-3 min):

    python -m bench.sco                     # L=16, H=2048, S=65536
    python -m bench.sco --seq 131072 --layers 24 --hidden 4096 --heads 32   # bigger, slower
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from bench import harness


def setup() -> None:
    """One-rank process group and Megatron parallel state (TP = PP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def peakflat_configs(budget: int | None = None, prefetch: int = 1, pool: str = "torch") -> tuple[Any, Any]:
    """(SCO on, SCO off) configs, both with torch-SDPA attention for the local spec."""
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.recompute.config import SCOConfig

    on = PeakflatConfig(sco=SCOConfig(enabled=True, budget=budget, prefetch=prefetch, pool=pool),
                        general=GeneralConfig(attention="sdpa"))
    off = PeakflatConfig(sco=SCOConfig(enabled=False), general=GeneralConfig(attention="sdpa"))
    return on, off


def build_gpt(layers: int, hidden: int, heads: int, ffn: int, seq: int, vocab: int) -> Any:
    """bf16 GPTModel on the local spec, full recompute uniform 1 layer (call after megatron_peakflat.apply)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        normalization="RMSNorm", gated_linear_unit=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, pipeline_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq, position_embedding_type="rope")
    return model.cuda().bfloat16().train()


def batch(seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=g).cuda()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq, device="cuda").unsqueeze(0)}


def step(model: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward + backward of one microbatch; returns the loss (grads in p.grad).

    Gradients live in persistent buffers zeroed in place, as Megatron's DDP grad buffers do, so the
    peak is the step's activations and boundaries, not gradients allocated as backward proceeds.
    """
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    loss = losses.float().mean()
    loss.backward()
    return loss.detach()


def snapshot(model: Any, loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return loss.clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def same(a: Any, b: Any) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", default=None, help="SCO budget, e.g. 64GiB (default: the flag's default)")
    ap.add_argument("--native-pool", action="store_true",
                    help="also measure SCO on the compiled host pool (row peakflat-native; PEAKFLAT_JIT=1 builds it)")
    ap.add_argument("--max-seq-limit-gib", type=float, default=None,
                    help="also find the largest sequence (doubling from --seq, up to 8x) that trains under this "
                         "GPU memory limit, SCO off and on (one step per try; adds minutes)")
    args = ap.parse_args()
    import megatron_peakflat
    from megatron_peakflat.config_base import parse_size
    from megatron_peakflat.integration import recompute as sco_integration
    from megatron_peakflat.integration import state

    setup()
    on, off = peakflat_configs(parse_size(args.budget) if args.budget else None)
    megatron_peakflat.apply(on)  # patches SCO and SDPA attention; ``off`` only turns SCO off at call time
    ffn = args.ffn or 4 * args.hidden
    model = build_gpt(args.layers, args.hidden, args.heads, ffn, args.seq, args.vocab)
    b = batch(args.seq, args.vocab)
    boundary = args.seq * args.hidden * 2
    case = f"L={args.layers},H={args.hidden},S={args.seq},bf16,full-recompute-uniform-1"

    t0 = time.time()
    # Bitwise checks need a deterministic attention backward (flash attention accumulates dq with
    # atomics), so they run the same model on a 4K-token batch with SDPA's math backend.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    small = batch(min(args.seq, 4096), args.vocab)
    with sdpa_kernel(SDPBackend.MATH):
        state.set_current(off)
        ref = snapshot(model, step(model, small))
        assert same(ref, snapshot(model, step(model, small))), "the SCO-off baseline does not reproduce itself"
        state.set_current(on)
        got = snapshot(model, step(model, small))
        exact_sco = same(ref, got)
        state.set_current(off)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            soc = snapshot(model, step(model, small))
        exact_soc = same(ref, soc)
    del got, soc
    print(f"exactness runs: {time.time() - t0:.1f} s; sco exact={exact_sco}, save_on_cpu exact={exact_soc}", flush=True)

    rows = []
    state.set_current(off)
    rows.append(harness.run_row(case, "megatron-full-recompute", lambda: step(model, b), exact=True,
                                warmup=1, reps=args.reps, boundary_bytes=boundary))
    state.set_current(on)
    prefetch = on.sco.prefetch
    rows.append(harness.run_row(case, "peakflat", lambda: step(model, b), exact=exact_sco, warmup=1, reps=args.reps,
                                boundary_bytes=boundary,
                                predicted_saving_gib=round(max(args.layers - 1 - prefetch, 0) * boundary / 2**30, 4)))
    off_ = sco_integration.offloader()
    if off_ is not None:
        rows[-1].extra["offloaded_bytes_peak"] = off_.offloaded_bytes_peak
        rows[-1].extra["sco"] = off_.summary()  # counters over every SCO step so far (exactness run included)
    if args.native_pool:
        # the native pool maps and pins its whole budget up front: size it to the boundaries, not to host RAM
        native_budget = on.sco.budget or args.layers * boundary + (64 << 20)
        native, _ = peakflat_configs(native_budget, prefetch, pool="native")
        state.set_current(native)
        sco_integration.reset()
        rows.append(harness.run_row(case, "peakflat-native", lambda: step(model, b), exact=None, warmup=1,
                                    reps=args.reps, sco=None))
        o = sco_integration.offloader()
        rows[-1].extra["sco"] = o.summary() if o else None
        rows[-1].extra["pool"] = type(o.pool).__name__ if o else None
    state.set_current(off)

    def soc_step() -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return step(model, b)

    rows.append(harness.run_row(case, "save-on-cpu", soc_step, exact=exact_soc, warmup=1, reps=args.reps))
    base, ours = rows[0], rows[1]
    if base.peak_gib is not None and ours.peak_gib is not None:
        saved = base.peak_gib - ours.peak_gib
        pred = ours.extra["predicted_saving_gib"]
        ours.extra["measured_saving_gib"] = round(saved, 4)
        ours.extra["saving_vs_predicted"] = round(saved / pred, 4) if pred else None
        ours.extra["time_ratio_vs_off"] = round(base.ms / ours.ms, 4)
        print(f"peak saved {saved:.3f} GiB of {pred:.3f} GiB predicted ({saved / max(pred, 1e-9):.1%}); "
              f"speed vs SCO off {base.ms / ours.ms:.3f}x", flush=True)
    if args.max_seq_limit_gib:
        rows += max_seq_rows(model, args, on, off)
    harness.write("sco", rows)
    megatron_peakflat.remove()


def max_seq_rows(model: Any, args: Any, on: Any, off: Any) -> list[harness.Row]:
    """Largest sequence (doubling) whose step fits under ``--max-seq-limit-gib``, SCO off versus on."""
    from megatron_peakflat.integration import state

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.max_seq_limit_gib * 2**30 / total))
    rows = []
    for method, cfg in (("megatron-full-recompute", off), ("peakflat", on)):
        state.set_current(cfg)
        best = None
        seq = args.seq
        while seq <= 8 * args.seq:
            try:
                step(model, batch(seq, args.vocab))
                torch.cuda.synchronize()
                best = seq
            except torch.OutOfMemoryError:
                break
            finally:
                torch.cuda.empty_cache()
            seq *= 2
        rows.append(harness.Row(f"max-seq,L={args.layers},H={args.hidden},limit={args.max_seq_limit_gib}GiB",
                                method, None, None, None, {"max_seq": best}))
        print(f"{method}: largest sequence under {args.max_seq_limit_gib} GiB: {best}", flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


if __name__ == "__main__":
    main()
