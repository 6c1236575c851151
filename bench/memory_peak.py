"""What was alive at the peak: read a CUDA allocator snapshot and name the tensors behind its highest point.

A snapshot from ``torch.cuda.memory._snapshot()`` (Megatron writes one per log interval with
``--record-memory-history --memory-snapshot-path FILE``) holds the blocks alive when it was taken and the
allocator's last events, each with its Python stack. Walking the events back from the live state gives the
allocated bytes after every event, so the highest point inside the recorded window, and the blocks alive
there. Each is charged to its first frame in this package or in Megatron (else its first frame), and the
sites are printed largest first: the composition the peak planner has to predict.

    python3 bench/memory_peak.py snapshot.pickle --top 25
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

GIB = 2**30
OURS = ("megatron_peakflat/", "megatron/")


@dataclass
class Peak:
    """The highest allocated total in the window, how many recorded events came before it, and its live blocks."""

    bytes: int
    event: int
    live: dict[int, tuple[int, list[dict]]]
    """address -> (size, frames) of every block alive at the peak."""


def short_path(path: str) -> str:
    """``path`` from its package down (this package, Megatron or torch), wherever it is installed."""
    for pkg in OURS + ("torch/",):
        if pkg in path:
            return pkg + path.rsplit(pkg, 1)[1]
    return path


def _frame(f: dict) -> str:
    """One stack frame as ``path:line function``."""
    return f"{short_path(f.get('filename', '?'))}:{f.get('line', '?')} {f.get('name', '?')}"


def _ours(f: dict) -> bool:
    """Whether a frame is in this package or in Megatron."""
    return any(p in f.get("filename", "") for p in OURS)


def _site(frames: list[dict]) -> str:
    """The first frame in this package or Megatron (else the first frame) as ``path:line function``."""
    for f in frames:
        if _ours(f):
            return _frame(f)
    return _frame(frames[0]) if frames else "(no stack recorded)"


def _trace(snapshot: dict, device: int) -> list[dict]:
    return snapshot.get("device_traces", [[]])[device] if snapshot.get("device_traces") else []


def live_blocks(snapshot: dict) -> dict[int, tuple[int, list[dict]]]:
    """Blocks allocated when the snapshot was taken: address -> (size, frames)."""
    out: dict[int, tuple[int, list[dict]]] = {}
    for seg in snapshot.get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                out[b["address"]] = (b["size"], b.get("frames", []))
    return out


def find_peak(snapshot: dict, device: int = 0) -> Peak:
    """Replay ``device``'s recorded events backwards from the live state and return the highest point.

    Counts what ``torch.cuda.max_memory_allocated`` counts: a block from its ``alloc`` event to its
    ``free_requested`` event. A block freed while another stream still used it (``record_stream``) stays the
    allocator's until its ``free_completed``, but no longer counts as allocated in between. Exact inside the
    recorded window. Each block gets the stack of its ``alloc`` event; blocks allocated before the window keep
    the frames the live state or their free event gives them."""
    live = live_blocks(snapshot)
    trace = _trace(snapshot, device)
    total = sum(size for size, _ in live.values())
    cur = dict(live)
    best = Peak(total, len(trace), dict(cur))
    for i in range(len(trace) - 1, -1, -1):
        ev = trace[i]
        action, addr, size = ev.get("action"), ev.get("addr"), ev.get("size", 0)
        if action == "alloc":
            cur.pop(addr, None)
            total -= size
        elif action == "free_requested":
            cur[addr] = (size, ev.get("frames", []))
            total += size
        else:
            continue
        if total > best.bytes:  # the state before event i, i.e. right after event i - 1
            best = Peak(total, i, dict(cur))
    # A free event may carry the stack of whatever freed the block, not the block's own: take the block's
    # alloc event where the window has it.
    allocated = {ev.get("addr"): ev.get("frames", []) for ev in trace[:best.event] if ev.get("action") == "alloc"}
    best.live = {a: (size, allocated.get(a, frames)) for a, (size, frames) in best.live.items()}
    return best


def pending_at(snapshot: dict, event: int, device: int = 0) -> int:
    """Bytes freed before ``event`` whose memory the allocator still held for another stream's use (their
    ``free_completed`` comes after): not allocated, and not free for reuse either."""
    trace = _trace(snapshot, device)
    requested: dict[int, int] = {}
    for ev in trace[:event]:
        if ev.get("action") == "free_requested":
            requested[ev.get("addr")] = ev.get("size", 0)
        elif ev.get("action") == "free_completed":
            requested.pop(ev.get("addr"), None)
    return sum(requested.values())


def by_site(live: dict[int, tuple[int, list[dict]]]) -> list[tuple[str, int, int]]:
    """(site, bytes, blocks), largest first."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        s = sums[_site(frames)]
        s[0] += size
        s[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in sums.items()), key=lambda r: -r[1])


def largest_blocks(live: dict[int, tuple[int, list[dict]]], n: int, depth: int = 8) -> Iterable[str]:
    """The ``n`` largest blocks, each with the first ``depth`` frames of its stack (where ``by_site`` names one
    frame, this shows what called it: a site such as an autograd backward holds many kinds of tensors)."""
    for size, frames in sorted(live.values(), key=lambda v: -v[0])[:n]:
        yield f"  block {size / GIB:8.3f} GiB ({size} B)"
        for f in frames[:depth]:
            yield f"      {_frame(f)}"


def events(snapshot: dict, min_bytes: int, device: int = 0, depth: int = 6) -> Iterable[str]:
    """Every recorded alloc and free of at least ``min_bytes``, in order: index, action, GiB, address, and the
    first ``depth`` frames in this package or Megatron (where a block lived, and what freed it when)."""
    for i, ev in enumerate(_trace(snapshot, device)):
        if ev.get("size", 0) >= min_bytes and ev.get("action") in ("alloc", "free_requested", "free_completed"):
            frames = [f"{short_path(f.get('filename', '?'))}:{f.get('line', '?')}" for f in ev.get("frames", [])
                      if _ours(f)][:depth]
            yield f"{i} {ev['action']} {ev['size'] / GIB:.3f} {ev.get('addr')} {' < '.join(frames)}"


def report(snapshot: dict, top: int = 25, device: int = 0, blocks: int = 0, depth: int = 0) -> Iterable[str]:
    """The peak, the event that reached it (with ``depth`` frames of its stack), the sites alive there largest
    first, and with ``blocks`` the largest blocks with their stacks."""
    peak = find_peak(snapshot, device)
    trace = _trace(snapshot, device)
    yield (f"peak in the recorded window: {peak.bytes / GIB:.2f} GiB allocated, after the first {peak.event} of "
           f"{len(trace)} events; {len(peak.live)} blocks; at the snapshot: {sum(s for s, _ in live_blocks(snapshot).values()) / GIB:.2f} GiB")
    if 0 < peak.event <= len(trace):
        last = trace[peak.event - 1]
        yield (f"  reached by event {peak.event - 1}, {last.get('action')} of {last.get('size', 0) / GIB:.3f} GiB; "
               f"freed but held for another stream there: {pending_at(snapshot, peak.event, device) / GIB:.3f} GiB")
        for f in last.get("frames", [])[:depth]:
            yield f"      {_frame(f)}"
    for site, size, n in by_site(peak.live)[:top]:
        yield f"  {size / GIB:8.3f} GiB  {n:5d}  {site}"
    if blocks:
        yield f"the {blocks} largest blocks at the peak, with their stacks:"
        yield from largest_blocks(peak.live, blocks)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot", help="pickle written by torch.cuda.memory._snapshot()")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=0, help="also list the N largest blocks at the peak with their stacks")
    ap.add_argument("--depth", type=int, default=0, help="print N frames of the stack of the event that reached the peak")
    ap.add_argument("--events", type=float, default=0.0, metavar="GIB",
                    help="instead, list every alloc and free of at least GIB, in order, with their frames")
    a = ap.parse_args(argv)
    with open(a.snapshot, "rb") as f:
        snap: Any = pickle.load(f)
    lines = events(snap, int(a.events * GIB), a.device) if a.events else report(snap, a.top, a.device, a.blocks, a.depth)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
