"""Ring-DTP against Megatron's CE (native and fused), Liger FLCE and CCE (one GPU); over a TP group
against Megatron's vocab-parallel CE (native and fused) with sequence parallelism (``torchrun``).

Same process, same bf16 inputs; each method runs forward + backward of the mean token loss and returns
dX and dW (``torch.autograd.grad``), so the gradients count in the peak as they do in training. Peak is
the allocation above the inputs (bench/harness.py). ``exact`` says whether loss, dX and dW are within
``--tol`` (relative Frobenius norm) of an fp32 reference computed token-chunk by token-chunk; the errors
themselves are in each row's extras (``err_loss``, ``err_dx``, ``err_dw``). At the H200's power limit
a method's time drifts by 1-2% from one run to the next; ``--repeats R`` (alias ``--rounds``, default 3) times
every method of a case R times in turn (A, B, ..., A, B, ...) and reports the median of the R medians (each in
``extra.runs_ms`` and ``extra.ms_rounds``, their (max - min) / median in ``extra.spread``), so that a drift of the
GPU's clock falls on every method alike; the TP rows are timed the same way.

    python bench/vocab.py                      # default cases (about 2-3 minutes on an H200)
    python bench/vocab.py --cases 16384x4096x201088 --methods peakflat,peakflat-b4096,liger-flce
    python bench/vocab.py --cases 32768x7168x201088 --methods peakflat-fwd-main-grad,liger-flce --repeats 5
    torchrun --nproc-per-node 2 bench/vocab.py --cases 32768x7168x201088    # TP=2, SP: rows ``tp=2``
    torchrun --nproc-per-node 2 bench/vocab.py --dry-run                    # the TP path on CPU (gloo)
    torchrun --nproc-per-node 2 bench/vocab.py --cases 32768x7168x201088 --repeats 3 \
        --methods peakflat-gather,peakflat-activations,peakflat-weights,megatron-native-ce,megatron-fused-ce
                                        # the TP schedules against Megatron, on two GPUs (rows gpus=2)

Under torchrun every rank is one tensor-parallel group (TP = world size) with sequence parallelism:
each rank holds N/TP tokens and a contiguous V/TP slice of the vocabulary. Megatron's peers all-gather
the tokens, build [N, V/TP] logits and run its vocab-parallel CE; Ring-DTP runs its ring over the
group. Every method's objective is the mean loss over all N tokens, so dX (this rank's tokens) and dW
(this rank's slice) compare with the same slices of the fp32 reference. A row is the max over ranks of
the peak, the time and the error. Liger and CCE have no TP form and run only at TP=1. TP rows of
Ring-DTP: ``peakflat`` (defaults: dX and dW summed in fp32, dW returned in bf16), ``peakflat-input``
(sums in bf16), ``peakflat-main-grad`` (dW added into an fp32 ``main_grad`` allocated before the step,
as Megatron's DDP buffer is in training; autograd gets main_grad's storage as its placeholder, as in
training; Megatron's peers return a bf16 dW, which that DDP adds to the same buffer after the step),
``peakflat-gather-main-grad`` (gradients computed with the loss, ``grad='in-forward'``, whose TP schedule
is the gather one: all-gathers and a reduce-scatter, no ring; what training in Megatron, tied output layer
or not, runs by default; earlier rows call it ``peakflat-fwd-main-grad``, at TP=1 still its name).
``peakflat`` and ``peakflat-main-grad`` run a ring ('auto': activations when N/TP <= V/TP, else weights). ``liger-flce`` is Liger's default, which sums
dW chunk by chunk into a bf16 buffer; ``liger-flce-fp32`` sums it in fp32 (``accum_dtype``), as
Ring-DTP does, and rounds it to bf16 once at the end.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness  # noqa: E402
from bench.harness import (Row, across_ranks, finish_distributed, megatron_ce, more_rounds, run_row, world,  # noqa: E402
                           write)
from megatron_peakflat.vocab import ring_linear_cross_entropy  # noqa: E402

DEFAULT_CASES = "32768x7168x201088,16384x4096x201088,32768x7168x128256,16384x4096x128256,65536x4096x128256"
"""The benchmarked shapes; the last is a hold-out shape at large N (the automatic in-forward chunk's rule,
vocab/sizes.py auto_chunk_tokens, must keep the training path at or under Liger's peak there too)."""
ALL_METHODS = ("peakflat,peakflat-input,peakflat-b4096,megatron-native-ce,megatron-fused-ce,liger-flce,liger-flce-fp32,"
               "cce")

Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _init_megatron(cpu: bool = False) -> bool:
    """The process group (torchrun's ranks, else one) and Megatron's parallel_state with TP = every rank
    (its CE functions need a TP group). ``cpu``: gloo and the Megatron CPU shim (the dry run)."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        P, rank = world()
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            from megatron_peakflat.testing.distributed import free_port

            os.environ.setdefault("MASTER_PORT", str(free_port()))
            if not cpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=P)
        if not parallel_state.model_parallel_is_initialized():
            if cpu:
                from megatron_peakflat.testing import megatron_cpu

                megatron_cpu.install_cpu_shim()
            parallel_state.initialize_model_parallel(P)
        return True
    except Exception as e:  # noqa: BLE001
        print(f"megatron peers skipped: {type(e).__name__}: {e}")
        return False


def _peakflat_kwargs(name: str) -> dict[str, Any]:
    """ring_linear_cross_entropy keywords of a method name: 'peakflat' (the flags' defaults) with the
    suffixes '-input' (accumulate='input'), '-main-grad' (dW into the weight's main_grad), '-fwd'
    (grad='in-forward'), '-gather' (the in-forward gradients' gather schedule: '-fwd' at TP > 1 under the
    name of what runs), '-activations' / '-weights' (that ring), '-b<rows>' (block size), '-t<tokens>'
    (in-forward chunk) and '-torch' (plain-PyTorch block kernel); they combine, e.g.
    'peakflat-gather-main-grad-t8192'."""
    kw: dict[str, Any] = {}
    for part in name.replace("main-grad", "maingrad").split("-")[1:]:
        if part == "input":
            kw["accumulate"] = "input"
        elif part == "maingrad":
            kw["dw_into_main_grad"] = True
        elif part == "fwd":
            kw["grad"] = "in-forward"
        elif part == "gather":
            kw["grad"], kw["schedule"] = "in-forward", "gather"
        elif part in ("activations", "weights"):
            kw["schedule"] = part
        elif part == "torch":
            kw["kernel"] = "torch"
        elif part.startswith("b") and part[1:].isdigit():
            kw["block_size"] = int(part[1:])
        elif part.startswith("t") and part[1:].isdigit():
            kw["chunk_tokens"] = int(part[1:])
        else:
            raise SystemExit(f"unknown peakflat variant {name!r} (suffixes: input, main-grad, fwd, gather, "
                             "activations, weights, torch, b<rows>, t<tokens>)")
    return kw


def _peakflat_variant(name: str) -> Method:
    kw = _peakflat_kwargs(name)
    return lambda x, w, y: ring_linear_cross_entropy(x, w, y, reduction="mean", **kw)


def _with_main_grad(w: torch.Tensor, names: Any) -> None:
    """Give ``w`` an fp32 ``main_grad`` (allocated with the inputs, as Megatron's DDP buffer is in
    training) when a method adds dW there."""
    if any("main-grad" in m for m in names):
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device), False


def _liger(loss: Callable, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss(w, x, y)


def methods(wanted: set[str]) -> dict[str, Method]:
    out: dict[str, Method] = {}
    for name in sorted(m for m in wanted if m == "peakflat" or m.startswith("peakflat-")):
        out[name] = _peakflat_variant(name)
    if wanted & {"megatron-native-ce", "megatron-fused-ce"} and _init_megatron():
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        tp = parallel_state.get_tensor_model_parallel_group()
        if "megatron-native-ce" in wanted:
            out["megatron-native-ce"] = lambda x, w, y: megatron_ce(
                vocab_parallel_cross_entropy, (x @ w.t()).unsqueeze(1), y.unsqueeze(1), tp).mean()
        if "megatron-fused-ce" in wanted:
            try:
                from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

                out["megatron-fused-ce"] = lambda x, w, y: fused_vocab_parallel_cross_entropy(
                    (x @ w.t()).unsqueeze(1), y.unsqueeze(1), tp).mean()
            except ImportError as e:
                print(f"megatron-fused-ce skipped: {e}")
    for name, accum in (("liger-flce", None), ("liger-flce-fp32", torch.float32)):
        if name in wanted:
            try:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

                out[name] = functools.partial(_liger, LigerFusedLinearCrossEntropyLoss(accum_dtype=accum))
            except ImportError as e:
                print(f"{name} skipped: {e}")
    if "cce" in wanted:
        try:
            from cut_cross_entropy import linear_cross_entropy

            out["cce"] = lambda x, w, y: linear_cross_entropy(x, w, y)
        except ImportError as e:
            print(f"cce skipped: {e}")
    return out


@torch.no_grad()
def fp32_reference(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int = 2048):
    """Mean loss, dX and dW in fp32 (no TF32), a chunk of tokens at a time."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        wf = w.float()
        n = x.shape[0]
        dw = torch.zeros_like(wf)
        dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for s in range(0, n, chunk):
            xc = x[s:s + chunk].float()
            z = xc @ wf.t()
            lse = torch.logsumexp(z, dim=1)
            rows = torch.arange(z.shape[0], device=z.device)
            total += (lse - z[rows, y[s:s + chunk]]).double().sum()
            z.sub_(lse[:, None]).exp_()
            z[rows, y[s:s + chunk]] -= 1.0
            z.div_(n)
            dx[s:s + chunk] = z @ wf
            dw.addmm_(z.t(), xc)
            del z
        return (total / n).float(), dx, dw
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _grad_step(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, y: torch.Tensor
               ) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One timed step: the loss's forward and backward, returning dX and dW (so they count in the peak).
    A stride-0 zero placeholder for dW is made dense, as AccumulateGrad does in training; main_grad's
    storage (the placeholder when dW went into main_grad) and a real dW are already dense (no copy)."""
    def step() -> tuple[torch.Tensor, ...]:
        dx, dw = torch.autograd.grad(fn(x, w, y), (x, w))
        return dx, dw.contiguous()
    return step


def check(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ref: tuple, tol: float,
          loss_total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[bool | None, dict[str, Any]]:
    """(exact, errors) of one forward + backward of ``fn`` against ``ref`` (loss, dX, dW); errors are the max
    over ranks. ``loss_total`` turns this rank's loss into the whole loss (a sum over ranks for Ring-DTP).
    An out-of-memory is a row's error, not the benchmark's end."""
    try:
        if hasattr(w, "main_grad"):  # a previous method's steps may have left the flag set
            w.main_grad.zero_()
            w.grad_added_to_main_grad = False
        loss = fn(x, w, y)
        dx, dw = torch.autograd.grad(loss, (x, w))
        if getattr(w, "grad_added_to_main_grad", False):  # dW went into main_grad; autograd got zeros
            dw, w.grad_added_to_main_grad = w.main_grad, False
        total = loss.detach().clone()
        if loss_total is not None:
            total = loss_total(total)
        errs = across_ranks([_rel(total, ref[0]), _rel(dx, ref[1]), _rel(dw, ref[2])])
    except torch.OutOfMemoryError:
        return None, {"error": "OOM"}
    extra = {"err_loss": errs[0], "err_dx": errs[1], "err_dw": errs[2]}
    return all(e is not None and e <= tol for e in errs), extra


TP_METHODS = "peakflat,peakflat-main-grad,peakflat-gather-main-grad,megatron-native-ce,megatron-fused-ce"
"""At TP > 1: the standalone API and the recompute with dW into main_grad run a ring ('auto': activations or
weights); the training path (gradients with the loss, dW into main_grad) runs the gather schedule, named so
(rows before the name named it 'peakflat-fwd-main-grad', which still parses)."""

TPMethod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(this rank's tokens [N/P, H], this rank's vocabulary slice [V/P, H], all labels [N]) -> the mean
loss over all N tokens (each rank's share of it for Ring-DTP, whose ranks hold different tokens)."""


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def tp_methods(wanted: set[str], cpu: bool) -> dict[str, TPMethod]:
    """Ring-DTP over the TP group and Megatron's vocab-parallel CE after the sequence all-gather."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    tp = parallel_state.get_tensor_model_parallel_group()
    P, rank = world()
    out: dict[str, TPMethod] = {}

    def mine(y: torch.Tensor) -> torch.Tensor:
        n = y.shape[0] // P
        return y[rank * n:(rank + 1) * n]

    for name in sorted(m for m in wanted if m == "peakflat" or m.startswith("peakflat-")):
        out[name] = functools.partial(_ring_tp, tp=tp, mine=mine, kw=_peakflat_kwargs(name))
    if "megatron-native-ce" in wanted:
        out["megatron-native-ce"] = lambda x, w, y: megatron_ce(
            vocab_parallel_cross_entropy, (gather_from_sequence_parallel_region(x, group=tp) @ w.t()).unsqueeze(1),
            y.unsqueeze(1), tp).mean()
    if "megatron-fused-ce" in wanted and not cpu:
        try:
            from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

            out["megatron-fused-ce"] = lambda x, w, y: fused_vocab_parallel_cross_entropy(
                (gather_from_sequence_parallel_region(x, group=tp) @ w.t()).unsqueeze(1), y.unsqueeze(1), tp).mean()
        except ImportError as e:
            print(f"megatron-fused-ce skipped: {e}")
    return out


def _ring_tp(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, tp: Any, mine: Callable[[torch.Tensor], torch.Tensor],
             kw: dict[str, Any]) -> torch.Tensor:
    # the in-forward schedule is told the gradient its sum gets: 1/N (the mean over all N tokens)
    return ring_linear_cross_entropy(x, w, mine(y), tp, reduction="sum", grad_hint=1.0 / y.shape[0], **kw) / y.shape[0]


def _reference_cpu(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mean loss, dX, dW in fp64 by autograd on the full logits (the dry run's tiny shapes)."""
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(xd @ wd.t(), y)
    dx, dw = torch.autograd.grad(loss, (xd, wd))
    return loss.detach(), dx, dw


def main_tp(args: argparse.Namespace) -> None:
    """The TP rows: every rank measures its own step; rank 0 writes the max over ranks (merged)."""

    cpu = args.dry_run
    P, rank = world()
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    tol = min(args.tol, 1e-5) if cpu else args.tol  # the dry run is fp32
    if not _init_megatron(cpu):
        raise SystemExit("the TP benchmark needs Megatron's parallel_state")
    dev = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    meths = tp_methods(set(args.methods.split(",")), cpu)
    rows: list[Row] = []
    cases = "256x64x1000" if cpu else args.cases
    for spec in cases.split(","):
        N, H, V = (int(t) for t in spec.lower().split("x"))
        if N % P or V % P:
            raise SystemExit(f"case {spec}: N and V must divide by TP={P} (Megatron pads V to a multiple)")
        case = f"N={N},H={H},V={V},tp={P}"
        g = torch.Generator(device=dev).manual_seed(0)  # the same full inputs on every rank
        x_full = torch.randn(N, H, device=dev, dtype=dtype, generator=g)
        w_full = (torch.randn(V, H, device=dev, generator=g) * (H ** -0.5)).to(dtype)
        y = torch.randint(0, V, (N,), device=dev, generator=g)
        n, v = N // P, V // P
        if args.no_check:
            ref = None
        elif cpu:
            ref = _reference_cpu(x_full, w_full, y)
        else:
            ref = fp32_reference(x_full, w_full, y)
        ref = None if ref is None else (ref[0], ref[1][rank * n:(rank + 1) * n], ref[2][rank * v:(rank + 1) * v])
        x = x_full[rank * n:(rank + 1) * n].clone().requires_grad_(True)
        w = w_full[rank * v:(rank + 1) * v].clone().requires_grad_(True)
        del x_full, w_full
        _with_main_grad(w, meths)
        if not cpu:
            torch.cuda.empty_cache()
        for name, fn in meths.items():
            exact, extra = (None, {}) if ref is None else check(  # Ring-DTP's ranks hold shares of the mean loss
                fn, x, w, y, ref, tol, _sum_over_ranks if name.startswith("peakflat") else None)
            if cpu:
                rows.append(Row(case, name, None, None, exact, extra))
                print(f"{case:36s} {name:22s} exact={exact} {extra}", flush=True)
                continue
            torch.cuda.empty_cache()
            row = run_row(case, name, _grad_step(fn, x, w, y), exact=exact, warmup=args.warmup, reps=args.reps,
                          **extra)
            row.peak_gib, row.ms = across_ranks([row.peak_gib, row.ms])
            print(f"{'':36s} {'max over ' + str(P) + ' ranks':28s} peak={row.peak_gib} GiB  ms={row.ms}", flush=True)
            rows.append(row)
        if not cpu:  # every rank takes the same rounds: each round's time is the slowest rank's
            more_rounds([r for r in rows if r.case == case],
                        lambda row, xwy=(x, w, y): _grad_step(meths[row.method], *xwy), args.rounds,
                        warmup=args.warmup, reps=args.reps)
        del x, w, y, ref
    if cpu:
        assert rows and all(r.exact for r in rows), [(r.method, r.exact, r.extra) for r in rows]
        print("dry run: every method exact")
        if args.out and rank == 0:  # the rows as a GPU run writes them, each with its card and GPU count
            write("vocab", rows, out=Path(args.out), merge=True)
    elif rank == 0:
        harness.print_ratio_summary(rows)
        write("vocab", rows, merge=True, out=Path(args.out) if args.out else None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of NxHxV (default: %(default)s)")
    ap.add_argument("--methods", default=ALL_METHODS, help="comma list (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    harness.repeats_arg(ap)  # one GPU; the TP path times each method once per repeat too
    ap.add_argument("--tol", type=float, default=2e-2, help="relative error for exact=True (bf16 level)")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 reference (exact=None)")
    ap.add_argument("--dry-run", action="store_true", help="under torchrun on CPU: the TP path with tiny shapes, "
                                                           "exactness only")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/vocab.json; a dry run writes "
                                                "its rows only here)")
    args = ap.parse_args(argv)
    if world()[0] > 1 or args.dry_run:
        if args.methods == ALL_METHODS:
            args.methods = TP_METHODS
        if args.cases == DEFAULT_CASES:
            args.cases = "32768x7168x201088,16384x4096x201088"
        main_tp(args)
        finish_distributed()
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench/vocab.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    meths = methods(set(args.methods.split(",")))
    rows: list[Row] = []
    for spec in args.cases.split(","):
        N, H, V = (int(t) for t in spec.lower().split("x"))
        case = f"N={N},H={H},V={V},tp=1"
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
        w = (torch.randn(V, H, device="cuda", generator=g) * (H ** -0.5)).to(torch.bfloat16).requires_grad_(True)
        y = torch.randint(0, V, (N,), device="cuda", generator=g)
        _with_main_grad(w, meths)
        ref = None if args.no_check else fp32_reference(x.detach(), w.detach(), y)
        torch.cuda.empty_cache()
        first: list[Row] = []
        for name, fn in meths.items():
            exact, extra = (None, {}) if ref is None else check(fn, x, w, y, ref, args.tol)
            torch.cuda.empty_cache()
            first.append(run_row(case, name, _grad_step(fn, x, w, y), exact=exact, warmup=args.warmup,
                                 reps=args.reps, **extra))
        rows += more_rounds(first, lambda row, xwy=(x, w, y): _grad_step(meths[row.method], *xwy), args.rounds,
                            warmup=args.warmup, reps=args.reps)
        del x, w, y, ref
        torch.cuda.empty_cache()
    harness.print_ratio_summary(rows)
    write("vocab", rows, merge=True, out=Path(args.out) if args.out else None)  # keeps the TP rows (and other cases) of earlier runs


if __name__ == "__main__":
    main()
