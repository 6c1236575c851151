"""What the integration layer assumes of the installed megatron-core beyond its symbols' names.

- ``apply()`` compares the installed megatron-core with the checked range (``compat.CHECKED_ON``) and, outside
  it, logs one warning naming both; it never fails for it.
- Every place where a replacement reads Megatron's arguments by position, or reaches a private name or instance
  attribute, is checked here against the real classes and functions of the megatron-core installed now: a
  Megatron that reordered ``GPTModel.forward`` (``labels`` read as ``args[4]``), ``CheckpointFunction.forward`` /
  ``backward``, ``_compute_mtp_acceptance_counts``, or renamed an attribute that ``combine_postprocess``'s
  replacement nulls, fails a test that names the symbol. The positional ones also fail at start-up
  (``Patch.positional``), which ``test_a_reordered_signature_is_refused_at_start_up`` shows on a stand-in.
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys
import textwrap
import types

import pytest

from megatron_peakflat import PeakflatConfig, apply, remove
from megatron_peakflat.integration import compat, registry


# ------------------------------------------------------------------------------------------------------------
# the version guard


@pytest.mark.parametrize("version", ["0.18.2", "0.19.0", "0.19.2", "0.19.2+cu130", "0.19.2rc1"])
def test_versions_inside_the_checked_range_get_no_warning(version):
    assert compat.unchecked_version_warning(version) is None


@pytest.mark.parametrize("version", ["0.17.1", "0.19.3", "0.20.0", "1.0.0", "0.18.2rc0", "not-a-version", None])
def test_versions_outside_it_get_a_warning_naming_it_and_the_range(version):
    note = compat.unchecked_version_warning(version)
    assert note is not None
    assert ("could not be read" if version is None else f"megatron-core is {version},") in note
    assert "megatron-core 0.18.2 to 0.19.2 (tested on 0.18.2, 0.19.2)" in note


def test_the_installed_version_is_read_and_inside_the_range():
    import importlib.metadata

    assert compat.megatron_core_version() == importlib.metadata.version("megatron-core")
    assert compat.unchecked_version_warning(compat.megatron_core_version()) is None, (
        f"the CPU suite runs on megatron-core {compat.megatron_core_version()}, outside CHECKED_ON "
        f"{compat.CHECKED_ON}: add it there once the suite passes on it")


def test_a_source_checkout_without_metadata_is_read_from_package_info_by_every_reader(monkeypatch):
    """The version guard, the start-up checks (config) and peakflat-check read megatron-core's version one way:
    its distribution's metadata, else ``megatron.core.package_info`` (a source checkout on PYTHONPATH)."""
    import importlib.metadata

    from megatron.core import package_info


    real = importlib.metadata.version

    def no_megatron_metadata(dist: str) -> str:
        if dist == "megatron-core":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", no_megatron_metadata)
    assert compat.megatron_core_version() == str(package_info.__version__)
    major, minor = (int(x) for x in str(package_info.__version__).split(".")[:2])
    assert compat.version_tuple()[:2] == (major, minor)


@pytest.fixture
def fresh_guard(monkeypatch):
    monkeypatch.setattr(compat, "_version_warned", False)
    yield
    remove()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "megatron-core" in r.getMessage()]


def test_apply_warns_once_outside_the_checked_range_and_goes_on(monkeypatch, caplog, fresh_guard):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.21.0")
    caplog.set_level(logging.INFO, logger="megatron_peakflat")
    cfg = apply(PeakflatConfig())  # no failure
    apply(cfg)  # idempotent: no second warning
    registry.apply_patches({"wheel-fixes"})  # nor from another entry point (the pretrain script's)
    got = _warnings(caplog)
    assert len(got) == 1, got
    assert "megatron-core is 0.21.0" in got[0] and "0.18.2 to 0.19.2" in got[0]


def test_apply_inside_the_range_logs_no_version_warning(monkeypatch, caplog, fresh_guard):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: "0.19.2")
    caplog.set_level(logging.INFO, logger="megatron_peakflat")
    apply(PeakflatConfig())
    assert _warnings(caplog) == []


# ------------------------------------------------------------------------------------------------------------
# positional and private accesses, against the installed megatron-core


def _leading(fn) -> list[str]:
    """The leading parameters of ``fn`` that can be passed by position (``*name`` for a variable one)."""
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    out = []
    for q in inspect.signature(fn).parameters.values():
        if q.kind is inspect.Parameter.VAR_POSITIONAL:
            out.append(f"*{q.name}")
            break
        if q.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            break
        out.append(q.name)
    return out


def test_checkpoint_function_forward_and_backward_take_what_dispatch_recompute_passes_by_position():
    """``dispatch_recompute.wrap_checkpoint_forward`` calls ``original(ctx, run_function, distribute_saved_activations,
    *args)`` and ``wrap_checkpoint_backward`` reads ``grads[0]`` of ``original(ctx, *grads)`` as the output's
    gradient."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    fwd = CheckpointFunction.__dict__["forward"]
    bwd = CheckpointFunction.__dict__["backward"]
    assert isinstance(fwd, staticmethod) and isinstance(bwd, staticmethod), (
        "megatron.core.tensor_parallel.random.CheckpointFunction.forward/backward are no longer static methods")
    got = _leading(fwd)
    assert got[:3] == ["ctx", "run_function", "distribute_saved_activations"] and got[3:4] and got[3].startswith("*"), (
        f"megatron.core.tensor_parallel.random.CheckpointFunction.forward changed its signature: "
        f"{inspect.signature(fwd.__func__)}; integration/dispatch_recompute.py passes (ctx, run_function, "
        f"distribute_saved_activations, *args)")
    got = _leading(bwd)
    assert got[:1] == ["ctx"] and len(got) == 2 and got[1].startswith("*"), (
        f"megatron.core.tensor_parallel.random.CheckpointFunction.backward changed its signature: "
        f"{inspect.signature(bwd.__func__)}; integration/dispatch_recompute.py passes (ctx, *grads)")


def test_gpt_model_forward_takes_labels_fifth_after_self():
    """``vocab.wrap_gpt_forward`` reads ``labels`` as ``args[4]`` when it is passed by position."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    got = _leading(GPTModel.forward)
    assert got[:6] == ["self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels"], (
        f"megatron.core.models.gpt.gpt_model.GPTModel.forward changed its positional parameters to {got}; "
        f"integration/vocab.py reads labels as args[4] (after self)")


def test_compute_mtp_acceptance_counts_exists_and_takes_logits_labels_mask_first():
    """``vocab.wrap_mtp_acceptance_counts`` replaces this private function (megatron-core 0.19 and later) and reads
    its first three arguments by position as (mtp_logits, mtp_labels, loss_mask); Megatron's own caller, in
    ``process_mtp_loss``, passes them so."""
    from packaging.version import Version

    import megatron.core.transformer.multi_token_prediction as mtp

    symbol = "megatron.core.transformer.multi_token_prediction._compute_mtp_acceptance_counts"
    version = Version(Version(compat.megatron_core_version()).public)
    if not hasattr(mtp, "_compute_mtp_acceptance_counts"):
        assert version < Version("0.19"), f"{symbol} is gone in megatron-core {version}: MTP acceptance counts " \
                                          "would be computed from Ring-DTP's stand-in logits"
        pytest.skip(f"megatron-core {version} has no MTP acceptance counts (the patch is optional there)")
    fn = mtp._compute_mtp_acceptance_counts
    assert _leading(fn)[:3] == ["mtp_logits", "mtp_labels", "loss_mask"], (
        f"{symbol} changed its signature: {inspect.signature(fn)}; integration/vocab.py reads "
        f"(mtp_logits, mtp_labels, loss_mask) by position")
    calls = [n for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(mtp))))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "_compute_mtp_acceptance_counts"]
    assert calls, f"{symbol} is no longer called inside its module: the patch would never run"
    for call in calls:
        first = [getattr(a, "id", None) for a in call.args[:3]]
        assert first == ["mtp_logits", "mtp_labels", "loss_mask"], (
            f"{symbol} is now called with {ast.unparse(call)}; integration/vocab.py reads its first three positional "
            f"arguments as (mtp_logits, mtp_labels, loss_mask)")


def _assigned_self_attributes(cls: type) -> set[str]:
    """Names ``n`` that ``cls``'s own source assigns as ``self.n`` (plain, annotated, augmented or unpacked)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    out: set[str] = set()

    def targets(node: ast.AST):
        if isinstance(node, (ast.Tuple, ast.List)):
            for e in node.elts:
                yield from targets(e)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)
        else:
            yield node

    for node in ast.walk(tree):
        tgts = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in (x for tgt in tgts for x in targets(tgt)):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def test_the_attributes_moe_release_nulls_are_the_ones_megatrons_dispatchers_set():
    """``moe_release.release_after_combine`` sets each attribute of ``PER_FORWARD`` to None after
    ``combine_postprocess``. A renamed attribute would leave the real one alive (the fix silently off): each
    dispatcher must still set its own, and every name must still be set by one of them."""
    from megatron.core.transformer.moe import token_dispatcher as td

    from megatron_peakflat.integration.moe_release import PER_FORWARD

    expected = {
        "MoEAlltoAllTokenDispatcher": {"probs", "routing_map", "reversed_local_input_permutation_mapping"},
        "MoEAllGatherTokenDispatcher": {"local_probs", "local_map", "routing_map",
                                        "reversed_local_input_permutation_mapping"},
    }
    assert set().union(*expected.values()) == set(PER_FORWARD)
    for name, attrs in expected.items():
        cls = getattr(td, name)
        symbol = f"megatron.core.transformer.moe.token_dispatcher.{name}"
        assert "combine_postprocess" in cls.__dict__, f"{symbol}.combine_postprocess is no longer its own method"
        assert _leading(cls.__dict__["combine_postprocess"])[:1] == ["self"], f"{symbol}.combine_postprocess changed"
        missing = attrs - _assigned_self_attributes(cls)
        assert not missing, (f"{symbol} no longer sets self.{', self.'.join(sorted(missing))}: "
                             f"integration/moe_release.py nulls them after combine_postprocess (PER_FORWARD); find "
                             f"what holds the router probabilities and maps now")


def test_every_positional_entry_resolves_on_the_installed_megatron_core():
    """The start-up check of ``Patch.positional`` passes on the installed megatron-core for every entry using it."""
    checked = []
    for p in registry.PATCHES:
        if p.positional:
            try:
                registry._resolve(p)
            except registry.PeakflatIntegrationError:
                if not p.optional:
                    raise
                continue
            checked.append(p.symbol)
    assert len(checked) >= 3, checked


def test_a_reordered_signature_is_refused_at_start_up(monkeypatch):
    """A stand-in module whose GPTModel.forward takes labels sixth instead of fifth: apply's resolution raises
    naming the symbol and both signatures, before anything is patched."""
    fake = types.ModuleType("peakflat_fake_gpt")

    class GPTModel:
        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, inference_context=None,
                    labels=None, output_processor=None):
            return None

    fake.GPTModel = GPTModel
    monkeypatch.setitem(sys.modules, "peakflat_fake_gpt", fake)
    entry = next(p for p in registry.PATCHES if p.attr == "GPTModel.forward")
    moved = registry.Patch(entry.component, "peakflat_fake_gpt", entry.attr, entry.factory, entry.what,
                           needs_params=entry.needs_params, positional=entry.positional)
    with pytest.raises(registry.PeakflatIntegrationError,
                       match=r"reads the arguments of peakflat_fake_gpt\.GPTModel\.forward by position as \(self, "
                             r"input_ids, position_ids, attention_mask, decoder_input, labels\).*forward\(self, "
                             r"input_ids, position_ids, attention_mask, decoder_input=None, inference_context=None"):
        registry._resolve(moved)
