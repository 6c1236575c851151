"""The planner under context parallelism: per-rank tokens s/CP, the SDPA attention's gathered K/V in the attention
rows, and a recommended line that prints the whole parallel layout, so that pasting it reproduces the plan."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from megatron_peakflat.attention.calls import GROUPED_CALL_MIN_KEYS
from megatron_peakflat import PeakflatConfig
from megatron_peakflat.config import GeneralConfig
from megatron_peakflat.dispatch.config import DispatchConfig
from megatron_peakflat.planner import model as M
from megatron_peakflat.cli.plan import main
from megatron_peakflat.planner.build import build
from megatron_peakflat.planner.report import FLAGS_LABEL, TRIED_LABEL, render
from megatron_peakflat.planner.recommend import layout_flags, recommend
from megatron_peakflat.planner.shapes import preset


def _pf(attention: str) -> PeakflatConfig:
    return PeakflatConfig(general=GeneralConfig(attention=attention))


def test_tokens_per_rank_are_the_sequence_over_cp():
    run = M.RunConfig(seq_len=65536, micro_batch=2, cp=4, tp=2, sequence_parallel=True)
    assert run.tokens == 65536 * 2 / 4 and run.layer_rows == run.tokens / 2
    assert run.expert_dp == 2 * 4 * 1  # Megatron folds the expert group over TP x CP x DP (ETP 1, EP 1)
    assert dataclasses.replace(run, ep=8).expert_dp == 1


def test_gathered_kv_rows():
    """gpt-oss-120b (8 K/V heads of 64): at CP 8 each layer keeps the whole sequence's K and V, less the rank's
    own, and its backward holds the two query chunks' dK and dV (s + s/2CP tokens), the rank's share and one chunk
    of the reduce (3 s/2CP), less the rank's own (2 s/2CP)."""
    shape = preset("gpt-oss-120b")
    run = M.RunConfig(seq_len=2**20, cp=8, tp=1, precision="bf16")
    per_token = 2 * shape.kv_heads * shape.head_dim * 2  # K and V, bf16
    S, T = 2**20, 2**20 / 8
    assert M.cp_gathered_kv(shape, run, _pf("sdpa")) == (S - T) * per_token
    assert M.cp_gathered_kv_backward(shape, run, _pf("sdpa")) == (S + S / 16 + 3 * S / 16 - 2 * S / 16) * per_token
    # Transformer Engine's attention ('auto' is planned as it; 'local' hands the layer spec to it under CP) and
    # no CP: nothing gathered
    for attention in ("auto", "local"):
        assert M.cp_gathered_kv(shape, run, _pf(attention)) == M.cp_gathered_kv_backward(shape, run, _pf(attention)) == 0
    one = dataclasses.replace(run, cp=1, seq_len=2**17)
    assert M.cp_gathered_kv(shape, one, _pf("sdpa")) == M.cp_gathered_kv_backward(shape, one, _pf("sdpa")) == 0
    # TP splits the K/V heads
    assert M.cp_gathered_kv(shape, dataclasses.replace(run, tp=2), _pf("sdpa")) == (S - T) * per_token / 2
    # the rows carry it: the recomputed layer's working set and attention's backward grow by exactly these
    with_kv = M.plan(shape, run, _pf("sdpa")).stages[0].rows
    without = M.plan(shape, run, _pf("local")).stages[0].rows
    n_work = with_kv["layer working set"].peakflat / (M.attention_activations(shape, run) +
                                                      M.moe_nondispatch_activations(shape, run) +
                                                      M.cp_gathered_kv(shape, run, _pf("sdpa")))
    assert n_work == pytest.approx(1.0)  # full recompute, one layer per checkpoint
    assert with_kv["layer working set"].peakflat - without["layer working set"].peakflat == pytest.approx(
        (S - T) * per_token)
    assert with_kv["tile"].peakflat - without["tile"].peakflat == pytest.approx(
        (S + S / 16 + 3 * S / 16 - 2 * S / 16) * per_token)
    assert "cp_gathered_kv" in with_kv["tile"].source


def test_tiled_attention_under_cp_counts_the_gathered_sequence():
    """--peakflat-tile at CP 4 (gpt-oss-120b, 1M tokens): each rank's two chunks are tiled, so the tile is at most
    a chunk (s / 2CP), and attention's backward is tile/bound.py's at cp=4: K, V, their fp32 gradient sums and the
    attention's prefix gradients of the whole gathered sequence, the rank's reduce-scattered dK and dV and one
    chunk of the collectives' reordering, beside the rank's own incoming gradient and dx."""
    from megatron_peakflat.tile.bound import tiled_attention_peak_bytes, tiled_attention_terms
    from megatron_peakflat.tile.config import TileConfig

    shape = preset("gpt-oss-120b")
    S = 2**20
    run = M.RunConfig(seq_len=S, cp=4, tp=1, precision="bf16")
    pf = PeakflatConfig(tile=TileConfig(enabled=True, tokens=S))  # asked longer than a chunk
    assert M.tiles_attention(shape, run, pf) and M.tile_tokens(run, pf) == S // 8
    row = M.plan(shape, run, pf).stages[0].rows["tile"]
    want = tiled_attention_peak_bytes(S // 8, S // 4, 1, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                                      2, cp=4)
    # and cuDNN's dK and dV at the query heads of one of the tile's calls, one per K/V head (te_tile_calls), against
    # the gathered sequence (te_gqa_expansion), with the split's K and V copies of that sequence and the tile's
    # output twice (the calls' and their concatenation)
    calls = shape.kv_heads
    assert M.te_tile_calls(shape, run) == calls
    assert M.te_gqa_expansion(shape, run, S // 8) == 2 * shape.heads // calls * S * shape.head_dim * 2
    want += 2 * shape.heads // calls * S * shape.head_dim * 2
    want += 2 * S * shape.kv_heads * shape.head_dim * 2 + 2 * (S // 8) * shape.heads * shape.head_dim * 2
    assert row.peakflat == row.bound == want and "gathered sequence" in row.source
    kv = shape.kv_heads * shape.head_dim  # elements of K (or V) per token
    terms = tiled_attention_terms(S // 8, S // 4, 1, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, 2,
                                  cp=4)
    rank = tiled_attention_terms(S // 8, S // 4, 1, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, 2)
    assert terms.whole["K and V"] == 2 * S * kv * 2 == 4 * rank.whole["K and V"]
    assert terms.whole["dK and dV fp32 sums"] == 2 * S * kv * 4
    assert terms.whole["attention's dK and dV over a tile's prefix"] == 2 * S * kv * 2
    assert terms.whole["rank's dK and dV fp32 after the reduce-scatter"] == 2 * (S // 4) * kv * 4
    assert terms.whole["a chunk held while the collectives reorder the layout"] == (S // 8) * kv * 4
    assert terms.whole["dx"] == rank.whole["dx"] == (S // 4) * shape.hidden * 2  # the rank's own rows
    assert terms.tile == rank.tile  # a tile of s / 2CP tokens either way
    # sequence parallelism and multi-latent attention are still not tiled
    assert not M.tiles_attention(shape, dataclasses.replace(run, tp=2, sequence_parallel=True), pf)


def test_layout_flags_name_every_size_and_etp_where_it_differs():
    run = M.RunConfig(seq_len=4096, tp=2, cp=4, ep=8, pp=2, etp=2, dp=2)
    flags = layout_flags(run)
    assert flags == ["--tensor-model-parallel-size", "2", "--context-parallel-size", "4",
                     "--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    assert layout_flags(dataclasses.replace(run, etp=1))[8:10] == ["--expert-tensor-parallel-size", "1"]


def _recommended_line(out: str) -> list[str]:
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("recommended"))
    label = FLAGS_LABEL if lines[i + 1].startswith(FLAGS_LABEL) else TRIED_LABEL  # the flags' line is labelled
    return shlex.split(lines[i + 1][len(label):])


MODEL_FLAGS = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --group-query-attention "
               "--num-query-groups 4 --ffn-hidden-size 2048 --num-experts 16 --moe-router-topk 2 "
               "--moe-ffn-hidden-size 512 --swiglu --vocab-size 50304 --seq-length 262144 --micro-batch-size 1 "
               "--bf16 --disable-bias-linear --moe-token-dispatcher-type alltoall --use-distributed-optimizer "
               "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
"""A model given as a Megatron command line (whose omitted flags take Megatron's defaults), not a preset."""


REPLICATED_OPTIMIZER = (
    "--num-layers 24 --hidden-size 7168 --num-attention-heads 64 --group-query-attention --num-query-groups 1 "
    "--ffn-hidden-size 14336 --num-experts 32 --moe-router-topk 8 --moe-ffn-hidden-size 512 --vocab-size 128256 "
    "--swiglu --seq-length 4096 --micro-batch-size 3 --global-batch-size 12 --bf16 --moe-token-dispatcher-type alltoall "
    "--disable-bias-linear --recompute-granularity selective")
MANY_CHUNKS = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 8 --kv-channels 64 --ffn-hidden-size 2880 "
               "--num-experts 8 --moe-router-topk 5 --moe-ffn-hidden-size 768 --vocab-size 128256 --swiglu "
               "--untie-embeddings-and-output-weights --seq-length 1048576 --micro-batch-size 4 --bf16 "
               "--moe-token-dispatcher-type alltoall --disable-bias-linear --use-distributed-optimizer "
               "--expert-model-parallel-size 1 --recompute-granularity full --recompute-method uniform "
               "--recompute-num-layers 1")
FP32 = ("--num-layers 13 --hidden-size 2880 --num-attention-heads 64 --kv-channels 128 --ffn-hidden-size 2880 "
        "--num-experts 32 --moe-router-topk 2 --moe-ffn-hidden-size 256 --vocab-size 151936 --swiglu "
        "--untie-embeddings-and-output-weights --seq-length 65536 --micro-batch-size 2 --moe-token-dispatcher-type "
        "alltoall --disable-bias-linear --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")


@pytest.mark.parametrize("argv, model", [
    (("--preset", "gpt-oss-120b", "--seq-len", "1M", "--gpus", "16"), ""),
    (("--preset", "gpt-oss-20b", "--seq-len", "256K", "--gpus", "32", "--tp", "2"), ""),
    (("--preset", "gpt-oss-120b", "--seq-len", "512K", "--gpus", "64", "--pp", "2", "--etp", "1", "--tp", "2"), ""),
    (("--gpus", "16", "--cp", "4", "--hbm-gib", "40"), MODEL_FLAGS),
    # OffloadStreamAdamW recommended for a line without the distributed optimizer, which its flags turn on
    (("--gpus", "4", "--hbm-gib", "94"), REPLICATED_OPTIMIZER),
    # fp32: Megatron's offloaded optimizer would refuse it, OffloadStreamAdamW in its place does not
    (("--gpus", "1", "--hbm-gib", "94"), FP32),
    # a shrunk chunk cap that needs more chunks than the default allows: the pasted max-chunks must not change it
    (("--gpus", "4", "--hbm-gib", "48", "--gpus-per-node", "1"), MANY_CHUNKS),
])
def test_the_recommended_line_reproduces_the_plan(capsys, argv, model):
    """Plan, paste the printed line back as --megatron-args (beside the same preset, or after the same Megatron
    model flags, with the same sequence and GPU count), plan again: the same layout, the same recommendation and
    the same bytes in every row of every stage."""
    common = ["--hbm-gib", "80", "--host-gib", "1024"] if "--hbm-gib" not in argv else ["--host-gib", "1024"]
    first = [*argv, *(["--megatron-args", model] if model else [])]
    main([*first, *common])
    line = _recommended_line(capsys.readouterr().out)
    assert line[:2] == ["--tensor-model-parallel-size", line[1]] and "--context-parallel-size" in line
    assert "--expert-model-parallel-size" in line and "--pipeline-model-parallel-size" in line
    if model is MANY_CHUNKS:  # the case it stands for: a shrunk cap that needs more chunks than the default
        assert int(line[line.index("--peakflat-dispatch-max-chunks") + 1]) > DispatchConfig().max_chunks

    def planned(extra: list[str]):
        shape, run, pf, ns, _ = build([*extra, *common])
        return run, recommend(shape, run, pf, ns.megatron_namespace)

    # the planner's own size flags (--tp, --pp, --etp, --cp) are left out the second time: the line carries them
    sizes = ("--tp", "--pp", "--etp", "--cp")
    bare = [a for i, a in enumerate(argv) if a not in sizes and (i == 0 or argv[i - 1] not in sizes)]
    run1, rec1 = planned(first)
    run2, rec2 = planned([*bare, "--megatron-args", " ".join(filter(None, (model, shlex.join(line))))])
    fields = ("tp", "pp", "cp", "dp", "ep", "etp", "sp", "seq_len", "micro_batch", "num_micro", "recompute")
    assert [getattr(run2, f) for f in fields] == [getattr(run1, f) for f in fields]
    assert rec2.flags == rec1.flags and rec2.layout_flags == rec1.layout_flags and rec2.fits == rec1.fits
    # the recommended plan, row by row (its baseline column is Megatron as flagged, and the pasted line flags
    # Megatron's offloaded optimizer, which the recommendation replaces)
    p1, p2 = rec1.plan, rec2.plan
    assert [st.stage for st in p2.stages] == [st.stage for st in p1.stages]
    for a, b in zip(p1.stages, p2.stages):
        assert {k: (r.peakflat, r.bound, r.host_peakflat) for k, r in b.rows.items()} == \
               {k: (r.peakflat, r.bound, r.host_peakflat) for k, r in a.rows.items()}
        assert b.total("peakflat", guaranteed=True) == a.total("peakflat", guaranteed=True)
    # the knobs alone, without the layout, plan another layout here: the layout flags are what reproduce it
    if any(a in argv for a in sizes):  # a layout the planner was told, not its default for the GPU count
        knobs = " ".join(filter(None, (model, shlex.join(rec1.flags))))
        _, run3, _, _, _ = build([*bare, "--megatron-args", knobs, *common])
        sizes_ = ("tp", "pp", "cp", "ep", "etp")
        assert [getattr(run3, f) for f in sizes_] != [getattr(run1, f) for f in sizes_]


def test_layout_flags_are_apart_from_the_knobs():
    """``rec.flags`` stays the list of flags a run adds (the knobs and what they need); the layout is its own list,
    printed first on the same line, and in the JSON beside the flags."""
    from megatron_peakflat.planner.report import to_json

    shape, run, pf, ns, _ = build(["--preset", "gpt-oss-120b", "--seq-len", "1M", "--gpus", "16", "--hbm-gib", "80",
                                   "--host-gib", "1024"])
    rec = recommend(shape, run, pf, ns.megatron_namespace)
    assert not any(f in rec.flags for f in rec.layout_flags if f.startswith("--"))
    assert rec.layout_flags == layout_flags(run) and run.cp == 8 and run.ep == 16
    pl = M.plan(shape, run, pf)
    assert FLAGS_LABEL + " ".join([*rec.layout_flags, *rec.flags]) in render(pl, rec).splitlines()
    assert to_json(pl, rec)["recommended"]["layout_flags"] == rec.layout_flags


def test_the_runtime_report_plans_per_rank_tokens_and_the_attention_that_runs(monkeypatch):
    """``--peakflat-report-peaks``' prediction reads Megatron's args: each rank's tokens are s/CP, and 'auto'
    attention is planned as the SDPA core attention where that is what was patched in (its gathered K/V counted)."""
    from megatron_peakflat.integration import peaks, registry, state
    from megatron_peakflat.planner.megatron_args import parse_megatron_args

    ns, _ = parse_megatron_args("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention "
                                "--num-query-groups 2 --ffn-hidden-size 1024 --num-experts 8 --moe-router-topk 2 "
                                "--seq-length 32768 --context-parallel-size 4 --vocab-size 32000 --bf16 "
                                "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    ns.world_size, ns.data_parallel_size = 8, 2
    monkeypatch.setattr(state, "get", lambda: None)
    monkeypatch.setattr(peaks, "_megatron_fused_adam", lambda: False)  # (importing Megatron's optimizer is slow)
    got = {}
    for patched in (False, True):
        monkeypatch.setattr(registry, "applied",
                            lambda p=patched: ["megatron.core.models.backends.LocalSpecProvider.core_attention"] * p)
        peaks._cache.clear()
        pl, _ = peaks.prediction(ns)
        assert pl.run.cp == 4 and pl.run.tokens == 32768 / 4 and pl.run.dp == 2
        got[patched] = pl.stages[0].rows["tile"].peakflat
    shape = peaks.prediction(ns)[0].shape
    assert got[True] - got[False] == pytest.approx(M.cp_gathered_kv_backward(shape, peaks.prediction(ns)[0].run,
                                                                             _pf("sdpa")))
    assert got[True] > got[False]
    peaks._cache.clear()


def test_repeated_kv_heads_where_flash_does_not_run():
    """On the local spec in fp32 the SDPA attention repeats grouped K/V heads to the query heads (flash, the one
    CUDA kernel that takes them, takes no fp32): the gathered K/V under CP and their gradients count heads / kv_heads
    times, and the tiled sublayer adds the prefix's repeated K and V and their gradients. bf16, Transformer Engine's
    layers and a model without grouped heads count none."""
    from megatron_peakflat.tile.config import TileConfig

    shape = preset("gpt-oss-120b")  # 64 query heads over 8 K/V heads
    S, T = 2**20, 2**20 / 8
    fp32 = M.RunConfig(seq_len=S, cp=8, precision="fp32", transformer_impl="local")
    assert M.sdpa_repeats_kv(shape, fp32)
    for other in (dataclasses.replace(fp32, precision="bf16"), dataclasses.replace(fp32, transformer_impl="transformer_engine")):
        assert not M.sdpa_repeats_kv(shape, other)
    assert not M.sdpa_repeats_kv(dataclasses.replace(shape, kv_heads=shape.heads), fp32)
    per_token = 2 * shape.kv_heads * shape.head_dim * 4  # K and V, fp32
    assert M.cp_gathered_kv(shape, fp32, _pf("sdpa")) == (8 * S - T) * per_token
    assert M.cp_gathered_kv_backward(shape, fp32, _pf("sdpa")) == pytest.approx((S + S / 8) * per_token * 8)
    tiled = PeakflatConfig(tile=TileConfig(enabled=True))
    te = dataclasses.replace(fp32, transformer_impl="transformer_engine")
    tile = M.tile_tokens(te, tiled)
    te_split = 2 * S * shape.kv_heads * shape.head_dim * 4 + 2 * tile * shape.heads * shape.head_dim * 4
    repeated = M.tiled_attention_bytes(shape, fp32, tiled) - (
        M.tiled_attention_bytes(shape, te, tiled) - M.te_gqa_expansion(shape, te, tile) - te_split)
    assert repeated == 4 * S * shape.heads * shape.head_dim * 4


def test_repeated_kv_heads_at_cp_1():
    """At CP 1 on the local spec in fp32 the layer keeps the repeated K and V for backward, and its backward their
    gradients: (heads - kv_heads) x head_dim x 2 more elements per token in each; bf16 repeats none (below the
    per-K/V-head calls' threshold it keeps what Transformer Engine's layer does)."""
    shape = preset("gpt-oss-20b")
    fp32 = M.RunConfig(seq_len=2**16, precision="fp32", transformer_impl="local")
    te = dataclasses.replace(fp32, transformer_impl="transformer_engine")
    extra = 2**16 * 2 * (shape.heads - shape.kv_heads) * shape.head_dim * 4
    assert M.attention_activations(shape, fp32) - M.attention_activations(shape, te) == extra
    te_own = M.te_gqa_expansion(shape, te)  # cuDNN's expanded dK/dV, which the local spec's kernels do not hold
    assert te_own == 2 * 2**16 * shape.heads * shape.head_dim * 4
    assert M.attention_backward_transient(shape, fp32) - (M.attention_backward_transient(shape, te) - te_own) == extra
    bf16 = dataclasses.replace(fp32, precision="bf16", seq_len=GROUPED_CALL_MIN_KEYS // 2)
    assert M.flash_gqa_calls(shape, bf16) == 1
    assert M.attention_activations(shape, bf16) == M.attention_activations(
        shape, dataclasses.replace(bf16, transformer_impl="transformer_engine"))


@pytest.mark.parametrize("cp", [1, 2])
def test_flash_expands_grouped_dk_dv_per_call(cp):
    """flash attention's backward on grouped heads (the local spec in bf16) allocates dK and dV at the query heads'
    count over every key (FlashAttention-2 mha_bwd's dk_expanded, dv_expanded) beside its fp32 dQ accumulator: at
    long key lengths the SDPA attention runs one call per K/V head, so each holds one head group's worth, and the
    split then gathers the calls' dQ/dK/dV (attention/context_parallel.py _attend). Transformer Engine's layer and
    short sequences are one call; the terms below are what those allocate, element by element."""
    shape = preset("gpt-oss-20b")  # 64 query heads over 8 K/V heads of 64
    h, g, d, w = shape.heads, shape.kv_heads, shape.head_dim, 2
    long = M.RunConfig(seq_len=2**19, cp=cp, precision="bf16", transformer_impl="local")
    te = dataclasses.replace(long, transformer_impl="transformer_engine")
    keys, T = 2**19, 2**19 // cp
    assert M.flash_gqa_calls(shape, long) == g and M.flash_gqa_calls(shape, te) == 1
    assert M.flash_gqa_expansion(shape, long) == 2 * keys * (h // g) * d * w
    assert M.flash_gqa_expansion(shape, te) == 0
    q, kv = T * h * d, T * g * d
    one_call = q / g * 4 + 2 * keys * (h // g) * d * w  # one group's fp32 dQ accumulator and expanded dK/dV
    gathered = (q + 2 * kv) * w  # the split's concatenated dQ, dK, dV
    te_own = 2 * T * h * d * w  # cuDNN's dK/dV at the query heads over one ring step's keys (te_gqa_expansion)
    assert M.te_gqa_expansion(shape, te) == te_own
    assert M.attention_backward_transient(shape, long) - M.attention_backward_transient(shape, te) == \
        pytest.approx(max(one_call, gathered) - q * 4 - te_own)
    assert M.attention_activations(shape, long) - M.attention_activations(shape, te) == q * w
    short = dataclasses.replace(long, seq_len=GROUPED_CALL_MIN_KEYS // 2)
    assert M.flash_gqa_calls(shape, short) == 1
    assert M.flash_gqa_expansion(shape, short) == 2 * GROUPED_CALL_MIN_KEYS // 2 * h * d * w
    fp32 = dataclasses.replace(long, precision="fp32")  # repeated K/V heads: the memory-efficient kernel, no expansion
    assert M.flash_gqa_expansion(shape, fp32) == 0 and M.flash_gqa_calls(shape, fp32) == 1


def test_tile_counts_flash_expansion_over_the_prefix(monkeypatch):
    """The tiled sublayer's bound on the local spec in bf16 counts flash's expanded dK/dV of one call over the whole
    prefix, the split's gathered dK/dV of the prefix and dQ of a tile, and the tile's output once more (the calls'
    and their concatenation), in place of one call's expansion at every query head; on Transformer Engine's layers
    the sublayer splits its calls the same way (te_tile_calls), and the two count the same."""
    from megatron_peakflat.attention import calls
    from megatron_peakflat.tile.config import TileConfig

    shape = preset("gpt-oss-20b")
    h, g, d, w = shape.heads, shape.kv_heads, shape.head_dim, 2
    S = 2**20
    local = M.RunConfig(seq_len=S, precision="bf16", transformer_impl="local")
    te = dataclasses.replace(local, transformer_impl="transformer_engine")
    tiled = PeakflatConfig(tile=TileConfig(enabled=True))
    tile = M.tile_tokens(local, tiled)
    split = M.tiled_attention_bytes(shape, local, tiled)
    assert split == M.tiled_attention_bytes(shape, te, tiled)
    monkeypatch.setattr(calls, "GROUPED_CALL_MIN_KEYS", 1 << 62)  # one call of every head
    one_call = M.tiled_attention_bytes(shape, local, tiled)
    assert M.tiled_attention_bytes(shape, te, tiled) == one_call
    assert split - one_call == 2 * S * (h // g) * d * w + 2 * S * g * d * w + 2 * tile * h * d * w - 2 * S * h * d * w
