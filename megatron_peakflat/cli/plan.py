"""``python -m megatron_peakflat.plan`` (console script ``peakflat-plan``): per-rank memory of a Megatron MoE run,
peakflat off and on, the binding peak and the knobs that fit.

The command line only: its flags are read by ``planner.build`` (whose ``EXAMPLES`` are its --help epilog), planned
by ``planner.model`` and ``planner.recommend``, and printed by ``planner.report``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Sequence

from ..config_base import PeakflatConfigError
from ..planner import te_limits
from ..planner.build import build
from ..planner.megatron_args import in_training_words, is_command_line, unmodelled
from ..planner.model import plan
from ..planner.recommend import recommend
from ..planner.report import plot, plot_available, render, to_json
from ..planner.shapes import PRESETS

__all__ = ["main", "NOTHING_FITS"]

NOTHING_FITS = 3
"""Exit status when no configuration fits the GPU (2 is a bad flag, as argparse's)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner; returns the exit status: 0 when the recommendation fits, ``NOTHING_FITS`` (3) when
    nothing does, 2 with the flag, value and fix on stderr for a bad flag. A reader that closes the pipe early
    (``| head``) ends the output quietly."""
    status = [0]  # set by _main before it prints, so that a closed pipe keeps the plan's status
    try:
        status[0] = _main(argv, status)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
    return status[0]


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's own flush at exit meets no closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured, replaced)
        pass


def _main(argv: Sequence[str] | None, status: list[int]) -> int:
    try:
        shape, run, pf, ns, ignored = build(argv)
        if ns.plot and not plot_available():
            raise PeakflatConfigError("--plot", ns.plot, "needs matplotlib, which is not installed here",
                                      "pip install 'megatron-peakflat[plot]' (or pip install matplotlib), or drop --plot")
    except PeakflatConfigError as e:
        given = list(argv if argv is not None else sys.argv[1:])
        if "--megatron-args" in given or any(a.startswith("--megatron-args=") for a in given):
            e = in_training_words(e, keep=[a.split("=")[0] for a in given if a.startswith("--")])
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.list_presets:
        for name, s in PRESETS.items():
            print(f"{name:18s} layers {s.layers:3d}  hidden {s.hidden:5d}  heads {s.heads:3d}/{s.kv_heads:<3d} "
                  f"experts {s.experts:3d} top-{s.topk}  moe-ffn {s.moe_ffn:5d}  ffn {s.ffn:5d}  vocab {s.vocab}  "
                  f"({s.source})")
        return 0
    mns = ns.megatron_namespace
    if mns is not None and is_command_line(mns):
        refusal = te_limits.line_refusal(shape, run, mns)
    else:  # a preset: the recommendation adds --no-rope-fusion where RoPE needs it, and turns the tiled sublayer
        # on where the whole-sequence norms need it (they then run in row slices); no flag lifts the others
        preset = argparse.Namespace(**vars(mns)) if mns is not None else argparse.Namespace()
        preset.peakflat_tile_enabled = True
        refusal = te_limits.hard_refusal(shape, run, preset, preset=True)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        pl = plan(shape, run, pf)
        rec = recommend(shape, run, pf, mns)
    except PeakflatConfigError as e:  # a layout the model refuses once it is laid out (a pipeline stage's layers)
        print(f"error: {e}", file=sys.stderr)
        return 2
    status[0] = 0 if rec.fits else NOTHING_FITS
    line = shlex.split(ns.megatron_args) if ns.megatron_args else []
    named = dict(unmodelled(line))
    not_modelled = list(named.values())
    ignored = [f for f in ignored if f.split("=")[0] not in named]
    if ns.json:
        doc = to_json(pl, rec)
        doc["ignored_megatron_flags"] = ignored
        doc["unmodelled_megatron_flags"] = not_modelled
        print(json.dumps(doc, indent=2))
    else:
        print(render(pl, rec))
        for note in not_modelled:
            print(f"warning: not modelled, {note}")
        if ignored:
            print(f"(Megatron flags the planner does not read, taken as not changing memory: {' '.join(ignored)})")
    if ns.plot:
        plot(pl, ns.plot)
        if not ns.json:
            print(f"wrote {ns.plot}")
    return status[0]


if __name__ == "__main__":
    sys.exit(main())
