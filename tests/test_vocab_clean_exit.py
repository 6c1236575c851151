"""A gloo run of ``ring_linear_cross_entropy`` exits cleanly after ``dist.destroy_process_group()``.

The autograd graph of a Ring-DTP loss lives as long as the loss does (a script's last loss often lives until
the interpreter exits). It used to hold the ring's process group, so ``destroy_process_group()`` could not free
it: the group's gloo threads and connections lived on, and were torn down during interpreter finalization,
where gloo teardown may end in ``std::terminate`` (SIGABRT, exit -6). The graph now holds the group weakly:

- in-process, at world 3: after ``destroy_process_group(group)`` the group object is gone while losses of every
  path (activations and weights rings, backward run or not, the in-forward schedule) are still alive;
- as a user runs it: 10 separate launches of 3 ranks (V=1009 split 300/400/309, fp64, n = 1, 7 and 400, label
  smoothing, the activations schedule, the losses kept alive to the end) all exit with status 0.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron_peakflat.testing import max_rel_error, run_distributed
from megatron_peakflat.testing.subproc import ROOT, child_env
from megatron_peakflat.vocab import reference_linear_cross_entropy, ring_linear_cross_entropy

SHARDS = (300, 400, 309)
H = 16


def _case(rank: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(full weight, this rank's shard, hidden, labels) in fp64, a third of the labels ignored."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(SHARDS), H, generator=g, dtype=torch.float64)
    start = sum(SHARDS[:rank])
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(n, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, sum(SHARDS), (n,), generator=g)
    y[::3] = -100
    return w, w[start:start + SHARDS[rank]].clone(), x, y


def _ring_losses(rank: int, group, schedule: str, grad: str, backward: bool, seed: int) -> list[torch.Tensor]:
    """The ring's loss for n = 1, 7, 400 tokens, checked against the full cross-entropy (its online state is
    fp32, whatever the inputs); returned alive."""
    kept = []
    for n in (1, 7, 400):
        w, shard, x, y = _case(rank, n, seed + n)
        xs, ws = x.clone().requires_grad_(), shard.clone().requires_grad_()
        loss = ring_linear_cross_entropy(xs, ws, y, group, schedule=schedule, grad=grad, label_smoothing=0.1)
        ref = reference_linear_cross_entropy(x, w, y, label_smoothing=0.1)
        assert max_rel_error(loss, ref) < 1e-5, (schedule, grad, n, max_rel_error(loss, ref))
        if backward:
            loss.sum().backward()
        kept.append(loss)
    return kept


def _group_released_after_destroy(rank: int, world: int) -> bool:
    group = dist.new_group(list(range(world)))
    ref = weakref.ref(group)
    kept = []
    for i, (schedule, grad, backward) in enumerate([("activations", "recompute", True),
                                                    ("weights", "recompute", True),
                                                    ("activations", "recompute", False),
                                                    ("auto", "in-forward", True),
                                                    ("auto", "in-forward", False)]):
        kept += _ring_losses(rank, group, schedule, grad, backward, seed=100 * i)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert all(loss.grad_fn is not None for loss in kept)  # every graph is still alive
    released = ref() is None
    # a backward after its group was destroyed says so (it has no group left to run on)
    group = dist.new_group(list(range(world)))
    w, shard, x, y = _case(rank, 7, seed=5)
    loss = ring_linear_cross_entropy(x.requires_grad_(), shard, y, group, schedule="activations")
    dist.destroy_process_group(group)
    del group
    gc.collect()
    with pytest.raises(RuntimeError, match="the process group of its forward no longer exists"):
        loss.sum().backward()
    return released


def test_the_loss_graph_does_not_keep_the_ring_group_alive_after_destroy():
    assert run_distributed(_group_released_after_destroy, 3, timeout=240) == [True] * 3


# ------------------------------------------------------------------------------------------------------------
# separate launches, each rank exiting through the interpreter's own finalization


def test_ten_launches_of_three_ranks_all_exit_zero():
    """10 launches of 3 rank processes (``_ring_exit_runs.py``), each rank leaving through a normal interpreter exit
    with its losses alive: every rank of every launch exits 0."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ring_exit_runs.py")
    res = subprocess.run([sys.executable, script, "10"], cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    codes = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(codes) == 10
    bad = [(i, c) for i, c in enumerate(codes) if c != [0, 0, 0]]
    assert not bad, f"launches with a rank that did not exit 0 (negative: its signal): {bad}\n{res.stderr[-3000:]}"
