"""PipelinedLLEP benchmark on one GPU (EP=1): Megatron's MoELayer (local spec, SequentialMLP, bf16,
64 experts top-8, SwiGLU, F=1536) forward + backward, three ways on the same layer, weights and tokens:

- ``megatron-alltoall``: Megatron's own alltoall dispatcher (the layer as Megatron builds it);
- ``llep-unchunked``: PipelinedLLEP with one chunk (the plan and recompute, no chunking);
- ``peakflat``: PipelinedLLEP with the flags' defaults (chunk cap auto = 8192 x top-k pairs, at most 64 chunks, chunk
  membership 'auto' = 'expert': each flow cut in expert order; all-to-alls packed, and at EP > 1 a call
  the cap splits overlapped, in at least min(8, 2K) chunks);
- ``peakflat-strided`` / ``peakflat-expert`` / ``peakflat-hybrid``: the defaults with that membership
  (strided: token i in chunk i mod K, every chunk reads every expert's weights; expert: each chunk a
  few experts' rows per destination; hybrid: experts under 3/4 of the mean load expert-major, the
  others strided);
- ``peakflat-unpacked``: one all-to-all per piece instead of one packed buffer;
- ``peakflat-c<N>``: chunk cap N with up to 1024 chunks, so that the cap alone sets K;
- ``peakflat-overlap`` (EP > 1 only): the defaults plus ``--peakflat-dispatch-overlap`` (every call);
- ``peakflat-nooverlap``: the defaults with ``--peakflat-dispatch-overlap-min-chunks 0`` (the cap's K,
  no call overlapped).

At EP=1 the plan is trivial; chunking alone bounds the expert activations. Under ``torchrun
--nproc-per-node P`` every rank is one expert-parallel group (EP=P, 64/P experts each), holds its own
tokens, and a row reports the max over ranks of the time and of the peak. The layer is wrapped in
Megatron's DDP (fp32 main_grad), as in training, so every method's weight gradients land in the same
preallocated buffer. Regimes (the ``regime`` part of the case string):

- ``recompute=full``: the layer runs inside ``tensor_parallel.checkpoint`` (what full recompute does
  to a transformer layer), identically for every method;
- ``recompute=moe``: Megatron's ``--recompute-modules moe`` for the Megatron peer; PipelinedLLEP runs
  without it (it recomputes its chunks itself), as a user would configure it.

Skewed routing: a share of the tokens (30%, 80%, 95%) gets +10 on the logits of ``--hot`` experts, so
those tokens all route to them. ``exact`` compares the output, the input gradient and every
parameter's main_grad with the Megatron peer's (bf16-level relative tolerance ``--tol``).

Usage (one H200, no TE):
    python -m bench.dispatch                      # H=4096 grid + H=7168 at 32K/64K, ~4-5 min
    python -m bench.dispatch --hidden 4096 --tokens 32768 --skews 0,95 --regimes full
    python -m bench.dispatch --dry-run            # tiny shapes on CPU (gloo, Megatron CPU shim): checks only
    python -m bench.dispatch --repeats 5 ...      # every method of a case timed five times in turn (default 3)
    torchrun --nproc-per-node 2 bench/dispatch.py --hidden 4096 --tokens 32768,65536 --skews 0,95   # EP=2
    python -m bench.dispatch --experts-impl te ...   # with TE: every method on TE's grouped experts
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch

from bench import harness

OURS_DEFAULT = "peakflat"
EXPERTS_IMPLS = ("sequential", "grouped", "te")
"""``build_layer``'s ``experts_impl`` values (the ``--experts-impl`` flag here and in profile_dispatch.py)."""


def setup(cpu: bool) -> None:
    """One process group over every rank, all of them one expert-parallel group (EP = world size)."""
    import torch.distributed as dist

    from megatron_peakflat.testing import megatron_cpu

    P, rank = harness.world()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=P)
    megatron_cpu.init_megatron_parallel(ep=P, cpu=cpu)


def build_layer(hidden: int, experts: int, topk: int, ffn: int, cpu: bool, ddp: bool = True,
                dtype: torch.dtype | None = None, experts_impl: str = "sequential",
                activation_fusion: bool = False) -> tuple[Any, Any]:
    """(DDP-wrapped MoELayer, the MoELayer) built after ``megatron_peakflat.apply`` (so it holds both dispatchers).
    ``activation_fusion``: Megatron's fused SwiGLU (its training default; a torch.compile'd function on the GPU).

    ``ddp=False`` returns the bare layer twice (weight gradients in ``.grad``). ``experts_impl``:
    SequentialMLP (``"sequential"``), TEGroupedMLP in TE's layout on plain torch (``"grouped"``, see
    ``megatron_cpu.gpt_layer_spec``), or Transformer Engine's own MoE spec (``"te"``: TEGroupedMLP on
    TE's GroupedLinear, with TE's fused permute in Megatron's dispatcher, what NGC users run)."""
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_peakflat.testing import megatron_cpu

    dtype = dtype or (torch.float32 if cpu else torch.bfloat16)
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=max(1, hidden // 128), ffn_hidden_size=4 * hidden,
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=activation_fusion,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=not cpu, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=cpu,
        recompute_granularity="selective", recompute_modules=["moe"], moe_permute_fusion=experts_impl == "te")
    if experts_impl == "te":
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        mlp = get_moe_module_spec(use_te=True, num_experts=experts, moe_grouped_gemm=True)
    else:
        mlp = megatron_cpu.gpt_layer_spec(experts, experts_impl).submodules.mlp
    torch.manual_seed(0)
    layer = build_module(mlp, config=config) if hasattr(mlp, "module") else mlp(config=config)
    layer = layer.to(dtype)
    if not cpu:
        layer = layer.cuda()
    if not ddp:
        return layer, layer
    wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
    return wrapped, layer


def skew_router(layer: Any, share: float, hot: int, seed: int = 0) -> None:
    """Route ``share`` of the tokens to experts 0..hot-1 (a +10 logit bump on those tokens)."""
    router = layer.router
    gating = getattr(router, "_bench_gating", None) or router.gating
    router._bench_gating = gating
    if share <= 0:
        router.gating = gating
        return

    def skewed(x: torch.Tensor) -> torch.Tensor:
        logits = gating(x)
        flat = logits.reshape(-1, logits.shape[-1])
        g = torch.Generator(device="cpu").manual_seed(seed)
        on = (torch.rand(flat.shape[0], generator=g) < share).to(flat.device, flat.dtype).unsqueeze(1)
        bump = torch.zeros(flat.shape[-1], device=flat.device, dtype=flat.dtype)
        bump[:hot] = 10.0
        return (flat + on * bump).view_as(logits)

    router.gating = skewed


def method_config(method: str) -> Any:
    """The PeakflatConfig a method name asks for: ``llep-unchunked`` (one chunk), or ``peakflat`` with any
    of the suffixes ``-overlap`` (async all-to-alls in every call; the defaults overlap calls the cap splits),
    ``-nooverlap`` (never overlap), ``-unpacked`` (one all-to-all per piece), ``-nccl`` / ``-ce`` (what carries
    overlapped all-to-alls: NCCL or the copy engines), ``-strided`` / ``-expert`` / ``-hybrid`` (chunk membership) and ``-c<N>``
    (chunk cap N, up to 1024 chunks so that the cap alone sets K), e.g. ``peakflat-overlap-c32768``."""
    from megatron_peakflat import PeakflatConfig
    from megatron_peakflat.config import GeneralConfig
    from megatron_peakflat.dispatch.config import DispatchConfig

    kw: dict[str, Any] = dict(impl="pipelined-llep")
    if method == "llep-unchunked":
        kw["max_chunks"] = 1
    elif method == OURS_DEFAULT or method.startswith(OURS_DEFAULT + "-"):
        for part in method.split("-")[1:]:
            if part == "overlap":
                kw["overlap"] = True
            elif part == "nooverlap":
                kw["overlap_min_chunks"] = 0
            elif part == "unpacked":
                kw["pack_collectives"] = False
            elif part in ("nccl", "ce"):
                kw["transport"] = "nccl" if part == "nccl" else "copy-engine"
            elif part in ("strided", "expert", "hybrid"):
                kw["membership"] = part
            elif part.startswith("c") and part[1:].isdigit():
                kw.update(chunk_cap=int(part[1:]), max_chunks=1024)
            else:
                raise SystemExit(f"--methods: unknown part {part!r} in {method!r}")
    else:
        raise SystemExit(f"--methods: unknown method {method!r}")
    return PeakflatConfig(dispatch=DispatchConfig(**kw), general=GeneralConfig(attention="local"))


def select(layer: Any, method: str, cfgs: dict[str, Any], regime: str) -> None:
    """Point the layer at the method's dispatcher and recompute setting."""
    from megatron_peakflat.integration import state

    ours = layer.token_dispatcher if not hasattr(layer, "_bench_ours") else layer._bench_ours
    layer._bench_ours = ours
    if method == "megatron-alltoall":
        layer.token_dispatcher = ours.megatron_dispatcher
        layer.moe_layer_recompute = regime == "moe"  # any other regime: no MoE-level recompute
    else:
        layer.token_dispatcher = ours
        layer.moe_layer_recompute = False
        state.set_current(cfgs[method])


def make_step(ddp: Any, x: torch.Tensor, gout: torch.Tensor, regime: str) -> Callable[[], torch.Tensor]:
    from megatron.core import tensor_parallel

    def run(h: torch.Tensor) -> torch.Tensor:
        return ddp(h)[0]

    def step() -> torch.Tensor:
        x.grad = None
        out = tensor_parallel.checkpoint(run, False, x) if regime == "full" else run(x)
        out.backward(gout)
        return out.detach()

    return step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check(ddp: Any, layer: Any, step: Callable[[], torch.Tensor], x: torch.Tensor, ref: dict[str, Any] | None
          ) -> tuple[dict[str, Any], float | None]:
    """One step from zeroed grads; returns (its output, input grad, main_grads) and the worst relative error vs ``ref``."""
    ddp.zero_grad_buffer()
    out = step()
    got = {"out": out, "dx": x.grad.detach().clone(),
           **{n: p.main_grad.detach().clone() for n, p in layer.named_parameters()}}
    if ref is None:
        return got, None
    return got, max(_rel(got[k], ref[k]) for k in ref)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="4096,7168", help="comma list (default: %(default)s)")
    ap.add_argument("--tokens", default="16384,32768,65536", help="tokens per rank (default: %(default)s)")
    ap.add_argument("--wide-tokens", default="32768,65536", help="tokens for hidden > 4096 (default: %(default)s)")
    ap.add_argument("--skews", default="0,30,80,95", help="percent of tokens on the hot experts (default: %(default)s)")
    ap.add_argument("--wide-skews", default="0,95", help="skews for hidden > 4096 (default: %(default)s)")
    ap.add_argument("--hot", type=int, default=4, help="number of hot experts (1-4)")
    ap.add_argument("--regimes", default="full,moe", help="full,moe (default: %(default)s)")
    ap.add_argument("--methods", default="megatron-alltoall,llep-unchunked,peakflat,peakflat-nooverlap,peakflat-strided",
                    help="comma list; peakflat takes the suffixes -overlap (async all-to-alls in every call), "
                         "-nooverlap, -unpacked, -strided, -expert, -hybrid and -c<N> (chunk cap), e.g. "
                         "peakflat-overlap-c32768 (default: %(default)s)")
    ap.add_argument("--experts-impl", choices=EXPERTS_IMPLS, default="sequential",
                    help="the layer's experts: SequentialMLP of local linears, TEGroupedMLP's layout in plain torch, "
                         "or Transformer Engine's MoE spec with its fused permute (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    harness.repeats_arg(ap)
    ap.add_argument("--tol", type=float, default=2e-2, help="relative error for exact=True (bf16 level)")
    ap.add_argument("--no-check", action="store_true", help="skip the exactness step (exact=None)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, no timing: checks the setup")
    args = ap.parse_args(argv)

    cpu = args.dry_run
    if cpu:
        args.tol = min(args.tol, 1e-5)  # the dry run is fp32: exact means fp32 rounding
    P, rank = harness.world()
    if rank != 0:  # every rank measures; rank 0 reports the max over ranks
        sys.stdout = open(os.devnull, "w")
    if cpu:
        from megatron_peakflat.testing import megatron_cpu

        megatron_cpu.install_cpu_shim()
        args.hidden, args.tokens, args.wide_tokens, args.experts, args.topk, args.ffn = "64", "64,128", "", 8, 2, 32
    import megatron_peakflat

    setup(cpu)
    methods = args.methods.split(",")
    cfgs = {m: method_config(m) for m in [OURS_DEFAULT, *methods] if m != "megatron-alltoall"}
    if cpu:
        for v in cfgs.values():
            v.dispatch.chunk_cap = min(v.dispatch.cap(args.topk), 64)
    megatron_peakflat.apply(cfgs[OURS_DEFAULT])
    device = torch.device("cpu" if cpu else "cuda")
    rows: list[harness.Row] = []
    t0 = time.time()
    for H in [int(h) for h in args.hidden.split(",")]:
        ddp, layer = build_layer(H, args.experts, args.topk, args.ffn, cpu, experts_impl=args.experts_impl)
        wide = H > 4096
        tokens = [int(t) for t in (args.wide_tokens if wide else args.tokens).split(",") if t]
        skews = [int(s) for s in (args.wide_skews if wide else args.skews).split(",") if s]
        for T in tokens:
            seq = 4096 if T >= 4096 else T
            g = torch.Generator(device="cpu").manual_seed(T + 1000 * rank)
            x = (torch.randn(seq, T // seq, H, generator=g) * 0.5).to(device, layer.router.weight.dtype)
            x.requires_grad_(True)
            gout = torch.randn(seq, T // seq, H, generator=g).to(device, x.dtype)
            for skew in skews:
                skew_router(layer, skew / 100, args.hot)
                for regime in args.regimes.split(","):
                    case = f"recompute={regime},N={T},H={H},ep={P},skew={skew}%@{args.hot}"
                    if (args.experts, args.topk) != (64, 8):  # the default shape's cases carry no E, k
                        case += f",E={args.experts},k={args.topk}"
                    if args.experts_impl != "sequential":
                        case += f",experts={args.experts_impl}"
                    ref = None
                    for method in methods:
                        select(layer, method, cfgs, regime)
                        step = make_step(ddp, x, gout, regime)
                        exact = None
                        if not args.no_check:
                            try:
                                got, err = check(ddp, layer, step, x, ref)
                            except Exception:  # noqa: BLE001 - OOM or a failure: the timed run reports it
                                if cpu:
                                    raise
                                traceback.print_exc()
                                got, err = None, None
                            if method == "megatron-alltoall":
                                ref = got
                            elif err is not None or P > 1:
                                worst = harness.across_ranks([err])[0]
                                exact = None if worst is None else worst <= args.tol
                            del got
                        if cpu:
                            out = step()
                            assert torch.isfinite(out).all()
                            rows.append(harness.Row(case, method, None, None, exact, {}))
                            print(f"{case:52s} {method:22s} exact={exact}", flush=True)
                            continue
                        extra: dict[str, Any] = {}
                        if method != "megatron-alltoall":
                            extra["chunk_cap"] = cfgs[method].dispatch.cap(args.topk)
                            extra["max_chunks"] = cfgs[method].dispatch.max_chunks
                        from megatron_peakflat import stats

                        stats.record("dispatch", "transport", None)  # set again by calls that overlap
                        before = stats.snapshot().get("dispatch", {})
                        try:
                            row = harness.run_row(case, method, step, exact=exact, warmup=args.warmup,
                                                  reps=args.reps, **extra)
                        except Exception as e:  # noqa: BLE001 - one failing method must not end the batch
                            traceback.print_exc()
                            row = harness.Row(case, method, None, None, exact, {"error": repr(e)[:300], **extra})
                        if method != "megatron-alltoall":
                            after = stats.snapshot().get("dispatch", {})
                            row.extra["chunks"] = after.get("chunks")
                            calls = after.get("calls", 0) - before.get("calls", 0)
                            if P > 1 and calls:
                                row.extra["spilled_experts_per_call"] = round(
                                    (after.get("spilled_experts", 0) - before.get("spilled_experts", 0)) / calls, 2)
                        if method != "megatron-alltoall" and row.peak_gib is not None:
                            from megatron_peakflat.dispatch import copy_engine

                            # Symmetric memory of the copy-engine slots is outside the allocator's peak.
                            sym = copy_engine.held_bytes(uncounted=True) / 2**30
                            if sym and after.get("transport") == "copy-engine":
                                row.extra["symmetric_gib_added"] = round(sym, 3)
                                row.peak_gib += sym
                            row.extra["transport"] = after.get("transport")
                        if P > 1:
                            row.peak_gib, row.ms = harness.across_ranks([row.peak_gib, row.ms])
                            print(f"{'':48s} {'max over ' + str(P) + ' ranks':28s} peak={row.peak_gib!s:>10} GiB  "
                                  f"ms={row.ms!s:>10}", flush=True)
                        rows.append(row)
                    if not cpu:
                        def again(row: harness.Row, ddp: Any = ddp, layer: Any = layer, regime: str = regime
                                  ) -> Callable[[], torch.Tensor]:
                            select(layer, row.method, cfgs, regime)
                            return make_step(ddp, x, gout, regime)

                        harness.more_rounds([r for r in rows if r.case == case], again, args.rounds,
                                            warmup=args.warmup, reps=args.reps, label=52)
                    ref = None
                    if cpu:
                        assert all(r.exact in (True, None) for r in rows if r.case == case), case
        del ddp, layer
        if not cpu:
            torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f}s")
    if not cpu and rank == 0:
        harness.print_ratio_summary(rows)
        harness.write("dispatch", rows, merge=True)
    megatron_peakflat.remove()
    harness.finish_distributed()


if __name__ == "__main__":
    main()
