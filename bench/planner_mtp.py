"""The planner's predicted peak (total less reserve, last stage) for the MoE GPT of bench/results/pretrain_mtp_32k.json,
with and without its MTP layer, Megatron's loss against Ring-DTP's: compared with that file's measured max allocated.
Both runs were measured before moe-release (integration/moe_release.py), so the dispatcher's held tensors are
counted in both columns here; pretrain_mtp_32k_release.json is the Ring-DTP run again with it. CPU only: python3 bench/planner_mtp.py"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_peakflat.config import PeakflatConfig  # noqa: E402
from megatron_peakflat.planner.build import build  # noqa: E402
from megatron_peakflat.planner.model import GIB, StagePlan, plan  # noqa: E402
from megatron_peakflat.vocab.config import VocabConfig  # noqa: E402

FLAGS = ("--num-layers 2 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632 --num-experts 8 "
         "--moe-router-topk 2 --moe-ffn-hidden-size 1408 --moe-token-dispatcher-type alltoall --disable-bias-linear "
         "--swiglu --seq-length 32768 --untie-embeddings-and-output-weights --use-distributed-optimizer "
         "--micro-batch-size 1 --global-batch-size 1 --bf16 --recompute-granularity full --recompute-method uniform "
         "--recompute-num-layers 1 --vocab-size 201088 --deterministic-mode --transformer-impl local")
"""examples/pretrain_moe.sh's flags for the env of pretrain_mtp_32k.json, with the local spec that the pretrain entry
chose there (no Transformer Engine on that machine)."""
RUNS = {"off": ("baseline", PeakflatConfig()), "vocab": ("peakflat", PeakflatConfig(vocab=VocabConfig(impl="ring-dtp")))}
"""pretrain_mtp_32k.json's runs: the planner's column and configuration for each."""


def predicted(mtp: bool, run_name: str, released: bool = False) -> tuple[StagePlan, float]:
    """The last stage's plan and its predicted allocation in GiB (the total less the reserve). ``released``: as
    the run would be now, with moe-release; else as it was measured, before it."""
    shape, run, _, _, _ = build(["--megatron-args", FLAGS + (" --mtp-num-layers 1" if mtp else ""), "--gpus", "1",
                                 "--hbm-gib", "139", "--ep", "1"])
    col, cfg = RUNS[run_name]
    st = plan(shape, run, cfg).stages[-1]
    for row in st.rows.values():  # the measured runs predate moe-release: Megatron's dispatcher kept its probs
        if not released and row.name in ("dispatcher probs", "probs at step", "dispatcher state"):
            row.peakflat = row.baseline
    return st, (st.total(col) - getattr(st.rows["reserve"], col)) / GIB


RELEASED = "pretrain_mtp_32k_release.json"
"""The Ring-DTP run again with moe-release (tools/gpu_run.sh mtp-release)."""


def run_of(run_name: str, results: str = "pretrain_mtp_32k.json") -> dict:
    """That run's record in ``bench/results/<results>``."""
    return json.loads((ROOT / "bench/results" / results).read_text())["runs"][run_name]


def measured(run_name: str, results: str = "pretrain_mtp_32k.json") -> float:
    """Max allocated of that run in ``bench/results/<results>``, GiB."""
    return run_of(run_name, results)["max_allocated_mib"] / 1024


if __name__ == "__main__":
    with_mtp: dict[str, float] = {}
    for mtp in (False, True):
        for name, (col, _) in RUNS.items():
            st, tot = predicted(mtp, name)
            if mtp:
                with_mtp[name] = tot
            print(f"mtp={mtp} {name}: predicted {tot:.2f} GiB (binding {st.binding(col)}), "
                  f"vocab row {getattr(st.rows['vocab'], col) / GIB:.2f}")
    got = {n: measured(n) for n in RUNS}
    print("# measured with the MTP layer: " + ", ".join(f"{n} {v:.2f} GiB" for n, v in got.items()))
    print("# predicted/measured - 1: " + ", ".join(f"{n} {with_mtp[n] / v - 1:+.1%}" for n, v in got.items()))
    released = predicted(True, "vocab", True)[1]
    if (ROOT / "bench/results" / RELEASED).exists():
        run = run_of("vocab", RELEASED)
        got = run["max_allocated_mib"] / 1024
        print(f"# with moe-release ({RELEASED}): measured {got:.2f} GiB, predicted {released:.2f} GiB, "
              f"{released / got - 1:+.1%}")
        gap = max(abs(a - b) / abs(b) for a, b in zip(run["lm_loss"], run_of("vocab")["lm_loss"]))
        print(f"# its lm loss against the run without moe-release (--deterministic-mode, {len(run['lm_loss'])} "
              f"logged values): largest relative difference {gap:.1e}")
    else:
        print(f"# not measured yet: the vocab run with moe-release, predicted {released:.2f} GiB")
