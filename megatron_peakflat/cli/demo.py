"""``python -m megatron_peakflat.demo``: the main job on its built-in defaults (``make demo``).

It trains a small Megatron-Core MoE GPT twice on the same data and the same initial weights:
once as Megatron ships it (but for its core attention: both runs use peakflat's SDPA attention, as
``--peakflat-attention auto`` does without Transformer Engine, so that only the four components differ),
once with every peakflat component that is available. It prints one progress line per iteration while it
trains, then both loss curves side by side (they must agree: the components change schedules, not math),
a table of the four peaks with what each component did, and the planner's table for a real model. The loss
table is also written to ``demo_out/loss_curves.txt`` and, where matplotlib is installed, the curves to
``demo_out/loss_curves.png`` beside it (``--out`` picks another directory).

With CUDA it runs one rank per GPU over NCCL. Without, it runs 2 ranks on CPU with gloo through the
Megatron-on-CPU shim from ``megatron_peakflat.testing`` and says so.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..components import COMPONENTS
from ..config_base import format_bytes

log = logging.getLogger("megatron_peakflat")

PEAKS = [(c.peak, c.replaces, c.name, c.label) for c in COMPONENTS]
"""(the peak, the Megatron part that holds it, the component, its label), one per component."""


def available_components() -> dict[str, str | None]:
    """For each component: None when its integration imports, else the reason it is not available."""
    from ..integration.registry import PATCHES

    out: dict[str, str | None] = {}
    for comp in (c.name for c in COMPONENTS):
        reason = None
        for p in PATCHES:
            if p.component != comp:
                continue
            mod, fn = p.factory.split(":")
            try:
                getattr(importlib.import_module(mod), fn)
            except (ImportError, AttributeError) as e:
                reason = f"{type(e).__name__}: {e}"
                break
        out[comp] = reason
    return out


def _demo_batches(n: int, seq: int, mb: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences that count upward modulo vocab from a random start: learnable, so the loss falls."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (mb, 1), generator=g)
        step = torch.randint(1, 4, (mb, 1), generator=g)
        seq_tokens = (start + step * torch.arange(seq + 1)) % vocab
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).view(1, 1, seq, seq).expand(mb, 1, -1, -1)
        out.append({
            "tokens": seq_tokens[:, :-1].contiguous(),
            "labels": seq_tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(mb, seq),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(mb, -1).contiguous(),
            "attention_mask": mask.contiguous(),
        })
    return out


def _run(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank: train with peakflat off, then on, from the same weights and data."""
    import warnings

    from .._ext import quiet_cpp_extension

    # Megatron warns at length about absent TE/apex (the header says which are absent), lists its gradient
    # buckets at INFO, and torch notes the absent CUDA runtime when Megatron imports cpp_extension: none of it is
    # the demo's
    warnings.filterwarnings("ignore")
    quiet_cpp_extension()
    import megatron_peakflat
    from megatron_peakflat import stats
    from megatron_peakflat.config import GeneralConfig, PeakflatConfig
    from megatron_peakflat.dispatch.config import DispatchConfig
    from megatron_peakflat.testing.live_bytes import LiveBytesMeter
    from megatron_peakflat.testing.megatron_cpu import build_tiny_gpt, init_megatron_parallel, tiny_transformer_config
    from megatron_peakflat.testing.train_loop import build_training, train_steps

    cuda = opts["cuda"]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # peakflat's own rank filter (installed by apply) prefixes the lines that differ per rank with the rank
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    init_megatron_parallel(tp=1, ep=world, cpu=not cuda)
    on = opts["components"]
    batches = _demo_batches(opts["steps"] * opts["microbatches"], opts["seq"], opts["mb"], opts["vocab"], seed=11)

    def one_run(peakflat: bool) -> dict[str, Any]:
        megatron_peakflat.remove()
        stats.reset()
        base = {"dispatch": DispatchConfig(chunk_cap=opts["chunk_cap"])}  # each component off, at the demo's knobs
        cfg = PeakflatConfig(
            **{c.name: c.turned_on(base.get(c.name)) if peakflat and c.name in on else base.get(c.name, c.config_class())
               for c in COMPONENTS},
            general=GeneralConfig(attention="sdpa"),
        )
        megatron_peakflat.apply(cfg)
        torch.manual_seed(1234)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234, inference_rng_tracker=not cuda)
        tcfg = tiny_transformer_config(
            num_layers=opts["layers"], hidden_size=opts["hidden"], num_attention_heads=4, ffn_hidden_size=2 * opts["hidden"],
            num_moe_experts=opts["experts"], moe_router_topk=2, moe_ffn_hidden_size=opts["hidden"],
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        )
        model = build_tiny_gpt(tcfg, vocab_size=opts["vocab"], seq_len=opts["seq"])
        if cuda:
            model.cuda()
        offload = cfg.optimizer.impl != "megatron"
        setup = build_training(model, tcfg, seq_len=opts["seq"], micro_batch=opts["mb"], lr=3e-3,
                               optimizer_cpu_offload=offload)
        label = "peakflat" if peakflat else "megatron"
        last = [time.perf_counter()]

        def progress(_step: int, loss: float) -> None:
            """One line per iteration, from rank 0: which run, the iteration, its loss and time."""
            now = time.perf_counter()
            if rank == 0:
                print(f"  [{label}] iteration {len(setup.losses):>3}/{opts['steps']}  lm loss {loss:.6f}  "
                      f"{now - last[0]:6.2f} s", flush=True)
            last[0] = now

        t0 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            train_steps(setup, batches, num_microbatches=opts["microbatches"], device=device, on_step=progress)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            mbs = opts["microbatches"]
            train_steps(setup, batches[:mbs], num_microbatches=mbs, on_step=progress)
            with LiveBytesMeter() as meter:  # one metered step: the meter slows every op
                train_steps(setup, batches[mbs: 2 * mbs], num_microbatches=mbs, on_step=progress)
            train_steps(setup, batches[2 * mbs:], num_microbatches=mbs, on_step=progress)
            peak = meter.peak
        elapsed = time.perf_counter() - t0
        return {"losses": list(setup.losses), "peak": peak, "seconds": elapsed, "stats": stats.snapshot(),
                "enabled": cfg.enabled}

    off = one_run(False)
    on_run = one_run(True)
    megatron_peakflat.remove()
    return {"off": off, "on": on_run}


def loss_table(off: list[float], on: list[float], rtol: float) -> tuple[str, bool]:
    """The two loss curves side by side, and whether they agree within ``rtol`` (same length, finite)."""
    lines = [f"{'step':>4}  {'megatron':>12}  {'peakflat':>12}  {'|diff|':>10}"]
    worst = 0.0
    for i, (a, b) in enumerate(zip(off, on)):
        d = abs(a - b)
        worst = max(worst, d / max(abs(a), 1e-12))
        lines.append(f"{i + 1:>4}  {a:12.6f}  {b:12.6f}  {d:10.2e}")
    agree = worst <= rtol and len(off) == len(on) and all(map(math.isfinite, on))
    lines.append(f"largest relative difference {worst:.2e} -> {'AGREE' if agree else 'DISAGREE'} (tolerance {rtol:.0e})")
    return "\n".join(lines), agree


def write_loss_curves(off: list[float], on: list[float], table: str, out: Path, title: str) -> list[str]:
    """Write ``table`` to ``out/loss_curves.txt`` and the two curves to ``out/loss_curves.png`` beside it; without
    matplotlib the PNG is skipped. Returns the lines to print about what was written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_curves.txt").write_text(table + "\n")
    said = [f"loss table written to {out / 'loss_curves.txt'}"]
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return said + ["loss curves PNG skipped: matplotlib is not installed (pip install matplotlib)"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    steps = range(1, len(off) + 1)
    ax.plot(steps, off, "o-", label="Megatron-Core (peakflat off)")
    ax.plot(range(1, len(on) + 1), on, "x--", label="peakflat on")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)
    return said + [f"loss curves written to {out / 'loss_curves.png'}"]


def _print_report(res: dict[str, Any], opts: dict[str, Any], unavailable: dict[str, str | None]) -> bool:
    off, on = res["off"], res["on"]
    print("\n== loss curves (same weights, same data) ==")
    table, agree = loss_table(off["losses"], on["losses"], opts["rtol"])
    print(table)
    title = (f"{opts['layers']}-layer MoE GPT, {opts['experts']} experts, {opts['world']} ranks "
             f"({'CUDA' if opts['cuda'] else 'CPU'}): same weights, same data")
    for line in write_loss_curves(off["losses"], on["losses"], table, Path(opts["out"]), title):
        print(line)

    print("\n== the four peaks ==")
    print(f"{'peak':22s} {'Megatron part':46s} {'component':18s} {'status':14s} what it did")
    for peak, part, comp, name in PEAKS:
        if unavailable.get(comp):
            status, did = "not available", unavailable[comp][:60]
        elif on["enabled"].get(comp):
            status = "on"
            st = on["stats"].get(comp, {})
            did = ", ".join(f"{k}={v}" for k, v in st.items()) or "(recorded nothing)"
        else:
            status, did = "off", ""
        print(f"{peak:22s} {part:46s} {name:18s} {status:14s} {did}")
    where = "GPU max_memory_allocated" if opts["cuda"] else "live bytes of one step (CPU meter)"
    print(f"\nwhole-step peak ({where}): megatron {format_bytes(off['peak'])}, peakflat {format_bytes(on['peak'])}")
    print(f"time: megatron {off['seconds']:.1f} s, peakflat {on['seconds']:.1f} s "
          "(tiny model: the schedules' overhead, not their benefit, shows at this size)")
    return agree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mb", type=int, default=2, help="micro-batch size")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--chunk-cap", type=int, default=32, help="PipelinedLLEP chunk cap (small, so chunking shows)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="loss agreement tolerance (fp32)")
    ap.add_argument("--no-plan", action="store_true", help="skip the planner table at the end")
    ap.add_argument("--out", default="demo_out", help="directory for loss_curves.txt and loss_curves.png")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() if a.device == "auto" else a.device == "cuda"
    world = a.world or (torch.cuda.device_count() if cuda else 2)
    if world > 1 and a.experts % world:
        raise SystemExit(f"--experts {a.experts} must be divisible by --world {world} (EP = world)")
    if cuda:
        print(f"megatron-peakflat demo: {world} rank(s) on CUDA ({torch.cuda.get_device_name()}), NCCL")
    else:
        print(f"megatron-peakflat demo: no CUDA here, so {world} ranks run on CPU with gloo through the "
              "Megatron-on-CPU shim (megatron_peakflat.testing); GPU figures come from bench/ on a GPU machine")
    unavailable = available_components()
    comps = [c for c, why in unavailable.items() if why is None]
    print(f"components available: {', '.join(comps) or 'none'}; "
          f"not available: {', '.join(c for c, w in unavailable.items() if w) or 'none'}")
    print(f"model: Megatron-Core GPTModel, {a.layers} layers, hidden {a.hidden}, {a.experts} experts top-2, "
          f"vocab {a.vocab}, seq {a.seq}, EP={world}, full recompute, distributed optimizer, {a.steps} steps")
    opts = dict(vars(a), cuda=cuda, components=comps, world=world)
    from ..testing.distributed import run_distributed

    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the ranks' imports: Megatron on absent TE/apex, at length

    t0 = time.perf_counter()
    results = run_distributed(_run, world, opts, timeout=1800, backend="nccl" if cuda else "gloo")
    print(f"(both runs took {time.perf_counter() - t0:.0f} s)")
    ok = _print_report(results[0], opts, unavailable)
    if not a.no_plan:
        # A fixed cluster, so that the table reads the same on a laptop and on a GPU node with little host RAM.
        print("\n== peak planner: gpt-oss-120b at 1M context on 16 GPUs of 80 GiB, 8 per node, 2 TiB host per node ==")
        try:
            from .plan import main as plan_main

            plan_main(["--preset", "gpt-oss-120b", "--seq-len", "1048576", "--gpus", "16", "--gpus-per-node", "8",
                       "--hbm-gib", "80", "--host-gib", "2048"])
        except ImportError as e:
            print(f"planner not available: {e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
