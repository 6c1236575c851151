"""The planner's predicted peak (total less reserve, last stage) for the MoE GPT of bench/results/pretrain_mtp_32k.json,
with and without its MTP layer, Megatron's loss against Ring-DTP's: compared with that file's measured max allocated.
CPU only: python3 bench/planner_mtp.py"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_peakflat.memory.cli import build
from megatron_peakflat.memory.model import plan, GIB
from megatron_peakflat.config import PeakflatConfig
from megatron_peakflat.vocab.config import VocabConfig
args = ("--num-layers 2 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632 --num-experts 8 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 1408 --moe-token-dispatcher-type alltoall --disable-bias-linear --swiglu --seq-length 32768 "
        "--untie-embeddings-and-output-weights --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 1 --bf16 "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --vocab-size 201088 --deterministic-mode")
for mtp in ("", " --mtp-num-layers 1"):
    shape, run, pf, ns, _ = build(["--megatron-args", args + mtp, "--gpus", "1", "--hbm-gib", "139", "--ep", "1"])
    for name, cfg in (("off", PeakflatConfig()), ("vocab", PeakflatConfig(vocab=VocabConfig(impl="ring-dtp")))):
        st = plan(shape, run, cfg).stages[-1]
        col = "baseline" if name == "off" else "peakflat"
        tot = st.total(col) - st.rows["reserve"].baseline
        print(f"mtp={bool(mtp)} {name}: predicted {tot/GIB:.2f} GiB (binding {st.binding(col)}), vocab row {getattr(st.rows['vocab'], col)/GIB:.2f}")
