"""Flags parse, derive from the config dataclasses, and every bad value or combination fails early."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_peakflat import PeakflatConfig, PeakflatConfigError, add_args
from megatron_peakflat.config_base import field_docs, parse_count, parse_size
from megatron_peakflat.startup import config_from_args
from megatron_peakflat.dispatch.config import DispatchConfig


def parse(*argv: str) -> argparse.Namespace:
    return add_args(argparse.ArgumentParser()).parse_args(list(argv))


def megatron_args(**kw):
    base = dict(num_experts=8, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
                expert_tensor_parallel_size=1, mtp_num_layers=None, recompute_granularity="full",
                distribute_saved_activations=False, cpu_offloading=False, optimizer="adam",
                use_distributed_optimizer=True, optimizer_cpu_offload=True, use_precision_aware_optimizer=True,
                bf16=True)
    base.update(kw)
    return SimpleNamespace(**base)


def parse_with_megatron(*argv: str, **megatron) -> argparse.Namespace:
    """``parse(*argv)`` with ``megatron_args(**megatron)`` set on it: one namespace, as Megatron's parser
    hands peakflat's flags and its own together."""
    ns = parse(*argv)
    for k, v in vars(megatron_args(**megatron)).items():
        setattr(ns, k, v)
    return ns


def test_sizes_and_counts():
    assert parse_size("16GiB") == 16 * 2**30
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2e9") == 2_000_000_000
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_count("100M") == 100_000_000
    assert parse_count("2.5B") == 2_500_000_000
    assert parse_count("50k") == 50_000
    with pytest.raises(ValueError, match="unknown unit"):
        parse_size("3 parsecs")
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_defaults_change_nothing():
    cfg = PeakflatConfig.from_args(parse(), validate=False)
    assert cfg == PeakflatConfig()
    assert not any(cfg.enabled.values())


def test_flags_round_trip_into_config():
    ns = parse_with_megatron("--peakflat-dispatch", "pipelined-llep", "--peakflat-dispatch-chunk-cap", "4096",
                             "--peakflat-vocab", "ring-dtp", "--peakflat-vocab-schedule", "weights",
                             "--peakflat-sco", "--peakflat-sco-budget", "32GiB",
                             "--peakflat-optimizer", "offload-stream", "--peakflat-optimizer-bucket", "100M",
                             "--peakflat-attention", "sdpa", "--peakflat-report-peaks",
                             "--peakflat-tile", "--peakflat-tile-tokens", "8192")
    cfg = PeakflatConfig.from_args(ns)
    assert cfg.dispatch.impl == "pipelined-llep" and cfg.dispatch.chunk_cap == 4096
    assert cfg.vocab.impl == "ring-dtp" and cfg.vocab.schedule == "weights"
    assert cfg.sco.enabled and cfg.sco.budget == 32 * 2**30
    assert cfg.optimizer.impl == "offload-stream" and cfg.optimizer.bucket == 100_000_000
    assert cfg.general.attention == "sdpa" and cfg.general.report_peaks
    assert cfg.tile.enabled and cfg.tile.tokens == 8192
    assert all(cfg.enabled.values())


def test_every_field_has_a_flag_with_its_docstring():
    parser = add_args(argparse.ArgumentParser())
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    docs = field_docs(DispatchConfig)
    assert set(docs) >= {"impl", "chunk_cap", "alpha", "min_spill", "imbalance_threshold", "max_chunks"}
    assert "--peakflat-dispatch" in helps and "least-loaded" in helps["--peakflat-dispatch"]
    assert "--peakflat-dispatch-chunk-cap" in helps
    assert all(h for f, h in helps.items() if f.startswith("--peakflat"))


@pytest.mark.parametrize("argv, words", [
    (["--peakflat-sco-budget", "lots"], ["--peakflat-sco-budget", "'lots' is not a size", "16GiB"]),
    (["--peakflat-optimizer-bucket", "3 parsecs"], ["--peakflat-optimizer-bucket", "unknown unit"]),
    (["--peakflat-dispatch-chunk-cap", "big"], ["--peakflat-dispatch-chunk-cap", "'big' is not an integer"]),
    (["--peakflat-sco-budget", "1e400"], ["--peakflat-sco-budget", "'1e400' is not a finite size"]),
    (["--peakflat-optimizer-bucket", "1e400"], ["--peakflat-optimizer-bucket", "'1e400' is not a finite count"]),
    (["--peakflat-sco-budget", "1e300TiB"], ["--peakflat-sco-budget", "'1e300TiB' is not a finite size"]),
    (["--peakflat-optimizer-bucket", "0.3"], ["--peakflat-optimizer-bucket", "'0.3' rounds to 0", "100M"]),
    (["--peakflat-sco-budget", "0.5B"], ["--peakflat-sco-budget", "'0.5B' rounds to 0", "16GiB"]),
])
def test_unparsable_values_name_the_flag_and_the_expected_form(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_unknown_choice_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        parse("--peakflat-vocab", "magic")
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--peakflat-dispatch-chunk-cap", "0"], "--peakflat-dispatch-chunk-cap"),
        (["--peakflat-dispatch-alpha", "0.5"], "--peakflat-dispatch-alpha"),
        (["--peakflat-dispatch-max-chunks", "0"], "--peakflat-dispatch-max-chunks"),
        (["--peakflat-dispatch-imbalance-threshold", "0.9"], "--peakflat-dispatch-imbalance-threshold"),
        (["--peakflat-dispatch-alpha", "nan"], "--peakflat-dispatch-alpha"),
        (["--peakflat-dispatch-alpha", "inf"], "--peakflat-dispatch-alpha"),
        (["--peakflat-dispatch-imbalance-threshold", "nan"], "--peakflat-dispatch-imbalance-threshold"),
        (["--peakflat-dispatch-imbalance-threshold", "inf"], "--peakflat-dispatch-imbalance-threshold"),
        (["--peakflat-vocab-chunk-tokens", "-5"], "--peakflat-vocab-chunk-tokens"),
        (["--peakflat-dispatch-min-spill", "-1"], "--peakflat-dispatch-min-spill"),
        (["--peakflat-dispatch-overlap-min-chunks", "-1"], "--peakflat-dispatch-overlap-min-chunks"),
        (["--peakflat-dispatch-transport", "copy-engine", "--no-peakflat-dispatch-pack-collectives"],
         "--peakflat-dispatch-transport"),
        (["--peakflat-vocab-block-size", "4"], "--peakflat-vocab-block-size"),
        (["--peakflat-sco-prefetch", "-1"], "--peakflat-sco-prefetch"),
        (["--peakflat-optimizer-slots", "5"], "--peakflat-optimizer-slots"),
        (["--peakflat-optimizer-bucket", "0"], "--peakflat-optimizer-bucket"),
    ],
)
def test_bad_values_name_flag_value_and_fix(argv, flag):
    ns = parse(*argv)
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(ns, validate=False).validate()
    msg = str(e.value)
    assert e.value.flag == flag and msg.startswith(flag + "=")
    assert "Fix:" in msg and argv[1] in msg


def test_copy_engine_transport_refuses_an_ep_group_wider_than_a_host(monkeypatch):
    argv = ["--peakflat-dispatch", "pipelined-llep", "--peakflat-dispatch-transport", "copy-engine"]
    for lws, refused in (("1", True), ("2", False), ("", False)):  # EP=2; no LOCAL_WORLD_SIZE: checked at the first call
        monkeypatch.setenv("LOCAL_WORLD_SIZE", lws)
        ns = parse_with_megatron(*argv, disable_bias_linear=True, add_bias_linear=False)
        if refused:
            with pytest.raises(PeakflatConfigError) as e:
                PeakflatConfig.from_args(ns)
            assert e.value.flag == "--peakflat-dispatch-transport" and "--expert-model-parallel-size 2" in str(e.value)
        else:
            assert PeakflatConfig.from_args(ns).dispatch.transport == "copy-engine"


def test_an_sco_budget_of_one_boundary_or_auto_passes():
    """8 MiB is one boundary of 4096 x 1024 bf16; with sequence parallelism over TP=2 a boundary is half that."""
    for budget, megatron in (("8MiB", {}), (None, {}),
                             ("4MiB", dict(tensor_model_parallel_size=2, sequence_parallel=True))):
        ns = parse_with_megatron("--peakflat-sco", *(["--peakflat-sco-budget", budget] if budget else []),
                                 seq_length=4096, hidden_size=1024, **megatron)
        assert PeakflatConfig.from_args(ns).sco.enabled


@pytest.mark.parametrize(
    "argv, megatron, flag, words",
    [
        (["--peakflat-dispatch", "pipelined-llep"], dict(num_experts=None), "--peakflat-dispatch", "no MoE"),
        (["--peakflat-dispatch", "pipelined-llep"], dict(moe_token_dispatcher_type="allgather"), "--peakflat-dispatch", "alltoall"),
        (["--peakflat-dispatch", "pipelined-llep"], dict(expert_tensor_parallel_size=2), "--peakflat-dispatch", "expert tensor"),
        (["--peakflat-dispatch", "pipelined-llep"], dict(num_experts=6, expert_model_parallel_size=4), "--peakflat-dispatch", "divisible"),
        (["--peakflat-sco"], dict(recompute_granularity=None), "--peakflat-sco", "--recompute-granularity full"),
        (["--peakflat-sco"], dict(recompute_granularity="selective"), "--peakflat-sco", "--recompute-granularity full"),
        (["--peakflat-sco"], dict(distribute_saved_activations=True), "--peakflat-sco", "distribute-saved-activations"),
        (["--peakflat-sco"], dict(cpu_offloading=True), "--peakflat-sco", "cpu-offloading"),
        (["--peakflat-sco"], dict(fp8="hybrid"), "--peakflat-sco", "te_checkpoint"),
        (["--peakflat-sco"], dict(fp4="nvfp4"), "--peakflat-sco", "te_checkpoint"),
        (["--peakflat-sco", "--peakflat-sco-budget", "64"], dict(seq_length=4096, hidden_size=1024),
         "--peakflat-sco-budget", "smaller than one checkpoint boundary (8388608 bytes"),
        (["--peakflat-sco", "--peakflat-sco-budget", "4MiB"],  # TP without SP: each rank holds every token
         dict(seq_length=4096, hidden_size=1024, tensor_model_parallel_size=2, sequence_parallel=False),
         "--peakflat-sco-budget", "smaller than one checkpoint boundary (8388608 bytes"),
        (["--peakflat-attention", "sdpa"], dict(window_size=(64, 0)), "--peakflat-attention", "sliding-window"),
        (["--peakflat-attention", "sdpa"], dict(softmax_type="off-by-one"), "--peakflat-attention", "off-by-one"),
        (["--peakflat-vocab", "ring-dtp", "--peakflat-vocab-shard-over-ep"],
         dict(untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=2), "--peakflat-vocab-shard-over-ep",
         "--pipeline-model-parallel-size is 2"),
        (["--peakflat-vocab", "ring-dtp", "--peakflat-vocab-shard-over-ep"],
         dict(untie_embeddings_and_output_weights=True, tensor_model_parallel_size=2), "--peakflat-vocab-shard-over-ep",
         "--tensor-model-parallel-size is 2"),
        (["--peakflat-vocab", "ring-dtp", "--peakflat-vocab-shard-over-ep"],
         dict(untie_embeddings_and_output_weights=True, expert_tensor_parallel_size=2), "--peakflat-vocab-shard-over-ep",
         "--expert-tensor-parallel-size is 2"),
        (["--peakflat-optimizer", "offload-stream"], dict(optimizer="sgd"), "--peakflat-optimizer", "--optimizer adam"),
        (["--peakflat-optimizer", "offload-stream"], dict(decoupled_weight_decay=False), "--peakflat-optimizer",
         "drop --no-decoupled-weight-decay"),
        (["--peakflat-optimizer", "offload-stream"], dict(optimizer_offload_fraction=0.5), "--peakflat-optimizer",
         "--optimizer-offload-fraction is 0.5"),
        (["--peakflat-optimizer", "offload-stream"], dict(exp_avg_dtype="bf16"), "--peakflat-optimizer",
         "--exp-avg-dtype is bf16"),
        (["--peakflat-optimizer", "offload-stream"], dict(exp_avg_sq_dtype=torch.bfloat16), "--peakflat-optimizer",
         "--exp-avg-sq-dtype is torch.bfloat16"),
        (["--peakflat-optimizer", "offload-stream"], dict(main_params_dtype=torch.float16), "--peakflat-optimizer",
         "--main-params-dtype is torch.float16"),
        (["--peakflat-optimizer", "offload-stream"], dict(bf16=False, fp16=True), "--peakflat-optimizer",
         "add --accumulate-allreduce-grads-in-fp32"),
        (["--peakflat-optimizer", "offload-stream"], dict(use_distributed_optimizer=False), "--peakflat-optimizer", "--use-distributed-optimizer"),
        (["--peakflat-optimizer", "offload-stream"], dict(optimizer_cpu_offload=False), "--peakflat-optimizer", "--optimizer-cpu-offload"),
        (["--peakflat-optimizer", "offload-stream"], dict(use_precision_aware_optimizer=False), "--peakflat-optimizer", "--use-precision-aware-optimizer"),
    ],
)
def test_incompatible_combinations_fail_at_startup(argv, megatron, flag, words):
    ns = parse_with_megatron(*argv, **megatron)
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(ns)
    assert e.value.flag == flag
    assert words in str(e.value)


def test_offload_stream_takes_fp16_with_fp32_gradients_or_no_clipping_and_megatrons_fp32_defaults():
    """fp16 gradients fail only in Megatron's clipping: with --clip-grad 0 a CPU dry run (3 iterations) gave
    Megatron's own distributed optimizer's losses to 1e-6."""
    for megatron in (dict(bf16=False, fp16=True, accumulate_allreduce_grads_in_fp32=True),
                     dict(bf16=False, fp16=True, clip_grad=0.0),
                     dict(optimizer_offload_fraction=1.0, exp_avg_dtype=torch.float32, exp_avg_sq_dtype="fp32",
                          main_params_dtype=torch.float32)):
        ns = parse_with_megatron("--peakflat-optimizer", "offload-stream", **megatron)
        assert PeakflatConfig.from_args(ns).optimizer.impl == "offload-stream"


def test_gpu_only_choices_are_refused_where_no_gpu_is_seen(monkeypatch):
    from megatron_peakflat.config import check_devices

    on = parse("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-kernel", "triton",
               "--peakflat-dispatch", "pipelined-llep", "--peakflat-dispatch-transport", "copy-engine")
    cfg = PeakflatConfig.from_args(on, validate=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_devices(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PeakflatConfigError) as e:
        check_devices(cfg)
    assert e.value.flag == "--peakflat-vocab-kernel" and "pass auto" in e.value.fix
    cfg.vocab.kernel = "auto"
    with pytest.raises(PeakflatConfigError) as e:
        check_devices(cfg)
    assert e.value.flag == "--peakflat-dispatch-transport" and "nccl" in e.value.fix
    cfg.dispatch.transport = "auto"
    check_devices(cfg)
    check_devices(PeakflatConfig.from_args(parse("--peakflat-vocab-kernel", "triton",
                                                 "--peakflat-dispatch-transport", "copy-engine"), validate=False))


def test_parsed_flags_hold_only_builtin_values():
    """Megatron saves its args in every checkpoint, and --ckpt-format torch loads them with
    torch.load(weights_only=True), which refuses any class of ours: defaults and parsed sizes and counts
    are plain ints."""
    for argv in ([], ["--peakflat-sco-budget", "2GiB", "--peakflat-optimizer-bucket", "20M"]):
        ns = parse(*argv)
        values = {k: v for k, v in vars(ns).items() if k.startswith("peakflat_")}
        assert values["peakflat_optimizer_bucket"] in (50_000_000, 20_000_000)
        for k, v in values.items():
            assert type(v) in (int, float, str, bool, type(None)), (k, type(v))


@pytest.mark.parametrize("dest, flag", [("use_distributed_optimizer", "--use-distributed-optimizer"),
                                        ("optimizer_cpu_offload", "--optimizer-cpu-offload"),
                                        ("use_precision_aware_optimizer", "--use-precision-aware-optimizer")])
def test_offload_stream_names_exactly_the_missing_megatron_flag(dest, flag):
    ns = parse_with_megatron("--peakflat-optimizer", "offload-stream", **{dest: False})
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(ns)
    assert e.value.fix == f"add {flag}"


def test_megatron_offload_runs_in_half_precision_and_offload_stream_in_fp32(monkeypatch):
    """The fp32 refusal of Megatron's own offloaded optimizer (megatron-core 0.19) stops at fp32: with
    --bf16 or --fp16 Megatron's runs, and OffloadStreamAdamW runs fp32 too."""
    from megatron_peakflat.integration import compat

    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.19.2")
    for argv, megatron in [([], dict(bf16=True)), ([], dict(bf16=False, fp16=True)),
                           (["--peakflat-optimizer", "offload-stream"], dict(bf16=False))]:
        ns = parse_with_megatron(*argv, **megatron)
        cfg = config_from_args(ns)  # no refusal, and the optimizer asked for
        assert cfg.optimizer.impl == ("offload-stream" if argv else "megatron"), (argv, megatron)


def test_the_fp32_refusal_stops_at_the_last_megatron_core_checked(monkeypatch):
    """Only megatron-core releases up to 0.19.2, where the failure was seen, are refused; later ones carry
    Megatron-LM's fix (PR 6982) or their own error."""
    from megatron_peakflat.integration import compat

    ns = parse_with_megatron(bf16=False)
    for version, refused in [("0.19.2", True), ("0.17.0", True), ("0.19.3", False), ("0.20.0", False),
                             (None, False)]:
        monkeypatch.setattr(compat, "megatron_core_version", lambda v=version: v)
        if refused:
            with pytest.raises(PeakflatConfigError) as e:
                config_from_args(ns)
            assert e.value.flag == "--optimizer-cpu-offload" and "non-leaf" in e.value.problem
            assert e.value.fix == "add --bf16, or add --peakflat-optimizer offload-stream (which runs fp32 parameters)"
        else:
            config_from_args(ns)


def test_mtp_under_full_recompute_is_refused_where_megatron_core_cannot_run_it(monkeypatch):
    """megatron-core 0.18.2's MTP layer raises a TypeError at the first step under full recompute (its forward
    passes padding_mask to _checkpointed_forward); 0.19 runs it. Refused at start-up, naming the fix."""
    from megatron_peakflat.integration import compat

    ns = parse_with_megatron(mtp_num_layers=1, recompute_granularity="full")
    for version, refused in [("0.18.2", True), ("0.19.0", False), ("0.19.2", False), (None, False)]:
        monkeypatch.setattr(compat, "megatron_core_version", lambda v=version: v)
        if refused:
            with pytest.raises(PeakflatConfigError) as e:
                config_from_args(ns)
            assert e.value.flag == "--mtp-num-layers" and "padding_mask" in e.value.problem
            assert e.value.fix.startswith("install megatron-core 0.19"), e.value.fix
        else:
            config_from_args(ns)
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.18.2")
    config_from_args(parse_with_megatron(mtp_num_layers=1, recompute_granularity="selective"))


def test_deterministic_mode_pins_the_optimizer_engine():
    """engine='auto' splits buckets between two kernels by measured speed (not bit-for-bit repeatable);
    Megatron's --deterministic-mode resolves it to 'gpu' at start-up, and an explicit choice stays."""
    ns = parse_with_megatron("--peakflat-optimizer", "offload-stream", deterministic_mode=True)
    assert PeakflatConfig.from_args(ns).optimizer.engine == "gpu"
    ns.peakflat_optimizer_engine = "cpu"
    assert PeakflatConfig.from_args(ns).optimizer.engine == "cpu"
    ns.deterministic_mode, ns.peakflat_optimizer_engine = False, "auto"
    assert PeakflatConfig.from_args(ns).optimizer.engine == "auto"


def test_flags_doc_table_is_the_generated_one():
    """docs/flags.md's table is what ``python -m megatron_peakflat.config`` prints from the config dataclasses:
    every row, word for word, so a default or help changed in code cannot leave the docs behind."""
    from pathlib import Path

    from megatron_peakflat.config import flags_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "flags.md").read_text()
    rows = [line for line in flags_markdown().splitlines() if line.startswith("| `--")]
    assert len(rows) >= 30
    missing = [row[:100] for row in rows if row not in doc.splitlines()]
    assert not missing, missing


def test_sizes_round_to_the_nearest_unit_and_each_suffix_means_its_documented_scale():
    """2.01M is 2009999.9999999998 in floating point: it parses to 2010000, not one less. Decimal suffixes
    (KB, MB, TB; counts k, M, G, T) are powers of ten, the binary ones (KiB, TiB) powers of two."""
    assert parse_count("2.01M") == 2_010_000 and parse_size("2.01MB") == 2_010_000
    assert parse_size("4KB") == 4000 and parse_size("4KiB") == 4096
    assert parse_size("1TB") == 10**12 and parse_size("1TiB") == 2**40
    assert parse_count("1T") == 10**12 and parse_count("3G") == 3 * 10**9


def test_format_bytes_switches_unit_exactly_at_each_power_of_two():
    """The size shown in messages (e.g. the dataloader mask's) uses the largest unit it reaches: 1 GiB is
    '1.00 GiB', not '1024.00 MiB'."""
    from megatron_peakflat.config_base import format_bytes

    assert format_bytes(2**30) == "1.00 GiB" and format_bytes(2**30 - 2**20) == "1023.00 MiB"
    assert format_bytes(1024) == "1.00 KiB" and format_bytes(1023) == "1023 B"


def test_auto_is_taken_only_by_fields_chosen_at_start_up(capsys):
    """'auto' or 'none' (any case) leaves an optional field to start-up; a field without an automatic choice
    refuses the word as an argument error naming the flag."""
    ns = parse("--peakflat-sco-budget", "auto", "--peakflat-dispatch-chunk-cap", "AUTO", "--peakflat-optimizer-host-threads",
               "none")
    assert ns.peakflat_sco_budget is None and ns.peakflat_dispatch_chunk_cap is None
    assert ns.peakflat_optimizer_host_threads is None
    for flag, words in (("--peakflat-optimizer-bucket", "'auto' is not a count"),
                        ("--peakflat-dispatch-max-chunks", "'auto' is not an integer")):
        with pytest.raises(SystemExit):
            parse(flag, "auto")
        err = capsys.readouterr().err
        assert flag in err and words in err, err


@pytest.mark.parametrize("granularity, fix", [
    (None, "add --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
    ("selective", "pass --recompute-granularity full in place of 'selective', with --recompute-method uniform "
                  "--recompute-num-layers 1"),
])
def test_sco_without_full_recompute_gives_the_fix_for_what_was_passed(granularity, fix):
    """No --recompute-granularity: the fix adds it; another granularity: the fix names the one to replace."""
    ns = parse_with_megatron("--peakflat-sco", recompute_granularity=granularity)
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(ns)
    assert e.value.flag == "--peakflat-sco" and e.value.fix == fix


def test_sdpa_refusals_apply_only_where_sdpa_was_asked_for():
    """Sliding-window attention and other softmax types are refused with --peakflat-attention sdpa only: under
    'auto' or 'local' the SDPA core attention hands such layers back to Megatron, so start-up accepts them."""
    for extra in (dict(window_size=(64, 0)), dict(softmax_type="off-by-one")):
        for mode in ("auto", "local", "sdpa"):
            ns = parse_with_megatron("--peakflat-attention", mode, **extra)
            if mode == "sdpa":
                with pytest.raises(PeakflatConfigError) as e:
                    PeakflatConfig.from_args(ns)
                assert e.value.flag == "--peakflat-attention"
            else:
                assert PeakflatConfig.from_args(ns).general.attention == mode


@pytest.mark.parametrize("megatron, fix", [
    (dict(add_bias_linear=True), "pass --disable-bias-linear"),
    (dict(fp8="hybrid"), "drop --fp8-format"),
    (dict(fp4="nvfp4"), "drop --fp4-format"),
    (dict(moe_router_padding_for_quantization=True), "drop --moe-router-padding-for-quantization"),
    (dict(delay_wgrad_compute=True), "drop --delay-wgrad-compute"),
    (dict(overlap_dispatch_backward_with_experts_wgrad=True), "drop --overlap-dispatch-backward-with-experts-wgrad"),
    (dict(moe_latent_size=64), "drop --moe-latent-size"),
    (dict(enable_cuda_graph=True), "drop --enable-cuda-graph"),
    (dict(use_te_activation_func=True), "drop --use-te-activation-func"),
    (dict(use_transformer_engine_op_fuser=True), "drop --use-transformer-engine-op-fuser"),
    (dict(moe_single_grouped_weight=True), "drop --moe-single-grouped-weight"),
    (dict(moe_single_grouped_bias=True), "drop --moe-single-grouped-bias"),
    (dict(moe_mlp_glu_interleave_size=2), "drop --moe-mlp-glu-interleave-size"),
    (dict(cuda_graph_impl="transformer_engine"), "drop --cuda-graph-impl"),
    (dict(transformer_impl="inference_optimized"), "use --transformer-impl transformer_engine or local"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]),
     "drop expert_fc1 from --offload-modules"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["moe_act"]), "drop moe_act from --offload-modules"),
])
def test_every_megatron_flag_pipelinedllep_would_hand_back_is_refused_naming_its_fix(megatron, fix):
    """Each Megatron flag whose MoE layers PipelinedLLEP would silently leave to Megatron's dispatcher fails at
    start-up; the fix names that Megatron flag, or dropping --peakflat-dispatch."""
    ns = parse_with_megatron("--peakflat-dispatch", "pipelined-llep", **megatron)
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(ns)
    assert e.value.flag == "--peakflat-dispatch" and e.value.fix == f"{fix}, or drop --peakflat-dispatch"


@pytest.mark.parametrize("megatron, boundary", [
    (dict(context_parallel_size=2), 4 * 2**20),  # each CP rank holds half the sequence
    (dict(micro_batch_size=2), 16 * 2**20),
    (dict(bf16=False, fp16=True), 8 * 2**20),  # two bytes per element, as bf16
    (dict(bf16=False, optimizer_cpu_offload=False), 16 * 2**20),  # fp32: four
])
def test_sco_budget_boundary_follows_context_parallelism_micro_batch_and_precision(megatron, boundary):
    """One checkpoint boundary of 4096 x 1024 is 8 MiB in bf16; a budget of exactly one boundary passes and one
    byte less is refused, naming the boundary's size."""
    for budget, ok in ((boundary, True), (boundary - 1, False)):
        ns = parse_with_megatron("--peakflat-sco", "--peakflat-sco-budget", str(budget), seq_length=4096,
                                 hidden_size=1024, **megatron)
        if ok:
            assert PeakflatConfig.from_args(ns).sco.budget == budget
        else:
            with pytest.raises(PeakflatConfigError) as e:
                PeakflatConfig.from_args(ns)
            assert e.value.flag == "--peakflat-sco-budget" and f"({boundary} bytes" in str(e.value)


def test_a_sub_flag_of_a_component_left_off_is_named_with_its_fix(caplog):
    """A sub-flag away from its default while its component is off changes nothing: one warning each at start-up,
    naming the flag, its value and the switch that turns the component on (Literal modes with their 'on'
    value, SCO's boolean switch bare). Defaults, and the same sub-flags with their component on, say nothing."""
    caplog.set_level("WARNING", logger="megatron_peakflat")
    PeakflatConfig.from_args(parse_with_megatron("--peakflat-vocab-schedule", "weights", "--peakflat-sco-budget", "8GiB",
                                                 "--peakflat-dispatch-chunk-cap", "4096"))
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [
        "peakflat: --peakflat-dispatch-chunk-cap=4096 has no effect: --peakflat-dispatch is 'megatron', so the "
        "component is off. Fix: add --peakflat-dispatch pipelined-llep, or drop --peakflat-dispatch-chunk-cap",
        "peakflat: --peakflat-vocab-schedule=weights has no effect: --peakflat-vocab is 'megatron', so the component "
        "is off. Fix: add --peakflat-vocab ring-dtp, or drop --peakflat-vocab-schedule",
        "peakflat: --peakflat-sco-budget=8.00 GiB has no effect: --peakflat-sco is not set, so the component is off. "
        "Fix: add --peakflat-sco, or drop --peakflat-sco-budget",
    ]
    caplog.clear()
    PeakflatConfig.from_args(parse_with_megatron())
    PeakflatConfig.from_args(parse_with_megatron("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-schedule", "weights"))
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]


def test_flags_doc_is_the_one_the_flags_generate():
    """docs/flags.md is ``python -m megatron_peakflat.config``'s output, whole: a flag, default or help text
    changed in the dataclasses without regenerating the file fails here. The README links it."""
    from pathlib import Path

    from megatron_peakflat.config import flags_document

    root = Path(__file__).resolve().parents[1]
    doc = flags_document()
    assert doc.count("\n| `--peakflat-") >= 20
    assert (root / "docs" / "flags.md").read_text() == doc, \
        "docs/flags.md is stale: regenerate it with `python -m megatron_peakflat.config > docs/flags.md`"
    assert "docs/flags.md" in (root / "README.md").read_text()


@pytest.mark.parametrize("argv, megatron, flag, problem, fix", [
    (["--peakflat-sco"], dict(enable_cuda_graph=True), "--peakflat-sco", "--enable-cuda-graph captures",
     "drop --enable-cuda-graph, or drop --peakflat-sco"),
    (["--peakflat-sco"], dict(cuda_graph_impl="local"), "--peakflat-sco", "--cuda-graph-impl local captures",
     "drop --cuda-graph-impl, or drop --peakflat-sco"),
    (["--peakflat-optimizer", "offload-stream"], dict(optimizer_cuda_graph=True), "--peakflat-optimizer",
     "--optimizer-cuda-graph records the optimizer step", "drop --optimizer-cuda-graph, or drop --peakflat-optimizer"),
    (["--peakflat-attention", "sdpa"], dict(transformer_impl="transformer_engine"), "--peakflat-attention",
     "--transformer-impl transformer_engine builds Transformer Engine's layers", "pass --transformer-impl local"),
    (["--peakflat-dispatch", "pipelined-llep"], dict(moe_layer_freq=[0, 0]), "--peakflat-dispatch",
     "--moe-layer-freq [0, 0] makes every layer dense", "put a 1 in --moe-layer-freq"),
])
def test_combinations_that_would_only_fail_or_do_nothing_later_are_refused(argv, megatron, flag, problem, fix):
    """Each is refused at start-up naming its flag and fix; the same flags without the Megatron one pass."""
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(parse_with_megatron(*argv, **megatron))
    assert e.value.flag == flag and problem in e.value.problem and e.value.fix.startswith(fix), str(e.value)
    PeakflatConfig.from_args(parse_with_megatron(*argv))


def test_a_sub_flag_another_sub_flag_makes_useless_is_named_with_its_fix(caplog):
    """With the component on, --peakflat-vocab-chunk-tokens under --peakflat-vocab-grad recompute and
    --peakflat-optimizer-host-threads under --peakflat-optimizer-engine gpu change nothing: one warning each, naming the
    flag, its value and the fix. With the sub-flags that use them, nothing is said."""
    caplog.set_level("WARNING", logger="megatron_peakflat")
    PeakflatConfig.from_args(parse_with_megatron("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-grad", "recompute",
                                                 "--peakflat-vocab-chunk-tokens", "4096",
                                                 "--peakflat-optimizer", "offload-stream", "--peakflat-optimizer-engine",
                                                 "gpu", "--peakflat-optimizer-host-threads", "8"))
    notes = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(notes) == 2, notes
    assert notes[0].startswith("peakflat: --peakflat-vocab-chunk-tokens=4096 has no effect: --peakflat-vocab-grad "
                               "recompute") and "Fix: drop --peakflat-vocab-chunk-tokens" in notes[0]
    assert notes[1].startswith("peakflat: --peakflat-optimizer-host-threads=8 has no effect: --peakflat-optimizer-engine gpu") \
        and "Fix: drop --peakflat-optimizer-host-threads" in notes[1]
    caplog.clear()
    PeakflatConfig.from_args(parse_with_megatron("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-grad", "in-forward",
                                                 "--peakflat-vocab-chunk-tokens", "4096",
                                                 "--peakflat-optimizer", "offload-stream", "--peakflat-optimizer-engine",
                                                 "cpu", "--peakflat-optimizer-host-threads", "8"))
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]


@pytest.mark.parametrize("argv, value", [
    (["--peakflat-sco"], True), (["--no-peakflat-sco"], False), (["--peakflat-sco=false"], False),
    (["--peakflat-sco", "yes"], True), (["--peakflat-sco=0"], False), (["--peakflat-sco", "--peakflat-sco-budget", "8GiB"], True),
])
def test_an_on_off_flag_reads_a_value_that_says_on_or_off(argv, value):
    assert parse(*argv).peakflat_sco_enabled is value


@pytest.mark.parametrize("argv, message", [
    (["--peakflat-report-peaks", "maybe"], "'maybe' is not on or off. Fix: pass --peakflat-report-peaks alone to turn "
                                           "it on, or --no-peakflat-report-peaks to turn it off"),
    (["--no-peakflat-sco=true"], "--no-peakflat-sco takes no value ('true'). Fix: pass --no-peakflat-sco alone"),
])
def test_an_on_off_flag_refuses_any_other_value_by_name(argv, message, capsys):
    """argparse alone would say "unrecognized arguments" or "ignored explicit argument", without the fix."""
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--peakflat-sco-budget", "-1GiB"], "argument --peakflat-sco-budget: '-1GiB' is not a size"),
    (["--peakflat-optimizer-bucket", "-5M"], "argument --peakflat-optimizer-bucket: "),
])
def test_a_value_starting_with_a_dash_meets_the_flags_own_check(argv, message, capsys, monkeypatch):
    """Through Megatron's own parse_args: argparse alone reads '-1GiB' as a flag and says only "expected one
    argument"; peakflat's flags take it as they take '--peakflat-sco-budget=-1GiB', and their check names it."""
    from megatron.training.arguments import parse_args

    from megatron_peakflat.cli.pretrain import extra_args_provider

    monkeypatch.setattr("sys.argv", ["pretrain", *argv])
    with pytest.raises(SystemExit):
        parse_args(extra_args_provider)
    err = capsys.readouterr().err
    assert message in err and argv[1] in err and "expected one argument" not in err, err


def test_a_negative_number_reaches_the_config_check_and_other_flags_keep_argparses_rules(capsys, monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron_peakflat.cli.pretrain import extra_args_provider

    monkeypatch.setattr("sys.argv", ["pretrain", "--peakflat-dispatch-alpha", "-1e3", "--lr", "1e-4"])
    args = parse_args(extra_args_provider)
    assert args.peakflat_dispatch_alpha == -1000.0 and args.lr == 1e-4
    with pytest.raises(PeakflatConfigError, match=r"--peakflat-dispatch-alpha=-1000.0: .* Fix: "):
        PeakflatConfig.from_args(args)
    # a flag's missing value is still missing: the next word names a flag
    monkeypatch.setattr("sys.argv", ["pretrain", "--peakflat-sco-budget", "--bf16"])
    with pytest.raises(SystemExit):
        parse_args(extra_args_provider)
    assert "argument --peakflat-sco-budget: expected one argument" in capsys.readouterr().err


def test_vocab_schedule_names_what_runs():
    """'gather' is the in-forward gradients' schedule of collectives; 'activations' and 'weights' are rings whose
    gradients are computed in backward. A pair that cannot run together is refused at start-up, naming the value
    to pass; the pairs that can (and the ring with --peakflat-vocab-grad auto) pass."""
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(parse_with_megatron("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-schedule",
                                                     "activations", "--peakflat-vocab-grad", "in-forward"))
    assert e.value.flag == "--peakflat-vocab-schedule" and e.value.value == "activations"
    assert "--peakflat-vocab-schedule gather" in e.value.fix and "--peakflat-vocab-grad recompute" in e.value.fix
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(parse_with_megatron("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-schedule",
                                                     "gather", "--peakflat-vocab-grad", "recompute"))
    assert e.value.value == "gather" and "--peakflat-vocab-grad in-forward" in e.value.fix
    for schedule, grad in (("gather", "in-forward"), ("gather", "auto"), ("weights", "recompute"), ("weights", "auto"),
                           ("auto", "in-forward"), ("auto", "recompute")):
        cfg = PeakflatConfig.from_args(parse_with_megatron("--peakflat-vocab", "ring-dtp", "--peakflat-vocab-schedule",
                                                           schedule, "--peakflat-vocab-grad", grad))
        assert (cfg.vocab.schedule, cfg.vocab.grad) == (schedule, grad)


OLD_OPTIMIZER_FLAGS = (("--peakflat-opt-bucket", "20M"), ("--peakflat-opt-engine", "cpu"),
                       ("--peakflat-opt-slots", "2"), ("--peakflat-opt-host-threads", "4"))
"""The optimizer's knobs as they were spelt before they took its name (``OptimizerConfig.FORMER_PREFIXES``)."""


@pytest.fixture
def fresh_deprecations(monkeypatch):
    """A process in which no former spelling has been warned about yet (the warnings are once per process)."""
    from megatron_peakflat import config_base

    monkeypatch.setattr(config_base, "_warned_former", set())
    monkeypatch.delenv("RANK", raising=False)


def test_a_former_spelling_gives_the_config_of_the_current_one_and_one_warning_per_flag(caplog, fresh_deprecations):
    """--peakflat-opt-* (the optimizer's knobs before they were --peakflat-optimizer-*) parse into the same config
    as the current spelling; each old flag logs one warning per process, naming the flag to write instead, however
    often it is parsed. The current spelling logs nothing."""
    caplog.set_level("WARNING", logger="megatron_peakflat")
    new = [w.replace("--peakflat-opt-", "--peakflat-optimizer-") for pair in OLD_OPTIMIZER_FLAGS for w in pair]
    current = PeakflatConfig.from_args(parse_with_megatron("--peakflat-optimizer", "offload-stream", *new))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert (current.optimizer.bucket, current.optimizer.engine, current.optimizer.slots,
            current.optimizer.host_threads) == (20_000_000, "cpu", 2, 4)
    old = [w for pair in OLD_OPTIMIZER_FLAGS for w in pair]
    for _ in range(2):
        assert PeakflatConfig.from_args(parse_with_megatron("--peakflat-optimizer", "offload-stream", *old)) == current
    said = [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(said) == len(OLD_OPTIMIZER_FLAGS), [r.getMessage() for r in said]
    for (flag, _), record in zip(sorted(OLD_OPTIMIZER_FLAGS), sorted(said, key=lambda r: r.getMessage())):
        now = flag.replace("--peakflat-opt-", "--peakflat-optimizer-")
        assert record.name == "megatron_peakflat" and record.levelname == "WARNING"
        assert record.getMessage() == (f"peakflat: {flag} is deprecated: it is now spelt {now}, and the old spelling "
                                       f"will be removed. Fix: write {now}")


def test_a_former_spelling_warns_from_rank_0_only(caplog, fresh_deprecations, monkeypatch):
    caplog.set_level("WARNING", logger="megatron_peakflat")
    monkeypatch.setenv("RANK", "1")
    assert parse("--peakflat-opt-bucket", "20M").peakflat_optimizer_bucket == 20_000_000
    assert not caplog.records


def test_a_former_spelling_is_hidden_from_help_and_the_flags_doc_and_checks_its_value(capsys, fresh_deprecations):
    from megatron_peakflat.config import current_spelling, flags_markdown

    parser = add_args(argparse.ArgumentParser())
    assert "--peakflat-opt-" not in parser.format_help() and "--peakflat-optimizer-bucket" in parser.format_help()
    assert "--peakflat-opt-" not in flags_markdown()
    with pytest.raises(SystemExit):
        parse("--peakflat-opt-bucket", "3 parsecs")
    assert "argument --peakflat-opt-bucket: " in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a value that starts with '-' meets the flag's own check, as the current one's
        parse("--peakflat-opt-bucket", "-5M")
    assert "argument --peakflat-opt-bucket: '-5M' is not a count" in capsys.readouterr().err
    assert parse("--peakflat-opt-bucket", "1M", "--peakflat-optimizer-bucket", "7M").peakflat_optimizer_bucket == 7_000_000
    assert current_spelling("--peakflat-opt-host-threads") == "--peakflat-optimizer-host-threads"
    assert current_spelling("--peakflat-optimizer-slots") == "--peakflat-optimizer-slots"
    assert current_spelling("--peakflat-sco-budget") == "--peakflat-sco-budget"
