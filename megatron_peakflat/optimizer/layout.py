"""Where each parameter lives in the flat host state, and how that state is cut into buckets.

Parameters are laid end to end, in param-group order, in one flat fp32 space; a bucket is a window
of at most ``bucket`` elements of it. A parameter may straddle buckets, so buckets hold *pieces*:
the part of one parameter that falls inside one bucket. Every tensor of the step (host state,
staging slot, gradient, model parameter) is addressed through these pieces, so the layout is the
only place that knows the geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Piece", "Bucket", "Layout", "plan_layout"]


@dataclass(frozen=True)
class Piece:
    param: int
    """Index of the parameter in the optimizer's flat parameter list."""
    group: int
    """Index of its param group (lr, weight decay)."""
    lo: int
    """First element of the parameter (flattened) inside this piece."""
    hi: int
    """One past the last element."""
    at: int
    """Offset of the piece inside its bucket."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int
    """Offset of the bucket in the flat host state."""
    numel: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Layout:
    offsets: tuple[int, ...]
    """Flat offset of each parameter."""
    numels: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    total: int

    @property
    def max_bucket(self) -> int:
        return max((b.numel for b in self.buckets), default=0)


def plan_layout(numels: list[int], groups: list[int], bucket: int) -> Layout:
    """Lay parameters of ``numels`` (in group ``groups[i]``) end to end and cut buckets of ``bucket``."""
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1 element, got {bucket}")
    if len(numels) != len(groups):
        raise ValueError(f"numels ({len(numels)}) and groups ({len(groups)}) differ in length")
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    buckets = []
    pi = 0
    for bi, start in enumerate(range(0, total, bucket)):
        end = min(total, start + bucket)
        pieces = []
        while pi < len(numels) and offsets[pi] < end:
            lo = max(start, offsets[pi]) - offsets[pi]
            hi = min(end, offsets[pi] + numels[pi]) - offsets[pi]
            if hi > lo:
                pieces.append(Piece(pi, groups[pi], lo, hi, offsets[pi] + lo - start))
            if offsets[pi] + numels[pi] <= end:
                pi += 1
            else:
                break
        buckets.append(Bucket(bi, start, end - start, tuple(pieces)))
    return Layout(tuple(offsets), tuple(numels), tuple(buckets), total)
