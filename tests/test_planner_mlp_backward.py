"""A dense MLP's backward transient: the gradients of its activation's and fc1's outputs, planned in its own phase
(never alive with attention's backward or a MoE's), so a dense layer whose MLP backward outweighs its attention's
backward binds on it. The calibration rows of two dense models on one H100 read 0.816 and 0.973 without it."""

from __future__ import annotations

from megatron_peakflat.config import PeakflatConfig
from megatron_peakflat.planner.model import RunConfig, mlp_backward_transient, plan
from megatron_peakflat.planner.shapes import ModelShape
from megatron_peakflat.vocab.config import VocabConfig

DENSE = ModelShape(name="dense", hidden=2048, layers=2, heads=16, kv_heads=2, head_dim=128, ffn=8192, vocab=32000,
                   tied_embeddings=True)


def test_the_term_is_the_two_gradients_in_the_models_dtype():
    run = RunConfig(seq_len=65536)
    assert mlp_backward_transient(DENSE, run, DENSE.ffn) == 65536 * (2 * 8192 + 8192) * 2  # gated, bf16, TP 1
    tp2 = RunConfig(seq_len=65536, tp=2, sequence_parallel=True)
    assert mlp_backward_transient(DENSE, tp2, DENSE.ffn) == 65536 * (2 * 8192 + 8192) * 2 / 2
    ungated = DENSE.with_(gated=False)
    assert mlp_backward_transient(ungated, run, 8192) == 65536 * (8192 + 8192) * 2


def test_a_dense_stage_plans_it_in_its_own_phase_and_binds_on_it():
    st = plan(DENSE, RunConfig(seq_len=65536), PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"))).stages[0]
    row = st.rows["mlp backward"]
    assert row.phase == "mlp" and row.baseline == mlp_backward_transient(DENSE, RunConfig(seq_len=65536), 8192)
    assert row.baseline > st.rows["tile"].baseline  # 1.5 GiB against the GQA attention's backward
    # with the loss bounded by Ring-DTP, the layer's backward binds, on the MLP's side
    assert "mlp" in st.live_phases("peakflat") and "attention" not in st.live_phases("peakflat")


def test_a_moe_only_stage_has_no_such_row():
    moe = DENSE.with_(experts=8, topk=2, moe_ffn=1024)
    assert "mlp backward" not in plan(moe, RunConfig(seq_len=4096), PeakflatConfig()).stages[0].rows
