"""Ring-DTP's in-forward call against Liger's FLCE at N=32768, H=7168, V=201088 on one GPU, timed three
ways in turn, four rounds: ``plain`` (CUDA events around the call, as bench/harness.py times it),
``sleep`` (the GPU kept busy by a 50M-cycle sleep while the CPU enqueues the call, so the host's lead
and launch gaps are hidden: GPU time alone) and ``profiler`` (under torch.profiler, as
bench/vocab_parts.py --profile runs it). Asks whether a ratio between the two calls comes from the
GPU's work or from the host.

    python tools/probes/vocab_timing.py        # needs liger-kernel; about 30 s on an H200
"""
import statistics
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron_peakflat.vocab import ring_linear_cross_entropy
from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

N, H, V = 32768, 7168, 201088
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16).requires_grad_(True)
y = torch.randint(0, V, (N,), device="cuda", generator=g)
w.main_grad, w.grad_added_to_main_grad = torch.zeros(V, H, device="cuda"), False
liger = LigerFusedLinearCrossEntropyLoss()

def ours():
    loss = ring_linear_cross_entropy(x, w, y, reduction="mean", grad="in-forward", dw_into_main_grad=True)
    torch.autograd.grad(loss, (x, w))

def lig():
    torch.autograd.grad(liger(w, x, y), (x, w))

def timed(fn, mode):
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if mode == "sleep":
        torch.cuda._sleep(50_000_000)  # GPU busy while the CPU enqueues the call
        s.record()
        fn()
        e.record()
    elif mode == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]):
            s.record(); fn(); e.record(); torch.cuda.synchronize()
    else:
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)

for fn in (ours, lig, ours, lig):
    fn()
res = {}
for rnd in range(4):
    for name, fn in (("ours", ours), ("liger", lig)):
        for mode in ("plain", "sleep", "profiler", "plain"):
            res.setdefault((name, mode), []).append(timed(fn, mode))
for k, v in res.items():
    print(k, f"median {statistics.median(v):.1f}", [round(t, 1) for t in v], flush=True)
