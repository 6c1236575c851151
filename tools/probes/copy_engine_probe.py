"""Probe: copy-engine pulls through symmetric memory vs NCCL all-to-all, alone and beside GEMMs."""
import time, torch, torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

dist.init_process_group("nccl")
r, P = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(r)
dev = torch.device("cuda", r)
try:
    print(r, "backend before", symm_mem.get_backend(dev), flush=True)
except Exception as e:
    print(r, "get_backend failed", e, flush=True)
try:
    symm_mem.set_backend("CUDA")
except Exception as e:
    print(r, "set_backend failed", e, flush=True)
NB = 512 << 20
t0 = time.time()
buf = symm_mem.empty(NB // 2, dtype=torch.bfloat16, device=dev)
h = symm_mem.rendezvous(buf, dist.group.WORLD)
print(r, "rendezvous", round(time.time() - t0, 3), "s; backend", symm_mem.get_backend(dev), flush=True)
buf.fill_(r + 1)
h.barrier()
torch.cuda.synchronize()
peer = (r + 1) % P
remote = h.get_buffer(peer, (NB // 2,), torch.bfloat16)
out = torch.empty(NB // 2, dtype=torch.bfloat16, device=dev)
side = torch.cuda.Stream()

def ce():
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        h.barrier()
        out.copy_(remote)
        h.barrier()
    torch.cuda.current_stream().wait_stream(side)

sb = torch.empty(NB // 2, dtype=torch.bfloat16, device=dev); rb = torch.empty_like(sb)
def nccl():
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_to_all_single(rb, sb)
    torch.cuda.current_stream().wait_stream(side)

ce(); torch.cuda.synchronize()
print(r, "pulled value", out[0].item(), out[-1].item(), "expected", peer + 1, flush=True)
A = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16); B = torch.randn(4096, 6144, device=dev, dtype=torch.bfloat16)
def gemms(n=12):
    for _ in range(n):
        A @ B

def timed(fn, reps=5):
    fn(); torch.cuda.synchronize(); dist.barrier()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        dist.barrier(); torch.cuda.synchronize()
        e0.record(); fn(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return sorted(ts)[len(ts) // 2]

g = timed(gemms)
c = timed(ce)
n = timed(nccl)
def gemm_with(comm_launch):
    def f():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                comm_launch()
        gemms()
        torch.cuda.current_stream().wait_stream(side)
    return f

def ce_raw():
    h.barrier(); out.copy_(remote); h.barrier()

def nccl_raw():
    dist.all_to_all_single(rb, sb)

gc = timed(gemm_with(ce_raw)); gn = timed(gemm_with(nccl_raw))
# GEMM-stream time alone inside the overlap: record on main stream only
def gemm_only_time(comm_launch):
    dist.barrier(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            comm_launch()
    e0.record(); gemms(); e1.record()
    torch.cuda.current_stream().wait_stream(side); torch.cuda.synchronize()
    return e0.elapsed_time(e1)
gce = sorted(gemm_only_time(ce_raw) for _ in range(5))[2]
gnc = sorted(gemm_only_time(nccl_raw) for _ in range(5))[2]
gb = NB / 1e9
print(f"rank {r}: gemms alone {g:.2f} ms; CE pull {gb:.2f} GB {c:.2f} ms ({gb / c * 1e3:.0f} GB/s); NCCL a2a {gb:.2f} GB {n:.2f} ms; "
      f"gemms+3xCE {gc:.2f} ms (gemm stream {gce:.2f}); gemms+3xNCCL {gn:.2f} ms (gemm stream {gnc:.2f})", flush=True)
dist.barrier()
dist.destroy_process_group()
