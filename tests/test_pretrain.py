"""``python -m megatron_peakflat.pretrain``: help lists both flag sets, bad peakflat input fails before
the model is built, and a short run (CPU dry run through Megatron's own pretrain loop) trains with
peakflat on to the same losses as with it off. The entry point needs megatron-core >= 0.19: on 0.18.2
these tests skip, and the patches' own tests run there."""

import re

import pytest

from megatron_peakflat.testing.subproc import MODEL_BUILT, TINY_GPT_ARGS, logged, run_module, second_resumed_log
from tests.conftest import needs_pretrain_entry

TINY = [*TINY_GPT_ARGS, "--train-iters", "3"]
pytestmark = needs_pretrain_entry
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
run = run_module


def test_help_lists_megatron_and_peakflat_flags():
    out = run("megatron_peakflat.pretrain", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--num-experts", "--recompute-granularity", "--peakflat-dispatch", "--peakflat-vocab",
                 "--peakflat-sco", "--peakflat-optimizer", "--peakflat-optimizer-bucket", "--peakflat-attention"):
        assert flag in out.stdout, flag


def test_without_a_gpu_the_entry_point_stops_first_naming_what_runs_on_cpu():
    """Megatron asserts CUDA deep in its start-up, with a traceback per rank: the entry says it at once."""
    import subprocess
    import sys

    from megatron_peakflat.testing.subproc import ROOT, child_env

    out = subprocess.run([sys.executable, "-m", "megatron_peakflat.pretrain", *TINY], capture_output=True, text=True,
                         env=child_env(CUDA_VISIBLE_DEVICES=""), cwd=ROOT, timeout=300)  # no GPU, here or on a GPU host
    assert out.returncode == 1, out.stderr[-2000:]
    assert "needs CUDA GPUs, and this process sees none" in out.stderr and "peakflat-check" in out.stderr
    assert "Traceback" not in out.stderr and MODEL_BUILT not in out.stdout + out.stderr


def test_an_older_megatron_without_the_config_builders_stops_the_entry_point_naming_the_fix(monkeypatch):
    # megatron-core 0.18.2's pretrain() takes a model_provider that only Megatron-LM's pretrain_gpt.py has.
    import megatron.training.argument_utils as argument_utils

    from megatron_peakflat.cli import pretrain

    assert pretrain._config_builders()[0] is argument_utils.gpt_config_from_args
    monkeypatch.delattr(argument_utils, "gpt_config_from_args")
    with pytest.raises(SystemExit) as e:
        pretrain._config_builders()
    msg = str(e.value)
    assert "megatron-core >= 0.19" in msg and "megatron-core>=0.19,<0.20" in msg and "megatron_peakflat.apply(args)" in msg


def test_bad_combination_fails_before_the_model_is_built():
    out = run("megatron_peakflat.testing.pretrain_dryrun", *TINY, "--peakflat-sco")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "--peakflat-sco=True" in text and "--recompute-granularity full" in text
    assert MODEL_BUILT not in text
    assert not re.search(r"iteration +1/", text)


def test_a_gpu_only_choice_in_a_cpu_dry_run_fails_before_the_model_is_built():
    """A command line checked on a machine without a GPU: the Triton vocab kernel is refused at start-up,
    naming the flag and 'auto', instead of at the first forward."""
    out = run("megatron_peakflat.testing.pretrain_dryrun", *TINY, "--peakflat-vocab", "ring-dtp",
              "--peakflat-vocab-kernel", "triton")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "--peakflat-vocab-kernel='triton'" in text and "pass auto" in text, text[-3000:]
    assert MODEL_BUILT not in text and not re.search(r"iteration +1/", text)


def test_dataloader_mask_at_long_context_fails_before_the_model_is_built():
    """At 64K tokens Megatron's default [s, s] dataloader mask (4 GiB per sample) is refused at start-up,
    naming the flag and the fix, instead of the loader's workers being killed for host memory minutes in."""
    long = ["--seq-length", "65536", "--max-position-embeddings", "65536"]
    out = run("megatron_peakflat.testing.pretrain_dryrun", *TINY, *long, "--peakflat-vocab", "ring-dtp")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "--create-attention-mask-in-dataloader=True" in text and "--no-create-attention-mask-in-dataloader" in text
    assert MODEL_BUILT not in text and not re.search(r"iteration +1/", text)


def _losses(text: str) -> list[float]:
    return logged(text, "lm loss")


def _grad_norms(text: str) -> list[float]:
    return logged(text, "grad norm")


def _off_then_on(args: list[str], on: list[str], nproc: int = 1) -> tuple[str, str]:
    """Megatron's log of a dry run with ``args`` (peakflat off), then with ``on`` added; both must succeed."""
    off = run("megatron_peakflat.testing.pretrain_dryrun", *args, nproc=nproc)
    assert off.returncode == 0, (off.stdout + off.stderr)[-3000:]
    ran = run("megatron_peakflat.testing.pretrain_dryrun", *args, *on, nproc=nproc)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    return off.stdout + off.stderr, ran.stdout + ran.stderr


def _same_training(off: str, on: str) -> None:
    """The three logged losses equal to 1e-5 and the grad norms to 1e-4."""
    base = _losses(off)
    assert len(base) == 3 and len(_grad_norms(off)) == 3
    assert _losses(on) == pytest.approx(base, rel=1e-5)
    assert _grad_norms(on) == pytest.approx(_grad_norms(off), rel=1e-4)


@pytest.mark.parametrize("untie", [False, True])
def test_short_run_same_loss_with_peakflat_on(untie):
    """Ring-DTP adds dW into the output layer's main_grad (tied: the embedding's gradient joins it there
    through DDP's hook) and computes the gradients with the loss (in-forward) for the gradient Megatron's
    loss gives (2 microbatches: loss_mask over the token count over 2), which backward finds right (no
    recompute). Same losses and grad norms as peakflat off."""
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    off, text = _off_then_on([*TINY, *RECOMPUTE, *extra], ["--peakflat-sco", "--peakflat-vocab", "ring-dtp"])
    patched = next(ln for ln in text.splitlines() if "peakflat: patched " in ln)
    assert "recompute.checkpointed_forward" in patched and "GPTModel.forward" in patched, patched
    assert "weight gradient goes straight into DDP's main_grad" in text
    assert ("the tied embedding's gradient joins it there" in text) == (not untie)
    assert "computed with the loss (in-forward" in text
    assert "was not the loss's real gradient" not in text
    assert MODEL_BUILT in off and MODEL_BUILT in text  # what the start-up refusals above assert is absent
    _same_training(off, text)


RESUME = [*TINY, *RECOMPUTE, "--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0"]
PEAKFLAT_ON = ["--peakflat-sco", "--peakflat-vocab", "ring-dtp", "--peakflat-dispatch", "pipelined-llep"]


def _save_and_resume(tmp: str, *extra: str, base: list[str] = RESUME) -> list[float]:
    """Losses of a run of ``base + extra`` resumed from its own checkpoint saved at iteration 3."""
    saved = run("megatron_peakflat.testing.pretrain_dryrun", *base, *extra, "--save", tmp, "--save-interval", "3",
                "--exit-interval", "3")
    assert saved.returncode == 0 and "successfully saved checkpoint" in saved.stdout + saved.stderr, \
        (saved.stdout + saved.stderr)[-3000:]
    resumed = run("megatron_peakflat.testing.pretrain_dryrun", *base, *extra, "--load", tmp)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    return _losses(resumed.stdout + resumed.stderr)


def test_checkpoint_resume_with_peakflat_continues_as_megatron_does(tmp_path):
    """Megatron's distributed checkpoint (model, optimizer, scheduler, data position) saved at iteration 3
    and loaded: with peakflat on, the resumed iterations are Megatron's own resumed iterations (to fp32
    summation order, 1e-5), and the first and last equal the uninterrupted run's exactly."""
    straight = run("megatron_peakflat.testing.pretrain_dryrun", *RESUME, *PEAKFLAT_ON)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    full = _losses(straight.stdout + straight.stderr)
    # the log says what the dispatch schedule chose (one group of one rank here: nothing to overlap)
    assert re.search(r"peakflat dispatch: first MoE layer call: \d+ tokens here, K=\d+ chunks of at most \d+ rows, "
                     r"all-to-all overlap off", straight.stdout + straight.stderr)
    ours = _save_and_resume(str(tmp_path / "on"), *PEAKFLAT_ON)
    theirs = _save_and_resume(str(tmp_path / "off"))
    assert len(full) == 6 and len(ours) == 3
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours[-1] == full[-1] and ours[0] == full[3]
    assert ours[1] == pytest.approx(second_resumed_log(full, 3), abs=2e-6)


def test_pipeline_and_expert_parallel_same_loss_with_dispatch_on():
    """PipelinedLLEP under Megatron's pipeline schedule (PP=2, 1F1B over two stages) with EP=2 inside each
    stage, full recompute, 4 gloo ranks: expert weights spill to the other EP rank (lambda 1.0, m 0, no hosting
    limit: at this tiny shape 'auto' would keep every expert home), eight
    chunks overlap their all-to-alls, and the collectives of both stages' microbatches interleave without a
    deadlock. Same losses and grad norms as Megatron's own dispatcher."""
    args = [*TINY, *RECOMPUTE, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
            "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]
    off, text = _off_then_on(args, ["--peakflat-dispatch", "pipelined-llep", "--peakflat-dispatch-chunk-cap", "16",
                                    "--peakflat-dispatch-imbalance-threshold", "1.0",
                                    "--peakflat-dispatch-min-spill", "0",
                                    "--peakflat-dispatch-max-foreign-experts", "2"], nproc=4)
    spilled = [int(n) for n in re.findall(r"first MoE layer call: .*, (\d+) experts spilled so far", text)]
    assert spilled and max(spilled) > 0, spilled
    assert re.search(r"K=8 chunks .* all-to-all overlap on", text)
    _same_training(off, text)


@pytest.mark.parametrize("untie", [False, True])
def test_pipeline_parallel_same_loss_with_vocab_and_sco_on(untie):
    """Ring-DTP on the last of two pipeline stages (tied: the output weight is the last stage's copy of the
    embedding, which Megatron keeps in sync through the embedding group) and SCO on both, 2 gloo ranks:
    same losses and grad norms as peakflat off."""
    args = [*TINY, *RECOMPUTE, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
            *(["--untie-embeddings-and-output-weights"] if untie else [])]
    off, text = _off_then_on(args, ["--peakflat-vocab", "ring-dtp", "--peakflat-sco"], nproc=2)
    assert "peakflat vocab: Ring-DTP loss" in text and "boundaries packed" in text
    _same_training(off, text)


def test_mtp_layer_on_the_last_pipeline_stage_same_loss_with_every_component_on():
    """An MTP layer (a MoE layer, as the model's last) on the last of two pipeline stages, EP=2 in each stage,
    full recompute, tied embeddings, 4 gloo ranks: the batch reaches the MTP layer's stage, Ring-DTP computes
    the main and the MTP loss without logits, PipelinedLLEP dispatches the MTP layer's experts too, and SCO
    keeps the boundaries. Megatron's losses, grad norms and logged MTP loss equal peakflat off (the
    acceptance counts go to TensorBoard only; their unit test is test_vocab_megatron.py's). The MTP layer's
    checkpoint ends after its final norm, so the fused recompute's check finds the assumed gradient wrong
    there, corrects it exactly and turns fusion off for that layer, and says so."""
    args = [*TINY, *RECOMPUTE, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
            "--global-batch-size", "8", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    off, text = _off_then_on(args, ["--peakflat-vocab", "ring-dtp", "--peakflat-dispatch", "pipelined-llep",
                                    "--peakflat-dispatch-chunk-cap", "16", "--peakflat-sco"], nproc=4)
    assert "peakflat vocab: the 1 MTP layer loss(es) through Ring-DTP too" in text, text[-3000:]
    assert "fused recompute off for a MoE layer: its output gradient differed from the checkpoint's (corrected exactly)" in text
    _same_training(off, text)
    theirs = logged(off, "mtp_1 loss")
    assert len(theirs) == 3, off[-3000:]
    assert logged(text, "mtp_1 loss") == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize("fused_adam", [False, True], ids=["torch-adam", "te-or-apex-installed"])
def test_checkpoint_resume_with_offloaded_optimizer_continues_as_megatron_does(tmp_path, monkeypatch, fused_adam):
    """OffloadStreamAdamW inside Megatron's DistributedOptimizer (CPU offload, precision-aware), saved at
    iteration 3 and loaded: Adam's step count, masters and moments survive Megatron's two-move load, so
    the resumed iterations are Megatron's own resumed iterations (its plain Adam here: megatron-core
    0.19.2's CPU offload fails on fp32 parameters, ``config._check_megatron_offload_fp32``) and every one
    equals the uninterrupted run's (the second as Megatron logs it, ``subproc.second_resumed_log``).
    Before the fix the resumed step count restarted at 1 and iterations 5 and 6 drifted by ~1%.

    ``te-or-apex-installed``: Megatron's checkpoint branch for installs with TE's or apex's FusedAdam
    (``PEAKFLAT_DRYRUN_FUSED_ADAM``), where the step travels only in the param groups and the per-parameter
    state handed to the load is the optimizer's own from before it (step 0). The H200 with TE built found
    the resumed step restarting there; compared with the uninterrupted run only (Megatron's plain Adam is
    not what such installs run)."""
    opt = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
           "--peakflat-optimizer", "offload-stream"]
    if fused_adam:
        monkeypatch.setenv("PEAKFLAT_DRYRUN_FUSED_ADAM", "1")
    straight = run("megatron_peakflat.testing.pretrain_dryrun", *RESUME, *opt)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    full = _losses(straight.stdout + straight.stderr)
    ours = _save_and_resume(str(tmp_path / "on"), *opt)
    assert len(full) == 6 and len(ours) == 3
    if not fused_adam:
        theirs = _save_and_resume(str(tmp_path / "off"))
        assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours[-1] == pytest.approx(full[-1], rel=1e-6) and ours[0] == pytest.approx(full[3], rel=1e-6)
    assert ours[1] == pytest.approx(second_resumed_log(full, 3), abs=2e-6)


def test_checkpoint_resume_in_megatrons_legacy_torch_format(tmp_path):
    """--ckpt-format torch loads with torch.load(weights_only=True), which refuses any class it does not know
    in the saved args or optimizer state (Megatron then exits with status 0 and trains nothing). With every
    component on, the run resumes and its first and last resumed iterations equal the uninterrupted run's.
    The optimizer's replacement line is logged once per optimizer, not once per build."""
    on = [*PEAKFLAT_ON, "--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
          "--peakflat-optimizer", "offload-stream", "--ckpt-format", "torch"]
    straight = run("megatron_peakflat.testing.pretrain_dryrun", *RESUME, *on)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    # DistributedOptimizer builds each optimizer twice (dense and experts, over the group then the shard): one line
    # per rank; what each optimizer keeps is logged at its first step
    lines = (straight.stdout + straight.stderr).splitlines()
    built = [line for line in lines if "replaces HybridDeviceOptimizer" in line]
    assert built and len(built) == len(set(built)), built
    assert any("peakflat optimizer: OffloadStreamAdamW holds" in line for line in lines), lines[-40:]
    full = _losses(straight.stdout + straight.stderr)
    ours = _save_and_resume(str(tmp_path / "torch"), *on)
    assert len(full) == 6 and len(ours) == 3, ours
    assert ours[0] == pytest.approx(full[3], rel=1e-6) and ours[-1] == pytest.approx(full[-1], rel=1e-6)


def test_checkpoint_resume_with_dropout_matches_megatrons_resume(tmp_path):
    """With dropout (0.1 hidden and attention), each resumed iteration draws its masks from the RNG state
    Megatron's checkpoint restored: with SCO, Ring-DTP and PipelinedLLEP on (the fused recompute turns
    itself off under dropout), the resumed losses are Megatron's own resumed losses (to fp32 summation
    order). On this CPU shim Megatron's own resume does not redraw the uninterrupted run's masks, so the
    comparison is with its resume, not with the straight run."""
    dropout = [*TINY, *RECOMPUTE, "--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    ours = _save_and_resume(str(tmp_path / "on"), *PEAKFLAT_ON, base=dropout)
    theirs = _save_and_resume(str(tmp_path / "off"), base=dropout)
    assert len(ours) == 3
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_defaults_added_without_transformer_engine_never_override_a_flag_the_user_passed(monkeypatch):
    """Without Transformer Engine the entry point adds --transformer-impl local, --no-rope-fusion and
    --no-persist-layer-norm; a flag the user passed, in either spelling (``--flag value`` or ``--flag=value``,
    ``--rope-fusion`` or ``--no-rope-fusion``), is left as given and nothing is appended for it."""
    from megatron_peakflat.cli import pretrain

    monkeypatch.setattr(pretrain, "transformer_engine_available", lambda: False)
    assert pretrain._default_argv([])[:4] == ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm"]
    given = ["--transformer-impl=transformer_engine", "--rope-fusion", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion"]
    assert pretrain._default_argv(given) == given


def test_each_component_logs_what_it_chose_and_nothing_that_did_not_apply():
    """Dispatch and vocab on, no recompute, Megatron's default hidden dropout: Ring-DTP says once what it chose for
    its 'auto' and 0 flags and the largest block of logits it held (64 tokens x 256 rows x 4 bytes here, not a
    chunk planned larger than the tokens), never 'block=0 rows'; and with no recompute to fuse, PipelinedLLEP
    logs no 'fused recompute off' (the dropout is no reason for anything here)."""
    out = run("megatron_peakflat.testing.pretrain_dryrun", *TINY, "--peakflat-dispatch", "pipelined-llep",
              "--peakflat-vocab", "ring-dtp")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "Ring-DTP loss (schedule=auto, block=auto, kernel=auto)" in text and "block=0 rows" not in text
    assert ("peakflat vocab: first loss call: 64 tokens here, one rank, schedule single, kernel torch, dX and dW "
            "computed with the loss in 1 chunk(s); largest block of logits 64.00 KiB") in text, text[-3000:]
    assert text.count("peakflat vocab: first loss call") == 1
    # which schedule ran and why, once
    assert text.count("peakflat vocab: schedule single: one rank holds the whole vocabulary, nothing is exchanged") == 1
    assert "fused recompute off" not in text
