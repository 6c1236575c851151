"""What a user meets first with the planner, peakflat-check and --peakflat auto: the figures follow the training
line (its tokenizer, its implementation), flags beside a preset keep the preset's settings, the exit status is
the same with and without auto, and every line the tools print says what it is."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_peakflat.planner.build import build


def _run(argv: list[str]):
    shape, run, pf, ns, _ = build(argv)
    return shape, run


@pytest.mark.parametrize("override, field, value", [
    ("--num-layers 4", "layers", 4),
    ("--num-experts 64", "experts", 64),
    ("--hidden-size 2048 --num-attention-heads 32", "hidden", 2048),
])
def test_a_model_flag_beside_a_preset_keeps_the_presets_other_settings(override, field, value):
    base = ["--preset", "gpt-oss-20b", "--seq-len", "32K", "--gpus", "8", "--hbm-gib", "80", "--host-gib", "2048"]
    shape0, run0 = _run(base)
    shape, run = _run(base + ["--megatron-args", override])
    assert getattr(shape, field) == value
    assert dataclasses.replace(run, fused_adam=run0.fused_adam) == run0  # precision, recompute, optimizer, batches
    assert run.precision == "bf16" and run.recompute == "full" and run.distributed_optimizer


GPT_OSS_20B = ("--num-layers 24 --hidden-size 2880 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
               "--kv-channels 64 --ffn-hidden-size 2880 --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880 "
               "--swiglu --untie-embeddings-and-output-weights --bf16 --use-distributed-optimizer "
               "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --seq-length 131072")


def _hf_tokenizer(tmp_path, vocab: int, added: int) -> str:
    """A Hugging Face tokenizer directory with a tokenizer.json of ``vocab`` BPE tokens and ``added`` more."""
    import json

    doc = {"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(vocab)}, "merges": []},
           "added_tokens": [{"id": vocab + i, "content": f"<|s{i}|>", "special": True} for i in range(added)]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    return str(tmp_path)


def test_the_vocabulary_is_read_from_a_hugging_face_tokenizers_files(tmp_path):
    path = _hf_tokenizer(tmp_path, 200_000, 1_088)
    line = f"{GPT_OSS_20B} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {path}"
    shape, _ = _run(["--megatron-args", line, "--gpus", "8"])
    assert shape.vocab == 201_088
    # --vocab-size stands in only where the tokenizer's own files are not readable: Megatron ignores it here
    shape, _ = _run(["--megatron-args", line + " --vocab-size 1000", "--gpus", "8"])
    assert shape.vocab == 201_088


def test_a_gpt2_vocab_file_gives_its_vocabulary(tmp_path):
    import json

    (tmp_path / "vocab.json").write_text(json.dumps({f"t{i}": i for i in range(32_000)}))
    line = f"{GPT_OSS_20B} --tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path / 'vocab.json'}"
    assert _run(["--megatron-args", line, "--gpus", "8"])[0].vocab == 32_000


@pytest.mark.parametrize("tokenizer", ["--tokenizer-type HuggingFaceTokenizer --tokenizer-model /no/such/tokenizer",
                                       "--tokenizer-type SentencePieceTokenizer --tokenizer-model /no/such.model",
                                       "--tokenizer-type NullTokenizer"])
def test_a_tokenizer_whose_vocabulary_is_unknown_is_refused_naming_vocab_size(tokenizer, capsys):
    from megatron_peakflat.cli.plan import main

    argv = ["--megatron-args", f"{GPT_OSS_20B} {tokenizer}", "--gpus", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--tokenizer-type" in err and "pass --vocab-size" in err, err
    argv[1] += " --vocab-size 201088"  # the fix it names
    assert main(argv) in (0, 3)
    assert "201088" in str(_run(argv)[0].vocab)


def test_with_the_vocabulary_known_the_vocab_term_is_the_tokenizers(tmp_path):
    """gpt-oss-20b at 128K: Megatron's cross-entropy holds T x V x 6 B; the 50304 the planner took before was a
    quarter of the 201088 of the tokenizer."""
    from megatron_peakflat.planner.model import GIB, plan

    path = _hf_tokenizer(tmp_path, 200_000, 1_088)
    shape, run, pf, _, _ = build(["--megatron-args", f"{GPT_OSS_20B} --tokenizer-type HuggingFaceTokenizer "
                                  f"--tokenizer-model {path}", "--gpus", "8"])
    vocab = plan(shape, run, pf).stages[0].rows["vocab"].baseline / GIB
    assert vocab == pytest.approx(131072 * 201088 * 6 / GIB)


def test_auto_and_check_refuse_an_unknown_vocabulary_naming_vocab_size(capsys):
    from megatron_peakflat import auto
    from megatron_peakflat.cli import check
    from megatron_peakflat.config_base import PeakflatConfigError

    line = (GPT_OSS_20B + " --tokenizer-type HuggingFaceTokenizer --tokenizer-model /no/such/tokenizer "
            "--moe-token-dispatcher-type alltoall --disable-bias-linear --max-position-embeddings 131072 "
            "--lr 1e-4 --train-iters 10 --no-create-attention-mask-in-dataloader --expert-model-parallel-size 8 "
            "--micro-batch-size 1").split()
    with pytest.raises(PeakflatConfigError, match="--vocab-size"):
        auto.resolve(line + ["--peakflat", "auto"], gpus=8, gpus_per_node=8, hbm_bytes=80 * 2**30,
                     host_bytes_per_node=2048 * 2**30)
    assert check.main([*line, "--gpus", "8", "--hbm-gib", "80", "--host-gib", "2048"]) == check.REFUSED
    assert "pass --vocab-size" in capsys.readouterr().err


CHECK_MODEL = ("--num-layers 24 --hidden-size 2880 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
               "--kv-channels 64 --ffn-hidden-size 2880 --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880 "
               "--swiglu --vocab-size 201088 --untie-embeddings-and-output-weights --micro-batch-size 1 "
               "--global-batch-size 1 --bf16 --moe-token-dispatcher-type alltoall --disable-bias-linear "
               "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
               "--recompute-num-layers 1 --seq-length 8192 --max-position-embeddings 8192 --lr 1e-4 --train-iters 10 "
               "--no-create-attention-mask-in-dataloader").split()


def test_nothing_fits_exits_3_with_and_without_auto(capsys):
    from megatron_peakflat import auto
    from megatron_peakflat.cli import check

    small = ["--gpus", "1", "--gpus-per-node", "1", "--hbm-gib", "16", "--host-gib", "64"]
    assert check.main([*CHECK_MODEL, "--peakflat-dispatch", "pipelined-llep", *small]) == check.DOES_NOT_FIT == 3
    assert check.main([*CHECK_MODEL, "--peakflat", "auto", *small]) == 3
    assert "nothing fits" in capsys.readouterr().err
    with pytest.raises(auto.NothingFits):
        auto.resolve([*CHECK_MODEL, "--peakflat", "auto"], gpus=1, gpus_per_node=1, hbm_bytes=16 * 2**30,
                     host_bytes_per_node=64 * 2**30)


def test_pretraining_exits_3_where_auto_finds_nothing_that_fits(monkeypatch, capsys):
    from megatron_peakflat import auto
    from megatron_peakflat.cli import pretrain

    def nothing(argv):
        raise auto.NothingFits("--peakflat", "auto", "nothing fits in this command line's layout", "more GPUs")

    monkeypatch.setattr(pretrain, "_check_gpus", lambda: None)
    monkeypatch.setattr(pretrain.megatron_peakflat, "auto_argv", nothing)
    with pytest.raises(SystemExit) as e:
        pretrain.main([*CHECK_MODEL, "--peakflat", "auto"])
    assert e.value.code == 3
    assert "nothing fits" in capsys.readouterr().err


def test_under_fp16_an_offloaded_optimizer_is_recommended_with_fp32_gradients_and_the_line_passes_the_check():
    """Megatron's gradient clipping refuses fp16 gradients from an offloaded optimizer, and peakflat's start-up says
    so: under --fp16 the recommendation adds --accumulate-allreduce-grads-in-fp32 and plans fp32 gradients, so
    that the line it completes passes peakflat-check (it recommended the offload alone, which the check refused)."""
    import shlex

    from megatron_peakflat.cli import check
    from megatron_peakflat.planner.recommend import recommend

    line = ("--num-layers 16 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
            "--num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 6400 --ffn-hidden-size 6400 --vocab-size 32064 "
            "--untie-embeddings-and-output-weights --normalization LayerNorm --mock-data --tokenizer-type NullTokenizer "
            "--hidden-dropout 0 --attention-dropout 0 --disable-bias-linear --moe-token-dispatcher-type alltoall "
            "--use-distributed-optimizer --position-embedding-type rope --swiglu --fp16 --seq-length 32768 "
            "--max-position-embeddings 32768 --micro-batch-size 1 --expert-model-parallel-size 4 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    machine = ["--gpus", "4", "--hbm-gib", "80", "--host-gib", "2048"]
    shape, run, pf, ns, _ = build(["--megatron-args", line, *machine, "--layout", "given"])
    rec = recommend(shape, run, pf, ns.megatron_namespace)
    assert rec.fits and rec.config.optimizer.impl == "offload-stream"
    assert "--accumulate-allreduce-grads-in-fp32" in rec.flags and rec.plan.run.grads_fp32
    assert check.main([*shlex.split(line), *rec.layout_flags, *rec.flags, *machine]) == 0
    assert check.main([*shlex.split(line), *rec.layout_flags,
                       *[f for f in rec.flags if f != "--accumulate-allreduce-grads-in-fp32"], *machine]) == check.REFUSED


NEMO = ("--num-layers 40 --hidden-size 5120 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
        "--kv-channels 128 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope "
        "--disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 131072 --bf16 "
        "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
        "--hidden-dropout 0 --attention-dropout 0 --no-create-attention-mask-in-dataloader --lr 1e-4 --train-iters 10 "
        "--mock-data --tokenizer-type NullTokenizer --tensor-model-parallel-size 4 --sequence-parallel "
        "--max-position-embeddings 1048576")


def test_the_check_plans_what_megatron_validated_and_speaks_the_lines_words(capsys):
    """--encoder-seq-length is the sequence length where --seq-length is absent (Megatron's validate_args), so the
    check plans that length (it planned 4,096 and said 'fits'); a planner error names the line's flag, not the
    planner's (--tp); a flag Megatron's bare assert needs is named as the fix."""
    from megatron_peakflat.cli import check

    machine = ["--gpus", "64", "--hbm-gib", "80", "--host-gib", "2048"]
    long = [*NEMO.split(), "--micro-batch-size", "1", "--context-parallel-size", "4"]
    enc = check.main([*long, "--encoder-seq-length", "1048576", *machine])
    out = capsys.readouterr().out
    assert "seq 1,048,576" in out
    assert enc == check.main([*long, "--seq-length", "1048576", *machine]) == check.DOES_NOT_FIT
    capsys.readouterr()
    assert check.main([*NEMO.split(), "--micro-batch-size", "1", "--seq-length", "4096", "--num-query-groups", "3",
                       *machine]) == check.REFUSED
    err = capsys.readouterr().err
    assert "--tensor-model-parallel-size=4" in err and "--tp" not in err.replace("--tp-", "")
    assert check.main([*NEMO.split(), "--seq-length", "4096", *machine]) == check.REFUSED
    assert "Fix: pass --micro-batch-size" in capsys.readouterr().err


def test_auto_reads_a_line_of_one_flag_as_the_line():
    """A line that is a single flag reaches the planner as the line (it was read as a planner flag, and argparse
    exited the caller); it is refused for naming no model, as any line without one."""
    from megatron_peakflat.auto import resolve
    from megatron_peakflat.config_base import PeakflatConfigError

    with pytest.raises(PeakflatConfigError, match="names no --hidden-size"):
        resolve(["--bf16", "--peakflat", "auto"], gpus=8, gpus_per_node=8, hbm_bytes=80 * 2**30,
                host_bytes_per_node=2**40)


def test_a_flag_that_changes_memory_and_is_not_modelled_is_named_so(capsys):
    """Megatron flags that change memory but that the planner does not model are named with what the plan assumes,
    by the planner and the check, not listed as flags 'taken as not changing memory'; a flag at the value planned
    is not named."""
    from megatron_peakflat.cli import check
    from megatron_peakflat.cli.plan import main

    extra = " --optimizer muon --use-megatron-fsdp --num-distributed-optimizer-instances 2"
    line = NEMO + " --micro-batch-size 1 --seq-length 8192" + extra
    main(["--megatron-args", line, "--gpus", "8"])
    out = capsys.readouterr().out
    warned = [ln for ln in out.splitlines() if ln.startswith("warning: not modelled, ")]
    assert [w.split(",", 1)[1].split(":")[0].strip() for w in warned] == [
        "--optimizer muon", "--use-megatron-fsdp", "--num-distributed-optimizer-instances 2"]
    unread = next(ln for ln in out.splitlines() if "taken as not changing memory" in ln)
    assert "--optimizer" not in unread and "--use-megatron-fsdp" not in unread and "--num-distributed" not in unread
    # Megatron refuses its FSDP beside muon: the check takes a line it accepts
    check.main([*(NEMO + " --micro-batch-size 1 --seq-length 8192 --optimizer muon").split(), "--gpus", "8",
                "--hbm-gib", "80", "--host-gib", "2048"])
    assert [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: not modelled, ")] == [
        warned[0]]
    main(["--megatron-args", NEMO + " --micro-batch-size 1 --seq-length 8192 --optimizer sgd --exp-avg-dtype bf16",
          "--gpus", "8"])
    assert "not modelled" not in capsys.readouterr().out  # SGD and the state dtypes are planned (below)


@pytest.mark.parametrize("extra, per_param", [
    ("", 4 + 4 + 4),  # Adam: fp32 master weights and two fp32 moments
    ("--optimizer sgd", 4 + 4),  # SGD: master weights and an fp32 momentum buffer
    ("--optimizer sgd --sgd-momentum 0", 4),
    ("--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype fp8 --main-params-dtype fp16", 2 + 2 + 1),
    ("--exp-avg-dtype bf16", 4 + 4 + 4),  # Megatron reads the state dtypes only with the precision-aware optimizer
])
def test_the_optimizer_state_is_the_one_the_line_asks_for(extra, per_param):
    """Megatron's optimizer state per parameter, from the line: SGD's momentum buffer, and under
    --use-precision-aware-optimizer the dtypes of Adam's moments and of the master weights."""
    from megatron_peakflat.planner.model import plan

    line = NEMO + " --micro-batch-size 1 --seq-length 8192 " + extra
    adam = plan(*build(["--megatron-args", NEMO + " --micro-batch-size 1 --seq-length 8192", "--gpus", "8"])[:3])
    shape, run, pf, _, _ = build(["--megatron-args", line, "--gpus", "8"])
    got = plan(shape, run, pf).stages[0].rows["optimizer"].baseline
    assert got == pytest.approx(adam.stages[0].rows["optimizer"].baseline * per_param / 12)


@pytest.mark.parametrize("extra, named", [
    ("--optimizer sgd", "pass --optimizer adam"),
    ("--use-precision-aware-optimizer --exp-avg-dtype bf16", "drop --exp-avg-dtype"),
])
def test_offloadstreamadamw_is_never_recommended_where_its_start_up_refuses_the_line(extra, named):
    """A line with another optimizer or other Adam state dtypes: start-up refuses OffloadStreamAdamW there, so
    neither the 'peakflat' column nor a recommendation turns it on, and the reason names the fix."""
    from megatron_peakflat.planner.recommend import blockers, recommend

    line = NEMO + " --micro-batch-size 1 --seq-length 65536 " + extra
    shape, run, pf, ns, _ = build(["--megatron-args", line, "--gpus", "4", "--hbm-gib", "40", "--host-gib", "2048"])
    assert named in blockers(shape, run, ns.megatron_namespace)["optimizer"] and pf.optimizer.impl == "megatron"
    rec = recommend(shape, run, pf, ns.megatron_namespace)
    assert rec.config.optimizer.impl == "megatron" and "--peakflat-optimizer" not in rec.flags
    assert any(r.startswith("OffloadStreamAdamW left off") and named in r for r in rec.reasons), rec.reasons
    plain = NEMO + " --micro-batch-size 1 --seq-length 65536"
    shape, run, pf, ns, _ = build(["--megatron-args", plain, "--gpus", "4", "--hbm-gib", "40", "--host-gib", "2048"])
    assert "optimizer" not in blockers(shape, run, ns.megatron_namespace) and pf.optimizer.impl == "offload-stream"


def test_the_seq_len_override_speaks_the_lines_length_flag_and_both_flags_are_refused(capsys):
    """A line that gives its length as --encoder-seq-length gets the planned length in that flag (Megatron refuses
    --seq-length beside it, so the completed line failed the check), and a line with both is refused as Megatron
    refuses it."""
    from megatron_peakflat.cli.plan import main

    line = NEMO + " --micro-batch-size 1 --encoder-seq-length 16384"
    main(["--megatron-args", line, "--gpus", "4", "--layout", "given", "--seq-len", "32768"])
    add = next(ln for ln in capsys.readouterr().out.splitlines() if "flags to add:" in ln)
    assert "--encoder-seq-length 32768" in add and "--seq-length" not in add
    assert main(["--megatron-args", line + " --seq-length 16384", "--gpus", "4"]) == 2
    assert "--encoder-seq-length=16384: is given with --seq-length 16384" in capsys.readouterr().err


def test_under_fp16_the_peakflat_column_plans_the_fp32_gradients_its_optimizer_needs():
    """The 'every component' column runs OffloadStreamAdamW, which under --fp16 runs only with fp32 gradients: its
    gradients row is planned at 4 bytes per parameter there (it read the fp16 buffer, 34.9 against 44.5 GiB)."""
    from megatron_peakflat.planner.model import plan

    line = NEMO.replace("--bf16", "--fp16") + " --micro-batch-size 1 --seq-length 16384"
    shape, run, pf, _, _ = build(["--megatron-args", line, "--gpus", "4"])
    rows = plan(shape, run, pf).stages[0].rows["gradients"]
    assert pf.optimizer.impl == "offload-stream" and rows.peakflat == 2 * rows.baseline
    shape, run, pf, _, _ = build(["--megatron-args", line + " --clip-grad 0", "--gpus", "4"])
    rows = plan(shape, run, pf).stages[0].rows["gradients"]
    assert rows.peakflat == rows.baseline


def test_auto_leaves_a_user_set_optimizer_to_the_user_under_fp16_too(capsys):
    """A user who sets --peakflat-optimizer keeps its Megatron flags as given, the fp32 gradients it needs under
    --fp16 among them: with auto the line is refused as without it, not completed."""
    from megatron_peakflat.cli import check

    line = [*NEMO.replace("--bf16", "--fp16").split(), "--micro-batch-size", "1", "--seq-length", "16384",
            "--peakflat-optimizer", "offload-stream", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
    machine = ["--gpus", "4", "--hbm-gib", "80", "--host-gib", "2048"]
    assert check.main([*line, *machine]) == check.REFUSED
    assert check.main([*line, *machine, "--peakflat", "auto"]) == check.REFUSED
    assert "--accumulate-allreduce-grads-in-fp32" in capsys.readouterr().err
