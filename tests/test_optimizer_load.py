"""OffloadStreamAdamW.load_state_dict refuses a state that does not belong to its parameters, before it changes
anything.

torch.optim.AdamW.load_state_dict refuses only a different number of param groups or a group of another size; a
state tensor of another shape loads, and the next step broadcasts it or fails with a broadcast error that names
no parameter. Here every state tensor's shape (so also its element count) and dtype is checked against the
parameter it lands on, and a refused load leaves the optimizer as an untouched twin: the same hyperparameters,
step counts, masters and moments, and the same next step, bit for bit.
"""

from __future__ import annotations

import io
import re

import pytest
import torch

from megatron_peakflat.optimizer import OffloadStreamAdamW

from .test_optimizer import assert_same_params_and_state


def _make(shapes: list[list[tuple[int, ...]]], *, seed: int = 0, lr: float = 1e-3, weight_decay: float = 0.01,
          torch_adamw: bool = False):
    """An optimizer over fresh parameters of ``shapes`` (one list per param group), and the parameters."""
    g = torch.Generator().manual_seed(seed)
    groups = [[torch.nn.Parameter(torch.randn(s, generator=g)) for s in shp] for shp in shapes]
    spec = [{"params": ps} for ps in groups]
    if torch_adamw:
        opt = torch.optim.AdamW(spec, lr=lr, weight_decay=weight_decay, foreach=False)
    else:
        opt = OffloadStreamAdamW(spec, lr=lr, weight_decay=weight_decay, bucket=4096, engine="cpu", host_threads=1,
                                 pin=False)
    return opt, [p for ps in groups for p in ps]


def _steps(opt, ps, n: int, seed: int) -> None:
    for it in range(n):
        g = torch.Generator().manual_seed(seed + it)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _saved(shapes, torch_adamw: bool) -> dict:
    """The state dict of an optimizer over ``shapes`` after one step, through torch.save and torch.load, saved
    with other hyperparameters than the loaders' (a partial load would show in them)."""
    opt, ps = _make(shapes, seed=7, lr=5e-2, weight_decay=0.3, torch_adamw=torch_adamw)
    _steps(opt, ps, 1, seed=50)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _assert_untouched(loaded, lps, twin, tps) -> None:
    """``loaded`` (after a refused load) equals ``twin`` (never asked to load) bit for bit: hyperparameters, step
    counts, every state tensor, then the parameters and state after one more step."""
    strip = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]  # noqa: E731
    assert strip(loaded.param_groups) == strip(twin.param_groups)
    assert loaded._materialized == twin._materialized
    if twin._materialized:
        assert loaded._steps == twin._steps
        assert_same_params_and_state(loaded, lps, twin, tps)
    assert loaded._gpu_fraction == twin._gpu_fraction
    _steps(loaded, lps, 1, seed=900)
    _steps(twin, tps, 1, seed=900)
    assert loaded._steps == twin._steps
    assert_same_params_and_state(loaded, lps, twin, tps)


BIG = 1_000_003
CASES = {
    # saved shapes, loader's shapes, (group, parameter, saved shape, loader's shape) the error names
    "one-element-into-seven": ([[(1,)]], [[(7,)]], (0, 0, (1,), (7,))),
    "transposed": ([[(5,)], [(53, 37)]], [[(5,)], [(37, 53)]], (1, 0, (53, 37), (37, 53))),
    # the first parameter matches, so a load that copies as it goes would already have overwritten it
    "one-element-more": ([[(5, 3), (BIG + 1,)]], [[(5, 3), (BIG,)]], (0, 1, (BIG + 1,), (BIG,))),
    "saved-in-another-order": ([[(7,), (5, 3), (4,)]], [[(5, 3), (7,), (4,)]], (0, 0, (7,), (5, 3))),
}


def _message(gi: int, pj: int, saved: tuple[int, ...], mine: tuple[int, ...], key: str) -> str:
    n, m = 1, 1
    for d in saved:
        n *= d
    for d in mine:
        m *= d
    return re.escape(f"param group {gi}, parameter {pj} (saved index ") + r"\d+\)" + re.escape(
        f": saved '{key}' has shape {saved} ({n:,} elements), this parameter has shape {mine} ({m:,} elements)")


@pytest.mark.parametrize("stepped", [True, False], ids=["after-steps", "fresh"])
@pytest.mark.parametrize("source", ["ours", "torch-adamw"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_state_saved_for_other_parameters_is_refused_and_changes_nothing(case, source, stepped):
    saved_shapes, shapes, (gi, pj, saved, mine) = CASES[case]
    state = _saved(saved_shapes, torch_adamw=source == "torch-adamw")
    loaded, lps = _make(shapes)
    twin, tps = _make(shapes)
    if stepped:  # three steps here, one in the saved state: a partly loaded step count would show
        _steps(loaded, lps, 3, seed=10)
        _steps(twin, tps, 3, seed=10)
    key = "master_param" if source == "ours" else "exp_avg"  # the first state tensor each source saves
    with pytest.raises(ValueError, match=_message(gi, pj, saved, mine, key)):
        loaded.load_state_dict(state)
    _assert_untouched(loaded, lps, twin, tps)


def test_torch_adamw_loads_those_states_and_fails_or_broadcasts_at_its_step():
    """What the checks add over torch.optim.AdamW.load_state_dict: it loads a state of another shape, and its step
    then either broadcasts a one-element state over the parameter or fails naming no parameter."""
    for case in ("one-element-into-seven", "transposed"):
        saved_shapes, shapes, _ = CASES[case]
        opt, ps = _make(shapes, torch_adamw=True)
        opt.load_state_dict(_saved(saved_shapes, torch_adamw=True))  # accepted
        with pytest.raises(RuntimeError, match="shape|size"):
            _steps(opt, ps, 1, seed=3)


def _corrupt(kind: str, sd: dict) -> str:
    """Damage a state dict of ``_make([[(5, 3), (7,)], [(4,)]])`` one way; returns what the error must say."""
    groups, state = sd["param_groups"], sd["state"]
    if kind == "integer-moments":
        state[1]["exp_avg"] = state[1]["exp_avg"].round().long()
        return re.escape("param group 0, parameter 1 (saved index 1): saved 'exp_avg' is a torch.int64 tensor")
    if kind == "not-a-tensor":
        state[2]["exp_avg_sq"] = [0.0] * 4
        return re.escape("param group 1, parameter 0 (saved index 2): saved 'exp_avg_sq' is a list, not a tensor")
    if kind == "index-listed-twice":
        groups[1]["params"] = [0]
        return re.escape("saved parameter index 0 is listed twice (param group 0, parameter 0 and param group 1, "
                         "parameter 0)")
    if kind == "state-of-an-unlisted-index":
        state[9] = dict(state[0])
        return re.escape("the saved state holds parameter index 9, which no saved param group lists")
    if kind == "negative-step":
        groups[1]["step"] = -1
        return re.escape("param group 1: saved step -1 is not a non-negative whole number")
    if kind == "fractional-step":
        for g in groups:
            g.pop("step", None)
        state[1]["step"] = torch.tensor(2.5)
        return re.escape("param group 0, parameter 1 (saved index 1): saved step tensor(2.5000)")
    if kind == "engine-split":
        sd["peakflat"]["gpu_fraction"] = 1.5
        return re.escape("gpu_fraction=1.5 lies outside [0, 1]")
    if kind == "group-size":
        groups[0]["params"] = groups[0]["params"][:1]
        return re.escape("a param group's size differs from the saved one (param group 0: 1 parameters saved, 2 here)")
    raise AssertionError(kind)


CORRUPTIONS = ["integer-moments", "not-a-tensor", "index-listed-twice", "state-of-an-unlisted-index",
               "negative-step", "fractional-step", "engine-split", "group-size"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_every_other_refusal_names_what_is_wrong_and_changes_nothing(kind):
    shapes = [[(5, 3), (7,)], [(4,)]]
    sd = _saved(shapes, torch_adamw=False)
    match = _corrupt(kind, sd)
    loaded, lps = _make(shapes)
    twin, tps = _make(shapes)
    _steps(loaded, lps, 2, seed=10)
    _steps(twin, tps, 2, seed=10)
    with pytest.raises(ValueError, match=match):
        loaded.load_state_dict(sd)
    _assert_untouched(loaded, lps, twin, tps)


def test_its_own_state_reordered_between_parameters_of_one_shape_loads_whole():
    """A state dict whose tensors are views of this optimizer's own buckets (``state_dict()`` returns views), with
    two same-shaped parameters' states swapped: each parameter gets the other's, read before anything is copied."""
    opt, ps = _make([[(6,), (6,), (3,)]])
    _steps(opt, ps, 2, seed=10)
    sd = opt.state_dict()
    before = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    sd["state"][0], sd["state"][1] = sd["state"][1], sd["state"][0]
    opt.load_state_dict(sd)
    for i, j in ((0, 1), (1, 0), (2, 2)):
        for k in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(opt.state[ps[i]][k], before[j][k]), (i, k)


def test_adopting_a_misshaped_tensor_put_into_state_is_refused_before_any_is_adopted():
    """A checkpoint loader that writes ``state[param]`` tensors (Megatron's DistributedOptimizer) meets the same
    check when they are adopted: one of another shape raises, naming the parameter, and a right one put in for
    another parameter in the same load is not adopted either."""
    opt, ps = _make([[(5, 3), (7,)], [(4,)]])
    _steps(opt, ps, 1, seed=10)
    kept = opt._view(opt._exp_avg, 0).clone()
    opt.state[ps[0]]["exp_avg"] = torch.full((5, 3), 0.5)
    opt.state[ps[2]]["exp_avg"] = torch.full((2, 2), 0.5)
    with pytest.raises(ValueError, match=re.escape(
            "param group 1, parameter 0: the tensor put in for 'exp_avg' has shape (2, 2) (4 elements), this "
            "parameter has shape (4,) (4 elements)")):
        opt._sync_hdo_state_to_sub_optimizers()
    assert torch.equal(opt._view(opt._exp_avg, 0), kept)
