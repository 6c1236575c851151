"""examples/pretrain_moe.sh builds the Megatron command line its environment asks for (read back with the
launcher replaced by ``echo``, so no GPU is needed): peakflat's flags only when on, one per component,
the example's long-context defaults, and the user's flags last, so that they win."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from megatron_peakflat.testing.subproc import ROOT, logged, run_module
from tests.conftest import needs_pretrain_entry

SCRIPT = os.path.join(ROOT, "examples", "pretrain_moe.sh")


def command(**env: str) -> list[str]:
    """The launcher's argv the script would exec, for this environment."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PEAKFLAT", "SLURM", "MEGATRON_ARGS"))}
    full.update(GPUS_PER_NODE="2", PYTHON="echo")
    full.update(env)
    extra = shlex.split(full.pop("ARGV", ""))
    out = subprocess.run(["bash", SCRIPT, *extra], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout.splitlines()[-1])


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_off_passes_no_peakflat_flag():
    argv = command(PEAKFLAT="off")
    assert argv[:2] == ["-m", "torch.distributed.run"] and value(argv, "--nproc-per-node") == "2"
    assert "megatron_peakflat.pretrain" in argv
    assert not [a for a in argv if a.startswith("--peakflat")]
    assert "--optimizer-cpu-offload" not in argv
    assert "--no-create-attention-mask-in-dataloader" in argv
    assert value(argv, "--expert-model-parallel-size") == "2" and value(argv, "--seq-length") == "4096"


def test_auto_is_the_default_and_passes_the_one_flag():
    for argv in (command(), command(PEAKFLAT="auto")):
        assert value(argv, "--peakflat") == "auto" and "--peakflat-report-peaks" in argv
        assert not [a for a in argv if a.startswith("--peakflat-") and a != "--peakflat-report-peaks"], argv
        assert "--optimizer-cpu-offload" not in argv  # auto adds what the plan needs at start-up


def test_short_runs_warm_up_for_fewer_iterations_than_they_train():
    assert value(command(), "--lr-warmup-iters") == "2"
    assert value(command(TRAIN_ITERS="2"), "--lr-warmup-iters") == "1"
    assert value(command(TRAIN_ITERS="1"), "--lr-warmup-iters") == "0"


def test_on_passes_each_component_and_the_flags_it_needs():
    argv = command(PEAKFLAT="on", CHUNK_CAP="65536")
    assert value(argv, "--peakflat-dispatch") == "pipelined-llep"
    assert value(argv, "--peakflat-dispatch-chunk-cap") == "65536"
    assert value(argv, "--peakflat-vocab") == "ring-dtp"
    assert value(argv, "--peakflat-optimizer") == "offload-stream"
    for flag in ("--peakflat-sco", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                 "--use-distributed-optimizer", "--peakflat-report-peaks"):
        assert flag in argv, flag
    assert "--peakflat-vocab-shard-over-ep" not in argv
    only = command(PEAKFLAT="on", PEAKFLAT_COMPONENTS="dispatch,vocab-ep")
    assert "--peakflat-vocab-shard-over-ep" in only and "--peakflat-sco" not in only
    assert "--peakflat-optimizer" not in only


def test_tensor_parallelism_keeps_the_experts_whole_off_and_on():
    """TP=2: Megatron would give the experts TP=2 too (its --expert-tensor-parallel-size default), which
    PipelinedLLEP refuses at start-up; the script passes 1, with sequence parallelism, whether peakflat is on or off."""
    for peakflat in ("on", "off"):
        argv = command(PEAKFLAT=peakflat, TP="2", GPUS_PER_NODE="4")
        assert value(argv, "--tensor-model-parallel-size") == "2" and "--sequence-parallel" in argv
        assert value(argv, "--expert-tensor-parallel-size") == "1", argv
    assert "--expert-tensor-parallel-size" not in command(PEAKFLAT="on")  # TP=1: Megatron's default is already 1


def test_grouped_experts_follow_transformer_engine(tmp_path):
    """TE's grouped experts when TE imports (auto), Megatron's SequentialMLP otherwise; either can be forced."""
    assert "--moe-grouped-gemm" in command(PEAKFLAT="off", GROUPED_GEMM="1")
    assert "--moe-grouped-gemm" not in command(PEAKFLAT="on", GROUPED_GEMM="0")
    for te, grouped in [(True, True), (False, False)]:
        python = tmp_path / f"python-te-{te}"  # answers the script's TE probe, echoes the launch
        python.write_text('#!/usr/bin/env bash\nif [[ "$1" == -c ]]; then exit %d; fi\necho "$@"\n' % (0 if te else 1))
        python.chmod(0o755)
        argv = command(PEAKFLAT="off", PYTHON=str(python))
        assert ("--moe-grouped-gemm" in argv) == grouped


def test_user_flags_come_last_so_that_they_win():
    argv = command(PEAKFLAT="off", MEGATRON_ARGS="--optimizer-cpu-offload --use-precision-aware-optimizer",
                   ARGV="--save /ckpt --seq-length 8192")
    tail = argv[-6:]
    assert tail == ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--save", "/ckpt",
                    "--seq-length", "8192"], argv
    sizes = dict(SEQ_LEN="131072", EXPERTS="64", NUM_LAYERS="2")
    argv = command(PEAKFLAT="off", **sizes)
    assert value(argv, "--seq-length") == value(argv, "--max-position-embeddings") == "131072"
    assert value(argv, "--num-experts") == "64" and value(argv, "--num-layers") == "2"


@pytest.mark.parametrize("bad, words", [(dict(PEAKFLAT="maybe"), "PEAKFLAT must be auto, on or off"),
                                        (dict(TRAIN_ITERS="0"), "TRAIN_ITERS must be a positive integer, not '0'"),
                                        (dict(PEAKFLAT="on", PEAKFLAT_COMPONENTS="dispatch,bogus"),
                                         "unknown component 'bogus' in PEAKFLAT_COMPONENTS: take dispatch, vocab"),
                                        (dict(GPUS_PER_NODE="0"), "GPUS_PER_NODE must be a positive integer, not '0'")])
def test_bad_environment_is_refused_with_its_value(bad, words):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEAKFLAT")}
    env.update({"GPUS_PER_NODE": "1", "PYTHON": "echo", **bad})
    out = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_multi_node_sbatch_starts_one_task_per_node_on_the_submitted_script(tmp_path):
    """Under sbatch the script runs from Slurm's spool copy, which only the batch node has: the per-node tasks
    run the submitted script (the repository's, found from SLURM_SUBMIT_DIR), once each, with their node rank;
    the global batch holds at least one micro-batch per data-parallel rank."""
    fake = tmp_path / "srun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%q " "$@"; echo\n')
    fake.chmod(0o755)
    spool = tmp_path / "slurm_script"
    spool.write_text(open(SCRIPT).read())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PEAKFLAT", "SLURM", "MEGATRON_ARGS"))}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", GPUS_PER_NODE="8", PYTHON="echo", SLURM_JOB_ID="7",
               SLURM_NNODES="2", SLURM_SUBMIT_DIR=ROOT)
    out = subprocess.run(["bash", str(spool), "--seed", "5"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    srun = shlex.split(out.stdout.splitlines()[-1])
    assert srun[:3] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash"], srun
    task = srun[-1]
    assert task.startswith("PEAKFLAT_IN_SRUN=1 NODE_RANK=$SLURM_NODEID ") and f"{SCRIPT} --seed 5" in task, task
    # what one task then runs: torchrun for its node, 16 ranks in all
    env.update(PEAKFLAT_IN_SRUN="1", SLURM_NODEID="1")
    inner = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    argv = shlex.split(inner.stdout.splitlines()[-1])
    assert value(argv, "--nnodes") == "2" and value(argv, "--node-rank") == "1"
    assert int(value(argv, "--global-batch-size")) >= 16


def _slurm_env(tmp_path, **env: str) -> dict[str, str]:
    """A batch job's environment with ``srun`` (and ``scontrol`` where asked) faked in PATH: srun prints its
    arguments instead of starting tasks."""
    fake = tmp_path / "srun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%q " "$@"; echo\n')
    fake.chmod(0o755)
    out = {k: v for k, v in os.environ.items() if not k.startswith(("PEAKFLAT", "SLURM", "MEGATRON_ARGS"))}
    out.update(PATH=f"{tmp_path}:{out['PATH']}", GPUS_PER_NODE="8", PYTHON="echo", SLURM_JOB_ID="7")
    out.update(env)
    return out


def _fake_scontrol(tmp_path, command_path: str) -> None:
    """``scontrol show job`` answering as Slurm does for a job submitted as ``sbatch <command_path>``."""
    fake = tmp_path / "scontrol"
    fake.write_text('#!/usr/bin/env bash\nif [[ "$1 $2" == "show job" ]]; then\n'
                    f'  echo "JobId=$3 JobName=peakflat-moe"\n  echo "   Command={command_path} --seed 5"\n'
                    f'  echo "   WorkDir={tmp_path}"\nfi\n')
    fake.chmod(0o755)


def test_the_sbatch_header_has_time_and_partition_placeholders():
    header = [line for line in open(SCRIPT) if line.startswith("#SBATCH") or line.startswith("##SBATCH")]
    assert any(line.startswith("#SBATCH --time=") for line in header), header
    assert any(line.startswith("##SBATCH --partition=") for line in header), header  # off until a partition is named


def test_save_load_and_tensorboard_slots():
    """SAVE_DIR gives --save with an interval and, as LOAD_DIR's default, --load (a resubmitted job resumes);
    LOAD_DIR alone loads from elsewhere; TB_DIR gives --tensorboard-dir. Without them none of these is passed, and
    the user's flags still come last."""
    argv = command(PEAKFLAT="off", SAVE_DIR="/ckpt/run1", TB_DIR="/tb/run1", ARGV="--save-interval 50")
    assert value(argv, "--save") == "/ckpt/run1" and value(argv, "--load") == "/ckpt/run1"
    assert value(argv, "--tensorboard-dir") == "/tb/run1"
    assert argv[-2:] == ["--save-interval", "50"] and argv.index("--save-interval") < len(argv) - 2
    argv = command(PEAKFLAT="on", LOAD_DIR="/ckpt/pretrained", SAVE_DIR="/ckpt/run2", SAVE_INTERVAL="200")
    assert value(argv, "--load") == "/ckpt/pretrained" and value(argv, "--save") == "/ckpt/run2"
    assert value(argv, "--save-interval") == "200"
    argv = command(PEAKFLAT="on")
    assert not {"--save", "--load", "--tensorboard-dir"} & set(argv)


def test_container_runs_the_tasks_in_the_image_with_the_paths_mounted(tmp_path):
    """CONTAINER_IMAGE under sbatch, even on one node: srun starts the task in the image (pyxis), the repository,
    each data prefix's directory, the checkpoint and TensorBoard directories mounted once each at their own paths,
    the repository as working directory and on PYTHONPATH; inside, the task runs torchrun with those flags."""
    image = "nvcr.io#nvidia/pytorch:25.01-py3"
    env = _slurm_env(tmp_path, SLURM_NNODES="1", SLURM_SUBMIT_DIR=ROOT, CONTAINER_IMAGE=image,
                     CONTAINER_MOUNTS="/scratch:/scratch", SAVE_DIR="/ckpt/run1", TB_DIR="/tb/run1",
                     DATA_PATH="0.5 /data/a/text_document 0.5 /data/b/text_document", TOKENIZER_MODEL="gpt2")
    out = subprocess.run(["bash", SCRIPT, "--seed", "5"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    srun = shlex.split(out.stdout.splitlines()[-1])
    assert f"--container-image={image}" in srun, srun
    mounts = next(a for a in srun if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    assert mounts == [f"{ROOT}:{ROOT}", "/data/a:/data/a", "/data/b:/data/b", "/ckpt/run1:/ckpt/run1",
                      "/tb/run1:/tb/run1", "/scratch:/scratch"], mounts
    assert f"--container-workdir={ROOT}" in srun
    task = srun[-1]
    assert f"PYTHONPATH={ROOT}" in task and f"{SCRIPT} --seed 5" in task, task
    env.update(PEAKFLAT_IN_SRUN="1", SLURM_NODEID="0")
    inner = subprocess.run(["bash", SCRIPT, "--seed", "5"], env=env, capture_output=True, text=True, timeout=60)
    assert inner.returncode == 0, inner.stderr
    argv = shlex.split(inner.stdout.splitlines()[-1])
    assert argv[:2] == ["-m", "torch.distributed.run"] and value(argv, "--save") == "/ckpt/run1"
    i = argv.index("--data-path")  # a weighted blend reaches Megatron as its words
    assert argv[i + 1:i + 5] == ["0.5", "/data/a/text_document", "0.5", "/data/b/text_document"], argv


def test_a_container_job_submits_from_a_batch_host_without_torch(tmp_path):
    """The batch host of a container job need not have torch: the GPU count comes from Slurm or nvidia-smi, and
    the tasks in the image count again."""
    python = tmp_path / "python-without-torch"
    python.write_text('#!/usr/bin/env bash\necho "ModuleNotFoundError: No module named torch" >&2; exit 1\n')
    python.chmod(0o755)
    env = _slurm_env(tmp_path, SLURM_NNODES="1", SLURM_SUBMIT_DIR=ROOT, CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.01-py3",
                     PYTHON=str(python), SLURM_GPUS_ON_NODE="4")
    env.pop("GPUS_PER_NODE")
    out = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "gpus/node=4" in out.stdout, out.stderr
    assert out.stdout.splitlines()[-1].startswith("--ntasks-per-node=1"), out.stdout


def test_the_default_expert_parallel_size_divides_the_experts_and_the_ranks():
    assert value(command(GPUS_PER_NODE="8", EXPERTS="6", PEAKFLAT="off"), "--expert-model-parallel-size") == "2"
    assert value(command(GPUS_PER_NODE="8", EXPERTS="8", PEAKFLAT="off"), "--expert-model-parallel-size") == "8"
    assert value(command(GPUS_PER_NODE="6", EXPERTS="8", PEAKFLAT="off"), "--expert-model-parallel-size") == "2"


def test_the_banner_shows_the_sequence_that_runs_and_the_chunk_note_only_for_another_model():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PEAKFLAT", "SLURM", "MEGATRON_ARGS"))}
    env.update(GPUS_PER_NODE="2", PYTHON="echo")
    for extra, note in ((dict(PEAKFLAT="on"), False), (dict(PEAKFLAT="on", HIDDEN="4096"), True)):
        out = subprocess.run(["bash", SCRIPT, "--seq-length", "8192"], env={**env, **extra}, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and "seq=8192" in out.stdout, out.stdout
        assert ("CHUNK_CAP defaults to 4096" in out.stderr) == note, out.stderr


def test_a_container_outside_slurm_is_refused_with_the_fix():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PEAKFLAT", "SLURM", "MEGATRON_ARGS"))}
    env.update(GPUS_PER_NODE="1", PYTHON="echo", CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.01-py3")
    out = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs SLURM with pyxis" in out.stderr and "CONTAINER_IMAGE unset" in out.stderr


def test_multi_node_from_any_submit_directory(tmp_path):
    """sbatch from a directory outside the repository: Slurm runs its spool copy, and the tasks run the submitted
    script, found by ``scontrol show job``; started by its absolute path (salloc), by that path; with neither,
    the job stops at once naming PEAKFLAT_SCRIPT, which then works."""
    spool = tmp_path / "slurm_script"
    spool.write_text(open(SCRIPT).read())
    elsewhere = tmp_path / "jobs"
    elsewhere.mkdir()
    env = _slurm_env(tmp_path, SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(elsewhere))

    def task(script: str, **more: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", script, "--seed", "5"], env={**env, **more}, cwd=elsewhere,
                              capture_output=True, text=True, timeout=60)

    out = task(str(spool))  # no scontrol, nothing under the submit directory
    assert out.returncode == 2 and "PEAKFLAT_SCRIPT=" in out.stderr, out.stderr
    out = task(str(spool), PEAKFLAT_SCRIPT=SCRIPT)
    assert out.returncode == 0 and f"{SCRIPT} --seed 5" in shlex.split(out.stdout.splitlines()[-1])[-1]
    _fake_scontrol(tmp_path, SCRIPT)
    out = task(str(spool))
    assert out.returncode == 0, out.stderr
    assert f"{SCRIPT} --seed 5" in shlex.split(out.stdout.splitlines()[-1])[-1]
    (tmp_path / "scontrol").unlink()
    out = task(SCRIPT)  # an absolute path, from another directory
    assert out.returncode == 0, out.stderr
    srun = shlex.split(out.stdout.splitlines()[-1])
    assert srun[-1].startswith("PEAKFLAT_IN_SRUN=1 NODE_RANK=$SLURM_NODEID ") and f"{SCRIPT} --seed 5" in srun[-1]


@needs_pretrain_entry
def test_the_default_line_trains_through_the_pretrain_entry_on_cpu():
    """The example's default (PEAKFLAT=auto), shrunk, through the pretrain entry's CPU dry run: start-up plans,
    adds its flags and trains every iteration."""
    argv = command(NUM_LAYERS="2", HIDDEN="64", HEADS="4", FFN="128", MOE_FFN="64", EXPERTS="4", SEQ_LEN="256",
                   TRAIN_ITERS="3", VOCAB="1024", GPUS_PER_NODE="1")
    flags = argv[argv.index("megatron_peakflat.pretrain") + 1:]
    out = run_module("megatron_peakflat.testing.pretrain_dryrun", *flags, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "peakflat auto: planned for 1 GPU(s)" in text and "added: --peakflat-dispatch pipelined-llep" in text
    assert len(logged(text, "lm loss")) == 3


def _last(argv: list[str], flag: str) -> str:
    """The value of the last ``flag``: the one Megatron's parser keeps."""
    return argv[len(argv) - argv[::-1].index(flag)]


def test_the_position_embeddings_follow_a_sequence_length_given_on_the_command_line():
    argv = command(PEAKFLAT="off", ARGV="--seq-length 8192 --lr 1e-4")  # the script's own header example
    assert _last(argv, "--seq-length") == _last(argv, "--max-position-embeddings") == "8192", argv
    argv = command(PEAKFLAT="off", MEGATRON_ARGS="--seq-length 16384")
    assert _last(argv, "--max-position-embeddings") == "16384", argv
    argv = command(PEAKFLAT="off", ARGV="--seq-length 8192 --max-position-embeddings 32768")  # given: kept
    assert _last(argv, "--max-position-embeddings") == "32768", argv
