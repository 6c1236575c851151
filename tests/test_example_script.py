"""examples/pretrain_moe.sh builds the Megatron command line its environment asks for (read back with the
launcher replaced by ``echo``, so no GPU is needed): peakflat's flags only when on, one per component,
the example's long-context defaults, and the user's flags last, so that they win."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from megatron_peakflat.testing.subproc import ROOT

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


@pytest.mark.parametrize("bad, words", [(dict(PEAKFLAT="maybe"), "PEAKFLAT must be on or off"),
                                        (dict(PEAKFLAT="on", PEAKFLAT_COMPONENTS="dispatch,bogus"),
                                         "unknown component 'bogus'")])
def test_bad_environment_is_refused_with_its_value(bad, words):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEAKFLAT")}
    env.update(GPUS_PER_NODE="1", PYTHON="echo", **bad)
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
