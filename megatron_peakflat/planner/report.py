"""The planner's reports of a plan and its recommendation: the text table (``render``), its JSON (``to_json``), the
labelled line of recommended flags (``flags_line``) and a bar chart (``plot``, with matplotlib).

Printed by the planner's command line (``cli/plan.py``) and ``peakflat-check``. No torch import.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from ..components import term_label
from .model import COMPONENTS, GIB, Plan
from .recommend import Recommendation, vocab_block_size
from .te_limits import deterministic_workspace_applies

__all__ = ["render", "to_json", "flags_line", "plot", "plot_available", "FLAGS_LABEL", "TRIED_LABEL"]


def _gib(x: float | None) -> str:
    return f"{'-':>9s}" if x is None else f"{x / GIB:9.2f}"


def _attention_backend(run: Any) -> str:
    """The attention backend the plan assumes, as the header shows it."""
    if run.unfused_attention:
        return f"unfused ({run.unfused_attention})"
    if deterministic_workspace_applies(run):
        return "cuDNN deterministic (--deterministic-mode: an s_q x s_kv workspace in backward)"
    return "flash/fused"


def render(pl: Plan, rec: Recommendation) -> str:
    """The text report: each stage's rows, totals and binding peak, then the recommended flags and why."""
    s, r = pl.shape, pl.run
    out = []
    out.append(f"peakflat plan: {s.name}  seq {r.seq_len:,}  GPUs {r.world} (TP{r.tp} PP{r.pp} CP{r.cp} DP{r.dp} "
               f"EP{r.ep}{' ETP' + str(r.etp) if r.etp > 1 else ''})  micro-batch {r.micro_batch}  {r.precision}  "
               f"recompute {r.recompute}  HBM {r.hbm_bytes / GIB:.0f} GiB  host {r.host_bytes_per_node / GIB:.0f} GiB/node "
               f"({r.host_bytes_per_rank / GIB:.0f} GiB/rank)")
    out.append(f"assumed: --transformer-impl {r.transformer_impl}, Adam {'fused' if r.fused_adam else 'torch'} "
               f"(--adam), attention {_attention_backend(r)}, vocabulary {s.vocab:,} as padded (from "
               f"{s.vocab_source or 'the preset'})")
    for st in pl.stages:
        out.append("")
        out.append(f"stage {st.stage}: {st.layers} layers ({st.moe_layers} MoE), {st.inflight:g} micro-batch(es) in flight;"
                   "  GiB per rank")
        width = max(18, *(len(term_label(n)) for n in st.rows))
        out.append(f"  {'term':{width}s} {'baseline':>9s} {'peakflat':>9s} {'bound':>9s} {'host':>9s}  phase")
        order = ["parameters", "gradients", "optimizer", "activations", "layer working set", "tile",
                 "attention scores",
                 "embedding gradient", "dispatcher probs", "dispatcher state", "sco", "dispatch", "vocab",
                 "reserve", "optimizer step", "probs at step", "model build"]
        for name in order + [n for n in st.rows if n not in order]:
            if name not in st.rows:
                continue
            row = st.rows[name]
            mark = "*" if name in COMPONENTS else " "
            out.append(f" {mark}{term_label(name):{width}s} {_gib(row.baseline)} {_gib(row.peakflat)} "
                       f"{_gib(row.bound)} {_gib(row.host_peakflat)}  {row.phase}")
        tb, tp_ = st.total("baseline"), st.total("peakflat")
        out.append(f"  {'total':{width}s} {_gib(tb)} {_gib(tp_)} {'':9s} {_gib(st.host('peakflat'))}"
                   f"  = max(persistent + max(layer + max(attention, moe, mlp), loss), step, build)")
        tg = st.total("peakflat", guaranteed=True)
        out.append(f"  binding peak: baseline '{term_label(st.binding('baseline'))}' "
                   f"({'fits' if tb <= r.hbm_bytes else 'OOM'}), "
                   f"peakflat '{term_label(st.binding('peakflat'))}' "
                   f"({'fits' if tp_ <= r.hbm_bytes else 'OOM'} as expected; "
                   f"{_gib(tg).strip()} GiB whatever the routing: {'fits' if tg <= r.hbm_bytes else 'OOM'})")
        for n in st.notes:
            out.append(f"  note: {n}")
    wb, wp = pl.worst("baseline"), pl.worst("peakflat")
    out.append("")
    out.append(f"baseline: {wb.total('baseline') / GIB:.1f} GiB per GPU, "
               f"binding peak '{term_label(wb.binding('baseline'))}' -> "
               f"{'fits' if pl.fits('baseline') else 'does NOT fit'} in {r.hbm_bytes / GIB:.0f} GiB")
    guar = max(x.total("peakflat", guaranteed=True) for x in pl.stages)
    out.append(f"peakflat (every component that applies, at the knobs given or their defaults): "
               f"{wp.total('peakflat') / GIB:.1f} GiB expected, binding peak '{term_label(wp.binding('peakflat'))}'; "
               f"{guar / GIB:.1f} GiB whatever the routing -> "
               f"{'fits' if pl.fits('peakflat', guaranteed=True) else 'does NOT fit'}")
    rw = rec.plan.worst("peakflat")
    if rec.fits:
        out.append(f"recommended (the components this run needs, their defaults shrunk until they fit): {rw.total('peakflat') / GIB:.1f} GiB per GPU expected, "
                   f"{max(x.total('peakflat', guaranteed=True) for x in rec.plan.stages) / GIB:.1f} GiB whatever "
                   "the routing, "
                   f"{max(x.host('peakflat') for x in rec.plan.stages) / GIB:.1f} GiB host per rank; "
                   f"binding peak '{term_label(rw.binding('peakflat'))}'")
    else:
        out.append("recommended: nothing fits")
    out.append(flags_line(rec))
    for reason in rec.reasons:
        out.append(f"  why: {reason}")
    return "\n".join(out)


FLAGS_LABEL = "  flags to add: "
"""The label of the recommended flags' line where they fit."""
TRIED_LABEL = "  tried, does NOT fit (not a line to run): "
"""The label of the closest configuration's flags where nothing fits."""


def flags_line(rec: Recommendation) -> str:
    """The recommendation's flags on one labelled line: to add where they fit, else what was tried."""
    return (FLAGS_LABEL if rec.fits else TRIED_LABEL) + " ".join([*rec.layout_flags, *rec.flags])


def to_json(pl: Plan, rec: Recommendation) -> dict[str, Any]:
    """``render``'s content as a JSON-serialisable dict (GiB floats, the recommended flags as a list)."""
    def stage(st: Any) -> dict[str, Any]:
        return {"stage": st.stage, "layers": st.layers, "inflight": st.inflight,
                "rows": {k: {"baseline_gib": v.baseline / GIB, "peakflat_gib": v.peakflat / GIB,
                             "bound_gib": None if v.bound is None else v.bound / GIB,
                             "host_gib": v.host_peakflat / GIB, "phase": v.phase, "source": v.source}
                         for k, v in st.rows.items()},
                "total_baseline_gib": st.total("baseline") / GIB, "total_peakflat_gib": st.total("peakflat") / GIB,
                "host_peakflat_gib": st.host("peakflat") / GIB,
                "binding_baseline": st.binding("baseline"), "binding_peakflat": st.binding("peakflat"),
                "notes": st.notes}
    return {
        "model": dataclasses.asdict(pl.shape), "run": dataclasses.asdict(pl.run),
        "stages": [stage(s) for s in pl.stages],
        "baseline": {"fits": pl.fits("baseline"), "binding": pl.worst("baseline").binding("baseline"),
                     "total_gib": pl.worst("baseline").total("baseline") / GIB},
        "peakflat": {"fits": pl.fits("peakflat", guaranteed=True), "binding": pl.worst("peakflat").binding("peakflat"),
                     "total_gib": pl.worst("peakflat").total("peakflat") / GIB},
        "recommended": {"fits": rec.fits, "flags": rec.flags, "layout_flags": rec.layout_flags, "reasons": rec.reasons,
                        "chunk_cap": rec.config.dispatch.cap(pl.shape.topk),
                        "vocab_block_size": vocab_block_size(rec.config, pl.run) if rec.config.enabled["vocab"] else None,
                        "vocab_schedule": rec.plan.vocab_schedule, "sco_budget_gib": (rec.config.sco.budget or 0) / GIB,
                        "optimizer_bucket": rec.config.optimizer.bucket, "optimizer_slots": rec.config.optimizer.slots,
                        "total_gib": rec.plan.worst("peakflat").total("peakflat") / GIB,
                        "guaranteed_total_gib": max(x.total("peakflat", guaranteed=True)
                                                    for x in rec.plan.stages) / GIB,
                        "binding": rec.plan.worst("peakflat").binding("peakflat")},
    }


def plot(pl: Plan, path: str) -> None:
    """Bar chart of the binding stage: baseline vs peakflat per term, then each column's total (the peak, not
    the sum of the terms: phases that do not overlap take their maximum), labelled in GiB; HBM as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = pl.worst("baseline")
    names = [n for n in st.rows]
    base = [st.rows[n].baseline / GIB for n in names]
    pfl = [st.rows[n].peakflat / GIB for n in names]
    totals = (st.total("baseline") / GIB, st.total("peakflat") / GIB)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = list(range(len(names)))
    xt = len(names) + 0.5  # the totals, set apart from the terms
    ax.bar([x - 0.2 for x in xs] + [xt - 0.2], base + [totals[0]], width=0.4, label="baseline", color="tab:blue")
    ax.bar([x + 0.2 for x in xs] + [xt + 0.2], pfl + [totals[1]], width=0.4, label="peakflat", color="tab:orange")
    for dx, total in zip((-0.2, 0.2), totals):
        ax.annotate(f"{total:.1f}", (xt + dx, total), ha="center", va="bottom", fontsize=8)
    ax.axvline(len(names) - 0.25, color="grey", linewidth=0.5)
    ax.axhline(pl.run.hbm_bytes / GIB, color="red", linestyle="--", label=f"HBM {pl.run.hbm_bytes / GIB:.0f} GiB")
    ax.set_xticks(xs + [xt], names + ["total (peak)"], rotation=30, ha="right")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{pl.shape.name}, seq {pl.run.seq_len:,}, {pl.run.world} GPUs ({st.stage} stage): "
                 f"total {totals[0]:.1f} -> {totals[1]:.1f} GiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_available() -> bool:
    """Whether ``--plot`` can draw: matplotlib is importable (checked without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None
