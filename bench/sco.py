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
    python -m bench.sco --max-seq           # largest trainable sequence under a memory limit (~3 min)
    python -m bench.sco --max-seq --dry-run # the same search on CPU with tiny shapes (~15 s, no results)

``--max-seq`` (issue #4: a larger trainable sequence at the same memory limit) finds, for SCO off,
SCO on and ``save_on_cpu``, the largest sequence (a multiple of ``--seq-step``) whose forward +
backward fits under ``--mem-limit-gib``: the step's ``max_memory_allocated`` (model, gradients and
batch included) at most the limit, an out-of-memory error counting as not fitting. The default limit
is what SCO off reaches at ``--seq`` (rounded up to 10 MiB), so the rows answer "how long a sequence
does each method train in the memory that SCO off needs for --seq tokens". Each method first runs
``--seq / 4`` and ``--seq`` tokens; the line through those two peaks gives the first guess, then
the search doubles its distance from the guess while tries stay on one side and bisects the bracket
(``harness.largest_fitting``). ``--max-seq-budget-s`` bounds the whole search: a try that its
estimated time (a S + b S^2 through the two probes) would push past a method's share is not
started, and the row says ``complete: false`` (its ``max_seq`` is then a lower bound). The rows
(case ``max-seq,L=..,H=..,limit=..GiB``; ``peak_gib``: the step at ``max_seq`` above the memory
allocated before it; ``ms``: that try's wall time; ``extra.tried``: every try) are merged into
bench/results/sco.json by (case, method), keeping the rows of the main run. With ``--dry-run`` the
search runs on CPU under LiveBytesMeter, where offloaded copies are CPU memory too: it checks the
search, the rows and the merge, not the savings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import harness


def setup(cpu: bool = False) -> None:
    """One-rank process group and Megatron parallel state (TP = PP = 1); ``cpu``: gloo and the CPU shim."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if cpu:
        from megatron_peakflat.testing import megatron_cpu

        megatron_cpu.install_cpu_shim()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
    if cpu:
        from megatron_peakflat.testing import megatron_cpu

        megatron_cpu.init_megatron_parallel(cpu=True, seed=1234)
        return
    torch.cuda.set_device(0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def peakflat_configs(budget: int | None = None, prefetch: int = 1, pool: str = "torch") -> tuple[Any, Any]:
    """(SCO on, SCO off) configs, both with torch-SDPA attention for the local spec."""
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.sco.config import SCOConfig

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
    harness.repeats_arg(ap)
    ap.add_argument("--budget", default=None, help="SCO budget, e.g. 64GiB (default: the flag's default)")
    ap.add_argument("--native-pool", action="store_true",
                    help="also measure SCO on the compiled host pool (row peakflat-native; PEAKFLAT_JIT=1 builds it)")
    ap.add_argument("--max-seq", action="store_true",
                    help="only the largest-sequence search (see the module docstring); rows merged into sco.json")
    ap.add_argument("--mem-limit-gib", type=float, default=None,
                    help="--max-seq: the memory limit (default: SCO off's peak at --seq, model included)")
    ap.add_argument("--seq-step", type=int, default=8192, help="--max-seq: sequences are multiples of this")
    ap.add_argument("--max-seq-cap", type=int, default=None, help="--max-seq: largest sequence tried (default 8 x --seq)")
    ap.add_argument("--max-seq-budget-s", type=float, default=170.0,
                    help="--max-seq: seconds for the whole search, shared by the three methods (default %(default)s)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the --max-seq search on CPU with tiny shapes and LiveBytesMeter; merges into a temporary "
                         "copy of sco.json, never the real one")
    args = ap.parse_args()
    if args.dry_run or args.max_seq:
        max_seq_main(args)
        return
    import megatron_peakflat
    from megatron_peakflat.config_base import parse_size
    from megatron_peakflat.integration import sco as sco_integration
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
    configs = {"megatron-full-recompute": off, "peakflat": on, "save-on-cpu": off}
    if args.native_pool:
        configs["peakflat-native"] = native

    def step_of(row: harness.Row):  # noqa: ANN202
        fn = soc_step if row.method == "save-on-cpu" else (lambda: step(model, b))

        def run() -> torch.Tensor:
            state.set_current(configs[row.method])
            return fn()
        return run

    harness.more_rounds(rows, step_of, args.rounds, warmup=1, reps=args.reps)
    state.set_current(off)
    base, ours = rows[0], rows[1]
    if base.peak_gib is not None and ours.peak_gib is not None:
        saved = base.peak_gib - ours.peak_gib
        pred = ours.extra["predicted_saving_gib"]
        ours.extra["measured_saving_gib"] = round(saved, 4)
        ours.extra["saving_vs_predicted"] = round(saved / pred, 4) if pred else None
        harness.stamp([base, ours])  # measured here, on one card: the ratio is taken between rows of that card
        ours.extra["time_ratio_vs_off"] = round(harness.ratio(base, ours), 4)
        print(f"peak saved {saved:.3f} GiB of {pred:.3f} GiB predicted ({saved / max(pred, 1e-9):.1%}); "
              f"speed vs SCO off {ours.extra['time_ratio_vs_off']:.3f}x (both on {ours.card})", flush=True)
    harness.print_ratio_summary(rows)
    harness.write("sco", rows)
    megatron_peakflat.remove()


# ------------------------------------------------------------------------------------------------
# --max-seq: the largest trainable sequence under a memory limit

MAX_SEQ_METHODS = ("megatron-full-recompute", "peakflat", "save-on-cpu")
BUDGET_SHARE = {"megatron-full-recompute": 0.15, "peakflat": 0.45, "save-on-cpu": 1.0}
"""Cumulative share of --max-seq-budget-s by which each method's search must end (save-on-cpu's tries
are the longest: its limit sequence is the largest and each step pays host copies)."""


def _gib(x: float | None) -> str:
    return "None" if x is None else (f"{x:.2f}" if x >= 1 else f"{x:.4g}")


def max_seq_main(args: Any) -> None:
    """--max-seq (and --dry-run): search each method's largest sequence, merge the rows into sco.json."""
    import megatron_peakflat
    from megatron_peakflat.integration import sco as sco_integration
    from megatron_peakflat.integration import state

    cpu = args.dry_run
    if cpu:  # tiny shapes: the search, the rows and the merge run end to end in seconds
        args.layers, args.hidden, args.heads, args.ffn, args.vocab = 3, 64, 4, 128, 128
        args.seq, args.seq_step = 256, 32
    step_len = args.seq_step
    if args.seq % step_len or args.seq < 2 * step_len:
        raise SystemExit(f"--seq {args.seq} must be a multiple of --seq-step {step_len}, at least twice it")
    cap = args.max_seq_cap or 8 * args.seq
    setup(cpu)
    on, off = peakflat_configs()
    megatron_peakflat.apply(on)  # patches SCO and SDPA attention; ``off`` only turns SCO off at call time
    ffn = args.ffn or 4 * args.hidden
    model = build_gpt(args.layers, args.hidden, args.heads, ffn, cap, args.vocab)

    def method_step(method: str) -> Callable[[dict[str, torch.Tensor]], Any]:
        def run(b: dict[str, torch.Tensor]) -> Any:
            state.set_current(on if method == "peakflat" else off)
            ctx = (torch.autograd.graph.save_on_cpu(pin_memory=not cpu) if method == "save-on-cpu"
                   else contextlib.nullcontext())
            with ctx:
                return step(model, b)
        return run

    t_start = time.monotonic()
    limit = args.mem_limit_gib
    above: dict[tuple[str, int], tuple[float, float]] = {}  # (method, seq) -> (GiB above the allocation before, ms)

    def attempt(method: str, seq: int) -> harness.Trial:
        fn = method_step(method)
        t0 = time.perf_counter()
        peak = rel = None
        error = None
        try:
            b = batch(seq, args.vocab)
            peak, rel = harness.peak_once(lambda: fn(b), cpu=cpu)
        except torch.OutOfMemoryError:
            error = "OOM"
        finally:
            b = None
            if error and method == "peakflat":
                sco_integration.reset()  # nothing of a failed step may linger in the host pool
            gc.collect()
            if not cpu:
                torch.cuda.empty_cache()
        secs = time.perf_counter() - t0
        peak_gib = None if peak is None else peak / 2**30
        fits = peak_gib is not None and (limit is None or peak_gib <= limit)
        if rel is not None:
            above[method, seq] = (rel / 2**30, secs * 1e3)
        t = harness.Trial(seq, fits, None if peak_gib is None else round(peak_gib, 6), round(secs, 3), error)
        print(f"[max-seq] {method:24s} S={seq:>8} peak {_gib(peak_gib):>8} GiB "
              f"{'fits' if fits else 'over'} (limit {_gib(limit)} GiB) {error or ''} "
              f"{secs:6.1f} s, {time.monotonic() - t_start:6.0f} s total", flush=True)
        return t

    rows: list[harness.Row] = []
    results: dict[str, int | None] = {}
    for method in MAX_SEQ_METHODS:
        method_step(method)(batch(step_len, args.vocab))  # warm-up: workspaces, pools, first-call costs
        small_len = max(step_len, args.seq // 4 // step_len * step_len)
        small = attempt(method, small_len)
        base = attempt(method, args.seq)
        if limit is None:  # SCO off's peak at --seq, rounded up to 10 MiB, is the limit
            if base.peak_gib is None:
                raise SystemExit(f"SCO off does not run at --seq {args.seq} ({base.error}): pass --mem-limit-gib")
            limit = math.ceil(base.peak_gib * 100) / 100 if not cpu else base.peak_gib * (1 + 1e-9)
            small, base = (dataclasses.replace(t, fits=t.peak_gib is not None and t.peak_gib <= limit)
                           for t in (small, base))
            print(f"[max-seq] limit {_gib(limit)} GiB: SCO off's peak at S={args.seq}", flush=True)
        known = [small, base]
        guess = float(args.seq)
        if base.peak_gib is not None and small.peak_gib is not None and base.peak_gib > small.peak_gib:
            slope = (base.peak_gib - small.peak_gib) / (base.size - small.size)  # peaks grow linearly in S
            guess = args.seq + (limit - base.peak_gib) / slope
        # A try's time: a S + b S^2 (attention is quadratic, copies linear), through the two probes.
        x0, t0_, x1, t1_ = small.size, small.seconds, base.size, base.seconds
        quad = max(0.0, (t1_ / x1 - t0_ / x0) / (x1 - x0))
        lin = max(0.0, t1_ / x1 - quad * x1)
        deadline = t_start + args.max_seq_budget_s * BUDGET_SHARE[method]
        best, first_fail, tries, complete = harness.largest_fitting(
            lambda n, m=method: attempt(m, n), step=step_len, start=int(max(step_len, min(guess, cap))),
            limit_size=cap, known=known, deadline=deadline, cost=lambda n, a=lin, b=quad: 1.15 * (a * n + b * n * n))
        results[method] = best
        rel_gib, ms = above.get((method, best), (None, None)) if best else (None, None)
        peak_abs = next((t.peak_gib for t in tries if t.size == best), None)
        extra = {"max_seq": best, "first_fail": first_fail, "complete": complete, "limit_gib": round(limit, 4),
                 "step": step_len, "peak_abs_gib": peak_abs, "guess": int(guess),
                 "tried": [{"seq": t.size, "fits": t.fits, "peak_gib": t.peak_gib,
                            "above_gib": round(above[method, t.size][0], 4) if (method, t.size) in above else None,
                            "s": t.seconds, **({"error": t.error} if t.error else {})} for t in tries]}
        rows.append(harness.Row(f"max-seq,L={args.layers},H={args.hidden},limit={_gib(limit)}GiB", method,
                                None if rel_gib is None else round(rel_gib, 4), None if ms is None else round(ms, 1),
                                None, extra))
        print(f"[max-seq] {method}: largest sequence under {_gib(limit)} GiB: {best} (first over: {first_fail}"
              f"{'' if complete else '; search cut by the time budget, a lower bound'})", flush=True)
    off_best = results[MAX_SEQ_METHODS[0]]
    for r in rows:
        r.extra["vs_off"] = round(r.extra["max_seq"] / off_best, 4) if off_best and r.extra["max_seq"] else None
    megatron_peakflat.remove()
    if cpu:
        out = Path(tempfile.mkdtemp(prefix="sco-dry-run-")) / "sco.json"
        if (harness.RESULTS / "sco.json").exists():
            shutil.copy(harness.RESULTS / "sco.json", out)
        before = len(json.loads(out.read_text())["rows"]) if out.exists() else 0
        saved_out = os.environ.pop("OUT", None)  # a dry run never lands in the results that come back
        try:
            harness.write("sco", rows, out=out, merge=True)
        finally:
            if saved_out is not None:
                os.environ["OUT"] = saved_out
        after = json.loads(out.read_text())["rows"]
        assert len(after) == before + len(rows), "the merge lost or duplicated rows"
        assert all(r.extra["max_seq"] for r in rows), "a tiny model must fit at least one step"
        print(f"dry run: {len(after)} rows in {out} ({before} kept + {len(rows)} max-seq); "
              f"{time.monotonic() - t_start:.1f} s of search")
        return
    harness.write("sco", rows, merge=True)


if __name__ == "__main__":
    main()
