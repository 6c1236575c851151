"""Tiled attention sublayer benchmark on one GPU: one self-attention sublayer (input RMSNorm, QKV projection with
grouped K/V heads, RoPE, causal attention, output projection, residual) forward + backward, two ways on the same
weights and inputs, at several sequence lengths:

- ``full-recompute``: the sublayer whole under ``torch.utils.checkpoint`` (non-reentrant), as Megatron's full
  recompute runs it: one forward without a graph, then the recompute and the backward;
- ``peakflat-tile<T>``: ``tile.api.tiled_self_attention`` over query tiles of T tokens (one row per ``--tiles``
  entry), under the same checkpoint (``--no-tiled-checkpoint``: bare).

``--spec sdpa`` (default): ``tile/reference.py``'s plain-PyTorch sublayer with its attention on
``F.scaled_dot_product_attention`` (``enable_gqa``; causal, aligned bottom right for a tile's queries), whose
flash kernel keeps no scores and no GQA expansion (``extra.flash``: whether SDPA's flash kernel accepts the
shapes; where it does not, the kernel's scratch is outside the bound). ``--spec te``: Megatron's
``TransformerLayer`` on Transformer Engine's spec (built as ``tests/gpu/test_tile_gpu.py`` builds it), the
untiled method its own ``_forward_attention``, the tiled one ``integration.tile.layer_ops`` on it.

Per (length, method), a row of ``bench/results/tile.json`` (merged by case and method): ``peak_gib``, the
allocation above the inputs (x, the incoming gradient, the parameters and their gradient buffers, which are zeroed
in place as Megatron's DDP buffers are: ``max_memory_allocated`` after ``reset_peak_memory_stats``); ``ms``, the
median of ``--repeats`` runs (the methods in turn), each the median of ``--iters`` steps after ``--warmup``;
``extra.runs_ms``, ``extra.spread``. A tiled row adds ``tile/bound.py``'s prediction (``extra.bound_gib``,
``extra.peak_vs_bound``: measured / predicted, at most 1 where the bound holds) and ``extra.peak_vs_untiled``.
``exact``: the tiled output, dx and every parameter's gradient against the untiled run's, each
``max |tiled - untiled| / max |untiled|`` (``extra.max_rel_err``, its tensor ``extra.worst``) within ``--tol``;
a row beyond it says ``extra.error: mismatch`` and the script exits 1 after writing its rows. A method out of
memory is a row with ``extra.error: OOM`` (no peak, no time), and the next one runs.

    python bench/tile.py                               # 64K,128K,256K; hidden 2880, 64/8 heads of 64; bf16
    python bench/tile.py --seqs 256K --tiles 8192,16384 --spec te
    python bench/tile.py --dry-run                     # CPU, fp32, tiny shapes: rows to a temporary file

``--dry-run`` runs the same steps on CPU in fp32 with tiny shapes; the attention is the flash-class double of the
tests (``megatron_peakflat/testing/flash_double.py``, its scratch passed to the bound as the kernel's workspace), the peak is
LiveBytesMeter's and the time the wall clock. It writes ``--out`` (default: a temporary file), never the
committed results.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness  # noqa: E402
from megatron_peakflat.tile.api import tiled_self_attention  # noqa: E402
from megatron_peakflat.tile.bound import tiled_attention_peak_bytes  # noqa: E402
from megatron_peakflat.tile.ops import TileOps  # noqa: E402
from megatron_peakflat.tile.reference import ReferenceAttentionLayer  # noqa: E402

UNTILED = "full-recompute"
DRY = {"seqs": [64, 128], "tiles": [16, 48], "hidden": 48, "heads": 8, "kv_heads": 2, "head_dim": 8,
       "micro_batch": 2, "block": 32}
"""--dry-run's shapes: two lengths, a tile dividing both and one that does not."""


def tokens(text: str) -> int:
    """'64K' -> 65536, '1M' -> 1048576, '4096' -> 4096."""
    t = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    return int(t[:-1] if scale > 1 else t) * scale


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of q [t, b, nq, d] over k, v [L, b, nkv, d] (t <= L: the queries are the last t positions,
    the mask aligned bottom right), grouped heads by ``enable_gqa`` (no expanded copy on the flash kernel);
    out [t, b, nq * d]."""
    from torch.nn.attention.bias import causal_lower_right

    t, b, nq, d = q.shape
    L = k.shape[0]
    qh, kh, vh = (z.permute(1, 2, 0, 3) for z in (q, k, v))
    gqa = nq != k.shape[2]
    if t == L:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, L), enable_gqa=gqa)
    return out.permute(2, 0, 1, 3).reshape(t, b, nq * d)


def flash_accepts(seq: int, b: int, nq: int, nkv: int, d: int, dtype: torch.dtype) -> bool:
    """Whether SDPA's flash kernel takes these shapes (GQA included) on this GPU: then the attention keeps no
    scores and no expanded K/V, and the bound's attention workspace is 0."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    q = torch.empty(b, nq, 8, d, device="cuda", dtype=dtype)
    kv = torch.empty(b, nkv, 8, d, device="cuda", dtype=dtype)
    return bool(can_use_flash_attention(SDPAParams(q, kv, kv, None, 0.0, True, nq != nkv)))


class Sublayer:
    """The sublayer under test: ``untiled(x)`` (the whole sublayer), ``tiled(x, T)``, ``params`` (what the tiled
    Function returns gradients for), ``workspace(T, seq)`` (the attention kernel's scratch per tile, for the bound)."""

    def __init__(self, untiled: Callable[[torch.Tensor], torch.Tensor], ops: Callable[[int], TileOps],
                 params: list[torch.nn.Parameter], workspace: Callable[[int, int], int], attention: str) -> None:
        self.untiled, self.ops, self.params, self.workspace, self.attention = untiled, ops, params, workspace, attention

    def tiled(self, x: torch.Tensor, tile: int, seq: int) -> torch.Tensor:
        return tiled_self_attention(x, self.ops(seq), tile, self.params)


def reference_sublayer(args: argparse.Namespace, device: str, dtype: torch.dtype) -> Sublayer:
    """tile/reference.py's sublayer (rotary table for the longest length), attention on SDPA, or on the CPU on the
    flash-class double of the tests."""
    layer = ReferenceAttentionLayer(args.hidden, args.heads, args.kv_heads, args.head_dim, max(args.seqs), bias=True,
                                    dtype=dtype, seed=0).to(device)
    if args.dry_run:
        from megatron_peakflat.testing.flash_double import FlashDouble, workspace_bytes

        block = DRY["block"]
        attend: Callable[..., torch.Tensor] = lambda q, k, v: FlashDouble.apply(q, k, v, block)  # noqa: E731
        workspace = lambda t, seq: workspace_bytes(min(t, seq), args.micro_batch, args.heads, args.head_dim,  # noqa: E731
                                                   block, dtype.itemsize)
        name = f"flash-class double (megatron_peakflat/testing/flash_double.py, blocks of {block})"
    else:
        attend, workspace, name = sdpa_attend, (lambda t, seq: 0), "sdpa"
    ops = TileOps(qkv=layer.qkv, attend=attend, project=layer.project)

    def untiled(x: torch.Tensor) -> torch.Tensor:
        q, k, v = layer.qkv(x, 0)
        return layer.project(attend(q, k, v), x)

    return Sublayer(untiled, lambda seq: ops, list(layer.parameters()), workspace, name)


def te_sublayer(args: argparse.Namespace) -> Sublayer:
    """Megatron's TransformerLayer on Transformer Engine's spec (bias on the linears, RMSNorm fused into the QKV
    projection), as tests/gpu/test_tile_gpu.py builds it; its attention sublayer alone."""
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_peakflat.integration.tile import layer_ops, layer_params
    from megatron_peakflat.testing.megatron_cpu import init_megatron_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    init_megatron_parallel(cpu=False, seed=1234)
    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                               num_query_groups=args.kv_heads, kv_channels=args.head_dim,
                               ffn_hidden_size=args.hidden, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm",
                               gradient_accumulation_fusion=False, add_bias_linear=True, add_qkv_bias=True)
    torch.manual_seed(5)
    layer = build_module(get_gpt_layer_with_transformer_engine_spec(), config=config, layer_number=1).cuda().train()
    rope = RotaryEmbedding(kv_channels=args.head_dim, rotary_percent=1.0)(max(args.seqs)).cuda()

    def untiled(x: torch.Tensor) -> torch.Tensor:
        return layer._forward_attention(x, attention_mask=None, rotary_pos_emb=rope[:x.shape[0]])[0]

    return Sublayer(untiled, lambda seq: layer_ops(layer, rope[:seq]), layer_params(layer), lambda t, seq: 0,
                    "transformer-engine")


def measure(fn: Callable[[], Any], *, warmup: int, iters: int, cpu: bool) -> tuple[int, float]:
    """(peak bytes above what was allocated before each step, the max over the steps; median ms of ``iters``
    steps after ``warmup``). CUDA: the allocator's statistics and CUDA events; CPU: LiveBytesMeter and the
    wall clock."""
    for _ in range(warmup):
        fn()
    peak, times = 0, []
    for _ in range(iters):
        gc.collect()
        if cpu:
            from megatron_peakflat.testing.live_bytes import LiveBytesMeter

            with LiveBytesMeter() as m:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            peak = max(peak, m.peak)
        else:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times.append(harness.timed_call(fn))
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return peak, statistics.median(times)


def max_rel_err(got: torch.Tensor, want: torch.Tensor, rows: int = 8192) -> float:
    """max |got - want| / max |want|, in fp32 on got's device, ``rows`` of dim 0 at a time (``want`` may be a
    host copy)."""
    num = den = 0.0
    for i in range(0, want.shape[0], rows):
        w = want[i:i + rows].to(got.device, torch.float32)
        num = max(num, (got[i:i + rows].float() - w).abs().max().item())
        den = max(den, w.abs().max().item())
    return num / den if den else num


def free(cpu: bool) -> None:
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="64K,128K,256K", help="sequence lengths, e.g. 64K,128K,256K (default %(default)s)")
    ap.add_argument("--tiles", default="16384", help="tile sizes in tokens, one tiled row each (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--heads", type=int, default=64, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (grouped-query attention)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--spec", choices=["sdpa", "te"], default="sdpa",
                    help="sdpa: tile/reference.py's sublayer on torch SDPA; te: Megatron's layer on Transformer Engine")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before each run's timed ones")
    ap.add_argument("--iters", type=int, default=3, help="timed steps per run; a run's time is their median")
    harness.repeats_arg(ap)
    ap.add_argument("--tol", type=float, default=None,
                    help="largest max-relative error of the tiled output and gradients against the untiled ones "
                         "(default: 2^-5 in bf16, 1e-4 in fp32)")
    ap.add_argument("--no-tiled-checkpoint", action="store_true",
                    help="run the tiled sublayer outside torch.utils.checkpoint (it saves only its input either way)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, fp32, tiny shapes, LiveBytesMeter; rows to --out (default: a temporary file)")
    ap.add_argument("--out", type=Path, default=None, help="results file (default: bench/results/tile.json)")
    args = ap.parse_args(argv)
    args.seqs = [tokens(s) for s in args.seqs.split(",")]
    args.tiles = [tokens(t) for t in args.tiles.split(",")]
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        ap.error(f"--repeats {args.rounds}, --iters {args.iters}, --warmup {args.warmup}: pass at least 1, 1, 0")
    cpu = args.dry_run
    if cpu:
        if args.spec == "te":
            ap.error("--spec te needs CUDA (Transformer Engine); --dry-run runs --spec sdpa")
        args.seqs, args.tiles = DRY["seqs"], DRY["tiles"]
        args.hidden, args.heads, args.kv_heads, args.head_dim = DRY["hidden"], DRY["heads"], DRY["kv_heads"], \
            DRY["head_dim"]
        args.micro_batch = DRY["micro_batch"]
        args.out = args.out or Path(tempfile.mkdtemp(prefix="tile-dry-run-")) / "tile.json"
    elif not torch.cuda.is_available():
        raise SystemExit("bench/tile.py measures on a GPU; on CPU pass --dry-run")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} does not group over --kv-heads {args.kv_heads}")
    dtype = torch.float32 if cpu else torch.bfloat16
    tol = args.tol if args.tol is not None else (1e-4 if dtype == torch.float32 else 2 ** -5)
    device = "cpu" if cpu else "cuda"
    if args.spec == "te":
        from megatron_peakflat.integration.attention import transformer_engine_available

        if not transformer_engine_available():
            raise SystemExit("--spec te: Transformer Engine does not import here; install it or pass --spec sdpa")
        sub = te_sublayer(args)
    else:
        sub = reference_sublayer(args, device, dtype)
    for p in sub.params:
        p.grad = torch.zeros_like(p)  # persistent buffers, zeroed in place each step (not counted in the peak)
    ckpt_tiled = not args.no_tiled_checkpoint
    methods: list[tuple[str, int | None]] = [(UNTILED, None)] + [(f"peakflat-tile{t}", t) for t in args.tiles]
    rows: list[harness.Row] = []
    failed = False
    t_start = time.monotonic()
    for seq in args.seqs:
        case = (f"S={seq},b={args.micro_batch},H={args.hidden},nq={args.heads},nkv={args.kv_heads},"
                f"d={args.head_dim},{str(dtype).split('.')[-1]},spec={args.spec}")
        flash = None if cpu or args.spec == "te" else flash_accepts(seq, args.micro_batch, args.heads, args.kv_heads,
                                                                   args.head_dim, dtype)
        g = torch.Generator().manual_seed(seq)
        x = torch.randn(seq, args.micro_batch, args.hidden, generator=g).to(device, dtype).requires_grad_(True)
        dy = torch.randn(seq, args.micro_batch, args.hidden, generator=g).to(device, dtype)

        def step_of(tile: int | None, keep: bool = False) -> Callable[[], Any]:
            def fwd(inp: torch.Tensor) -> torch.Tensor:
                return sub.untiled(inp) if tile is None else sub.tiled(inp, tile, seq)

            def run() -> Any:
                for p in sub.params:
                    p.grad.zero_()
                x.grad = None
                if tile is None or ckpt_tiled:
                    y = torch.utils.checkpoint.checkpoint(fwd, x, use_reentrant=False)
                else:
                    y = fwd(x)
                y.backward(dy)
                out = None
                if keep:  # output, dx and the parameters' gradients, as host copies
                    out = {"output": y.detach().cpu(), "dx": x.grad.cpu(),
                           **{f"grad{i}": p.grad.cpu() for i, p in enumerate(sub.params)}}
                del y
                x.grad = None
                return out
            return run

        runs: dict[str, list[float]] = {m: [] for m, _ in methods}
        peaks: dict[str, int] = {m: 0 for m, _ in methods}
        errors: dict[str, str] = {}
        for r in range(args.rounds):
            for method, tile in methods:
                if method in errors:
                    continue
                try:
                    peak, ms = measure(step_of(tile), warmup=args.warmup, iters=args.iters, cpu=cpu)
                except torch.OutOfMemoryError:
                    errors[method] = "OOM"
                    print(f"{case:60s} {method:24s} out of memory", flush=True)
                    free(cpu)
                    continue
                runs[method].append(ms)
                peaks[method] = max(peaks[method], peak)
                print(f"{case:60s} {method:24s} run {r + 1}: peak {peak / 2**30:.4f} GiB, {ms:.3f} ms "
                      f"({time.monotonic() - t_start:.0f} s)", flush=True)
                free(cpu)
        ref = None
        if UNTILED not in errors:
            try:
                ref = step_of(None, keep=True)()
            except torch.OutOfMemoryError:
                errors[UNTILED] = "OOM"
            free(cpu)
        untiled_peak = peaks[UNTILED] if UNTILED not in errors else None
        for method, tile in methods:
            extra: dict[str, Any] = {"seq": seq, "tile": tile, "attention": sub.attention, "warmup": args.warmup,
                                     "iters": args.iters, "checkpoint": tile is None or ckpt_tiled}
            if flash is not None:
                extra["flash"] = flash
            if tile is not None:
                ws = sub.workspace(tile, seq)
                bound = tiled_attention_peak_bytes(tile, seq, args.micro_batch, args.hidden, args.heads, args.kv_heads,
                                                   args.head_dim, dtype.itemsize, attention_workspace_bytes=ws)
                extra.update(bound_bytes=bound, bound_gib=round(bound / 2**30, 6), attention_workspace_bytes=ws)
            if method in errors:
                rows.append(harness.Row(case, method, None, None, None, {"error": errors[method], **extra}))
                print(f"{case:60s} {method:24s} {errors[method]}", flush=True)
                continue
            exact = True if tile is None else None
            if tile is not None:
                extra["peak_vs_bound"] = round(peaks[method] / extra["bound_bytes"], 4)
                if untiled_peak:
                    extra["peak_vs_untiled"] = round(peaks[method] / untiled_peak, 4)
                if ref is None:
                    extra["verified"] = "no untiled run to compare with (it ran out of memory)"
                else:
                    try:
                        got = step_of(tile, keep=True)()
                    except torch.OutOfMemoryError:
                        got = None
                        extra["verified"] = "the comparison step ran out of memory"
                    free(cpu)
                    if got is not None:
                        errs = {k: max_rel_err(got[k].to(device), ref[k]) for k in ref}
                        worst = max(errs, key=errs.get)
                        extra.update(max_rel_err=float(f"{errs[worst]:.3g}"), worst=worst, tol=tol)
                        exact = errs[worst] <= tol
                        if not exact:
                            extra["error"] = "mismatch"
                            failed = True
                            print(f"MISMATCH: {case} {method}: {worst} off by {errs[worst]:.3g} of its largest entry "
                                  f"(tolerance {tol:.3g})", flush=True)
                        del got
            row = harness.Row(case, method, round(peaks[method] / 2**30, 6), None, exact,
                              {"peak_bytes": peaks[method], **extra})
            harness.repeated(row, runs[method])
            rows.append(row)
            print(f"{case:60s} {method:24s} peak={row.peak_gib} GiB ms={row.ms} (median of {len(runs[method])}) "
                  f"exact={exact}" + (f" bound={extra['bound_gib']} GiB ({extra['peak_vs_bound']:.1%} of it)"
                                      if tile is not None else ""), flush=True)
        del x, dy, ref
        free(cpu)
    harness.print_ratio_summary(harness.stamp(rows))
    if cpu:
        saved_out = os.environ.pop("OUT", None)  # a dry run never lands in the results that come back
        try:
            harness.write("tile", rows, out=args.out)
        finally:
            if saved_out is not None:
                os.environ["OUT"] = saved_out
        print(f"dry run: {len(rows)} rows in {args.out}; {time.monotonic() - t_start:.1f} s")
    else:
        harness.write("tile", rows, out=args.out, merge=True)
    if failed:
        print("MISMATCH: a tiled row differs from the untiled sublayer beyond the tolerance (rows say 'mismatch')",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
