"""``--peakflat-vocab-shard-over-ep`` on two GPUs (NCCL, bf16), through Megatron's own pretrain loop.

The same tiny MoE GPT, data and seed three ways: Megatron's own loss (peakflat off), Ring-DTP with the
whole output layer on every rank, and Ring-DTP with the layer's rows split over the EP group (EP=2).
The shard must train as the whole layer does (losses and grad norms, bf16 level) and hold less: Megatron's
memory report after two iterations (weights, gradient buffers, optimizer state) must drop by at least
the output layer's weight and fp32 gradient rows that moved to the other rank.
"""

from __future__ import annotations

import pytest
import torch

from megatron_peakflat.testing.subproc import logged, memory_report, run_module

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (EP=2 over NCCL)")

V, H = 65536, 512
ARGS = (f"--num-layers 2 --hidden-size {H} --num-attention-heads 8 --ffn-hidden-size 1024 --num-experts 4 "
        "--moe-router-topk 2 --moe-ffn-hidden-size 512 --moe-token-dispatcher-type alltoall "
        "--disable-bias-linear --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 "
        f"--global-batch-size 4 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size {V} "
        "--log-interval 1 --eval-iters 0 --eval-interval 1000 --position-embedding-type rope --bf16 --seed 1234 "
        "--expert-model-parallel-size 2 --untie-embeddings-and-output-weights --use-distributed-optimizer "
        "--hidden-dropout 0 --attention-dropout 0 --deterministic-mode --train-iters 4").split()
RING = ("--peakflat-vocab", "ring-dtp")


def _pretrain(*argv: str) -> str:
    out = run_module("megatron_peakflat.pretrain", *ARGS, *argv, nproc=2, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def _allocated_mb(text: str) -> float:
    """Rank 0's allocated memory in Megatron's report after two iterations."""
    found = memory_report(text)
    assert found, "no memory report after 2 iterations"
    return found[0]


def test_sharded_output_layer_trains_as_the_whole_one_and_holds_less():
    off, whole, shard = _pretrain(), _pretrain(*RING), _pretrain(*RING, "--peakflat-vocab-shard-over-ep")
    assert f"output layer sharded over the expert-parallel group (EP=2): {V // 2} of {V} rows" in shard
    loss = {k: logged(t, "lm loss") for k, t in (("off", off), ("whole", whole), ("shard", shard))}
    norm = {k: logged(t, "grad norm") for k, t in (("off", off), ("whole", whole), ("shard", shard))}
    assert len(loss["off"]) == 4 and len(norm["off"]) == 4, loss
    # the same ring-DTP math over one more ring step: float summation order only
    assert loss["shard"] == pytest.approx(loss["whole"], rel=2e-3), loss
    assert norm["shard"] == pytest.approx(norm["whole"], rel=2e-2), norm
    # Megatron's bf16 logits against ring-DTP's fp32 accumulation
    assert loss["shard"] == pytest.approx(loss["off"], rel=1e-2), loss
    # half the rows leave each rank: their bf16 weight (2 B) and fp32 DDP gradient (4 B) per element; the
    # distributed optimizer already split the fp32 state over the two data-parallel ranks either way
    saved = (V // 2) * H * (2 + 4) / 2**20
    drop = _allocated_mb(whole) - _allocated_mb(shard)
    assert drop >= 0.9 * saved, (drop, saved)
