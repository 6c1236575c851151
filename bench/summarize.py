"""Print the results tables of docs/results.md from bench/results/*.json (``python bench/summarize.py``).

Nothing here is measured: every figure comes from a committed results file, so the tables in docs/results.md
can be regenerated and checked against the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    max_seq = (row.get("extra") or {}).get("max_seq")
    if max_seq is not None:  # a largest-sequence search (bench/sco.py --max-seq)
        bound = "" if (row.get("extra") or {}).get("complete", True) else " or more"
        return f"largest S {max_seq}{bound}"
    if row.get("peak_gib") is None:
        if row.get("ms") is not None:  # a timing without a peak (bench/vocab_parts.py)
            return f"{row['ms']:.2f} ms"
        return row.get("extra", {}).get("error", "failed")
    return f"{row['peak_gib']:.2f} GiB, {row['ms']:.0f} ms"


def where(doc: dict) -> str:
    """Where a results file's rows ran: the cards its rows record, with their counts; rows written before rows
    recorded a card are counted apart, under the file's top-level ``device`` (its main run's card, which a
    merged row need not share). A file whose rows record none gives its ``device`` alone, as before."""
    cards: dict[str, int] = {}
    for r in doc["rows"]:
        cards[r.get("card") or ""] = cards.get(r.get("card") or "", 0) + 1
    unknown = cards.pop("", 0)
    if not cards:
        return doc["device"]
    out = "rows' cards: " + ", ".join(f"{c} ({n} rows)" for c, n in cards.items())
    if unknown:
        out += f"; {unknown} rows record none (the file's main run: {doc['device']})"
    return out


def ratio_note(doc: dict, case: str, a: str, b: str, key: str = "ms") -> str:
    """'method a / method b = r' of one case, computed only when both rows record the same card
    (bench/harness.py ``ratio``); otherwise the reason no ratio is given."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.harness import ratio

    rows = {r["method"]: r for r in doc["rows"] if r["case"] == case}
    if a not in rows or b not in rows:
        return f"{a} / {b}: not both measured at {case}"
    try:
        return f"{a} / {b} = {ratio(rows[a], rows[b], key):.3f} ({key}, both on {rows[a]['card']})"
    except ValueError as e:
        return f"{a} / {b}: {e}"


def table(name: str, methods: list[str], title: str) -> str:
    doc = _load(name)
    if doc is None:
        return f"_{name}: no results committed_\n"
    by_case: dict[str, dict[str, dict]] = {}
    for r in doc["rows"]:
        by_case.setdefault(r["case"], {})[r["method"]] = r
    present = [m for m in methods if any(m in rows for rows in by_case.values())]
    # the commands, each with its machine and commit, are in the JSON and in bench/README.md's provenance table
    out = [f"**{title}** ({where(doc)}, torch {doc['torch']}, megatron-core {doc['megatron_core']}; "
           "commands in bench/README.md)", "",
           "| case | " + " | ".join(present) + " |", "|---" * (len(present) + 1) + "|"]
    for case, rows in by_case.items():
        out.append(f"| `{case}` | " + " | ".join(_cell(rows.get(m)) for m in present) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    sections = [
        ("vocab", ["peakflat-fwd-main-grad", "peakflat-main-grad", "peakflat", "peakflat-input", "megatron-native-ce",
                   "megatron-fused-ce", "liger-flce", "liger-flce-fp32", "cce"], "Vocabulary projection + loss, forward + backward, bf16"),
        ("vocab_parts", ["logits", "fold", "grad", "dx", "dw", "chunks x sum", "whole call"],
         "Ring-DTP in-forward, one GPU: each step of one chunk alone, and the whole call"),
        ("dispatch", ["peakflat", "peakflat-nooverlap", "peakflat-strided", "peakflat-c32768", "peakflat-c16384",
                      "peakflat-c65536", "llep-unchunked",
                      "megatron-alltoall"],
         "MoE layer dispatch, forward + backward, bf16, 64 experts top-8 unless the case says E, k, F=1536"),
        ("sco", ["peakflat", "megatron-full-recompute", "save-on-cpu"],
         "Checkpoint boundaries: GPT forward + backward under full recompute, bf16"),
        ("optimizer", ["peakflat", "peakflat-gpu", "peakflat-cpu", "megatron-hybrid-optimizer",
                       "megatron-hybrid-optimizer-nooverlap", "gpu-fused-adamw"],
         "Optimizer step, fp32 master parameters"),
    ]
    for name, methods, title in sections:
        sys.stdout.write(table(name, methods, title) + "\n")
    planner = _load("planner")
    if planner:
        sys.stdout.write(f"**Planner: measured vs predicted** ({planner['device']})\n\n| case | method | term | measured | "
                         "predicted | error |\n|---|---|---|---|---|---|\n")
        for r in planner["rows"]:
            e = r.get("extra", {})
            sys.stdout.write(f"| `{r['case']}` | {r['method']} | {e.get('term', '')} | {r['peak_gib']:.3f} GiB | "
                             f"{e.get('predicted_gib', float('nan')):.3f} GiB | {e.get('error_pct', float('nan')):+.1f}% |\n")


if __name__ == "__main__":
    main()
