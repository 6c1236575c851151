"""The patch registry: every symbol resolves on the installed Megatron, apply is idempotent,
remove restores everything, and a moved symbol fails at start-up naming itself."""

import importlib

import pytest

import megatron_peakflat
from megatron_peakflat import PeakflatConfig
from megatron_peakflat.dispatch.config import DispatchConfig
from megatron_peakflat.config import GeneralConfig
from megatron_peakflat.integration import registry, state
from megatron_peakflat.optimizer.config import OptimizerConfig
from megatron_peakflat.recompute.config import SCOConfig
from megatron_peakflat.vocab.config import VocabConfig


COMPONENT_PATCHES = [p for p in registry.PATCHES if p.component != "wheel-fixes"]


def snapshot():
    return {p.symbol: registry._resolve(p)[2] for p in registry.PATCHES}


def all_on() -> PeakflatConfig:
    return PeakflatConfig(
        dispatch=DispatchConfig(impl="pipelined-llep"),
        vocab=VocabConfig(impl="ring-dtp"),
        sco=SCOConfig(enabled=True),
        optimizer=OptimizerConfig(impl="offload-stream"),
        general=GeneralConfig(attention="sdpa", report_peaks=True),
    )


@pytest.fixture(autouse=True)
def clean():
    megatron_peakflat.remove()
    yield
    megatron_peakflat.remove()


@pytest.mark.parametrize("patch", registry.PATCHES, ids=lambda p: p.symbol)
def test_every_symbol_exists_in_installed_megatron(patch):
    owner, name, original = registry._resolve(patch)
    assert original is not None
    mod, fn = patch.factory.split(":")
    assert callable(getattr(importlib.import_module(mod), fn)), f"factory {patch.factory} missing"


def test_nothing_patched_when_everything_is_off():
    before = snapshot()
    megatron_peakflat.apply(PeakflatConfig(general=GeneralConfig(attention="local")))
    assert registry.applied() == []
    assert snapshot() == before


def test_apply_is_idempotent_and_remove_restores_everything():
    before = snapshot()
    megatron_peakflat.apply(all_on())
    patched = snapshot()
    assert set(registry.applied()) == {p.symbol for p in COMPONENT_PATCHES}
    for p in COMPONENT_PATCHES:
        assert patched[p.symbol] is not before[p.symbol], p.symbol
        assert getattr(patched[p.symbol], "__wrapped__", None) is not None, p.symbol
    megatron_peakflat.apply(all_on())
    assert snapshot() == patched, "a second apply must not wrap twice"
    restored = megatron_peakflat.remove()
    assert set(restored) == {p.symbol for p in COMPONENT_PATCHES}
    assert snapshot() == before
    assert state.get() is None
    assert megatron_peakflat.remove() == []


def test_only_enabled_components_are_patched():
    megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True), general=GeneralConfig(attention="local")))
    assert {s.split(".")[-1] for s in registry.applied()} == {"checkpointed_forward"}


def test_a_moved_symbol_fails_naming_it_and_patches_nothing(monkeypatch):
    bogus = registry.Patch("sco", "megatron.core.recompute", "checkpointed_forward_v2",
                           "megatron_peakflat.integration.recompute:wrap_checkpointed_forward", "test entry")
    before = snapshot()
    monkeypatch.setattr(registry, "PATCHES", registry.PATCHES + (bogus,))
    with pytest.raises(registry.PeakflatIntegrationError) as e:
        megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True), general=GeneralConfig(attention="local")))
    assert "megatron.core.recompute.checkpointed_forward_v2" in str(e.value)
    assert "0.19.2" in str(e.value)
    assert registry.applied() == []
    monkeypatch.setattr(registry, "PATCHES", registry.PATCHES[:-1])
    assert snapshot() == before


def test_a_missing_module_fails_naming_it(monkeypatch):
    bogus = registry.Patch("sco", "megatron.core.no_such_module", "f", "x:y", "test entry")
    monkeypatch.setattr(registry, "PATCHES", (bogus,))
    with pytest.raises(registry.PeakflatIntegrationError, match="megatron.core.no_such_module"):
        megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True), general=GeneralConfig(attention="local")))
