"""Where the Ring-DTP ring schedules' time goes, per rank: block compute, posting hops, and waiting for
the travelling input (posted before the compute), for the dependent state/accumulator hop (posted after
it) and for the weights schedule's dW accumulator, which travels block by block as each block is final. Runs on CPU with gloo (``--ranks 2``) or on GPUs with NCCL (``--backend nccl``; GPU times are taken with
``torch.cuda.synchronize`` around each step, which serialises what the streams would overlap: read them
as the parts' sizes, not as the schedule's total).

    python bench/vocab_ring_profile.py --tokens 2048 --hidden 512 --vocab 16384

Prints, per schedule, the median forward+backward time of ``--reps`` runs and the time per part.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_peakflat.testing import run_distributed  # noqa: E402
from megatron_peakflat.vocab import ring  # noqa: E402
from megatron_peakflat.vocab.api import ring_linear_cross_entropy  # noqa: E402


def _timed(name: str, fn, times: dict[str, float], sync):
    def inner(*a, **k):
        sync()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        sync()
        times[name] += time.perf_counter() - t0
        return out
    return inner


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    cuda = args.backend == "nccl"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    dtype = getattr(torch, args.dtype)
    shard = args.vocab // world
    x = torch.randn(args.tokens, args.hidden, generator=g).to(dev, dtype).requires_grad_()
    w = (torch.randn(shard, args.hidden, generator=g) * 0.05).to(dev, dtype).requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(dev)
    out = {}
    for schedule in args.schedules.split(","):
        times: dict[str, float] = defaultdict(float)
        orig = {n: getattr(ring, n) for n in ("fold_shard", "grad_shard", "_wait", "_shift")}
        ring.fold_shard = _timed("fold blocks", orig["fold_shard"], times, sync)
        ring.grad_shard = _timed("grad blocks", orig["grad_shard"], times, sync)
        kinds: dict[int, str] = {}

        def shift(plan, sends, recvs, tag, _f=_timed("post hop", orig["_shift"], times, sync)):
            works = _f(plan, sends, recvs, tag)
            kinds[id(works)] = "wait input hop" if tag == ring._TAG_INPUT else "wait state hop"
            return works

        def wait(works):
            # a hop posted elsewhere than _shift: the dW accumulator's blocks (ring._BlockHop)
            return _timed(kinds.pop(id(works), "wait dW block hop"), orig["_wait"], times, sync)(works)

        ring._shift, ring._wait = shift, wait
        totals = []
        try:
            for rep in range(args.warmup + args.reps):
                if rep == args.warmup:
                    times.clear()
                x.grad = w.grad = None
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                loss = ring_linear_cross_entropy(x, w, y, group, schedule=schedule, reduction="sum",
                                                 block_size=args.block)
                loss.backward()
                sync()
                if rep >= args.warmup:
                    totals.append(time.perf_counter() - t0)
        finally:
            for n, f in orig.items():
                setattr(ring, n, f)
        out[schedule] = {"total_ms": 1e3 * statistics.median(totals),
                         "min_ms": 1e3 * min(totals), "max_ms": 1e3 * max(totals),
                         **{k: 1e3 * v / args.reps for k, v in times.items()}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--schedules", default="activations,weights")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = p.parse_args()
    res = run_distributed(_rank, args.ranks, args, backend=args.backend, timeout=1800)
    print(f"ranks={args.ranks} N/rank={args.tokens} H={args.hidden} V={args.vocab} block={args.block} "
          f"{args.dtype} threads/rank={args.threads} backend={args.backend}; ms per forward+backward "
          f"(median of {args.reps}; parts summed over the run's steps, per rep)")
    for schedule in args.schedules.split(","):
        for rank, r in enumerate(res):
            s = r[schedule]
            parts = ", ".join(f"{k} {s[k]:.1f}" for k in ("fold blocks", "grad blocks", "post hop", "wait input hop", "wait state hop",
                                         "wait dW block hop") if k in s)
            print(f"  {schedule:<11} rank {rank}: total {s['total_ms']:.1f} (min {s['min_ms']:.1f}, max "
                  f"{s['max_ms']:.1f}); {parts}")


if __name__ == "__main__":
    main()
