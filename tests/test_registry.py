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
from megatron_peakflat.sco.config import SCOConfig
from megatron_peakflat.tile.config import TileConfig
from megatron_peakflat.vocab.config import VocabConfig


def _present(p: registry.Patch) -> bool:
    try:
        registry._resolve(p)
    except registry.PeakflatIntegrationError:
        return False
    return True


PRESENT = [p for p in registry.PATCHES if not p.optional or _present(p)]
"""Every patch, less the optional ones this megatron-core lacks (megatron-core 0.18.2 has no MTP acceptance counts)."""
COMPONENT_PATCHES = [p for p in PRESENT if p.component != "wheel-fixes"]


def snapshot():
    return {p.symbol: registry._resolve(p)[2] for p in PRESENT}


def all_on() -> PeakflatConfig:
    return PeakflatConfig(
        dispatch=DispatchConfig(impl="pipelined-llep"),
        vocab=VocabConfig(impl="ring-dtp"),
        sco=SCOConfig(enabled=True),
        optimizer=OptimizerConfig(impl="offload-stream"),
        tile=TileConfig(enabled=True),
        general=GeneralConfig(attention="sdpa", report_peaks=True),
    )


@pytest.fixture(autouse=True)
def clean():
    megatron_peakflat.remove()
    yield
    megatron_peakflat.remove()


@pytest.mark.parametrize("patch", registry.PATCHES, ids=lambda p: p.symbol)
def test_every_symbol_exists_in_installed_megatron(patch):
    if patch.optional and not _present(patch):
        from megatron.core import __version__ as version

        assert version not in patch.checked_on, (patch.symbol, version)  # absent only where it was not checked
        return
    owner, name, original = registry._resolve(patch)
    assert original is not None
    mod, fn = patch.factory.split(":")
    assert callable(getattr(importlib.import_module(mod), fn)), f"factory {patch.factory} missing"


def test_an_absent_optional_symbol_is_skipped_and_the_rest_patched(monkeypatch):
    """A megatron-core without an optional patch's symbol (0.18.2 has no MTP acceptance counts) patches the
    component's other symbols and skips that one, instead of refusing the component."""
    from megatron.core.transformer import multi_token_prediction

    optional = [p for p in registry.PATCHES if p.optional]
    assert [p.symbol for p in optional] == ["megatron.core.transformer.multi_token_prediction._compute_mtp_acceptance_counts"]
    monkeypatch.delattr(multi_token_prediction, "_compute_mtp_acceptance_counts", raising=False)
    megatron_peakflat.apply(PeakflatConfig(vocab=VocabConfig(impl="ring-dtp"), general=GeneralConfig(attention="local")))
    applied = registry.applied()
    assert optional[0].symbol not in applied
    assert "megatron.core.models.gpt.gpt_model.process_mtp_loss" in applied


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
    # SCO's entries, and the fix to Megatron's dispatcher that comes with any component (moe_release.py)
    assert {s.split(".")[-1] for s in registry.applied()} == {"checkpointed_forward", "combine_postprocess"}
    for dispatcher in ("MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher"):
        assert f"megatron.core.transformer.moe.token_dispatcher.{dispatcher}.combine_postprocess" in registry.applied()


def test_a_moved_symbol_fails_naming_it_and_patches_nothing(monkeypatch):
    bogus = registry.Patch("sco", "megatron.core.recompute", "checkpointed_forward_v2",
                           "megatron_peakflat.integration.sco:wrap_checkpointed_forward", "test entry")
    before = snapshot()
    monkeypatch.setattr(registry, "PATCHES", registry.PATCHES + (bogus,))
    with pytest.raises(registry.PeakflatIntegrationError) as e:
        megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True), general=GeneralConfig(attention="local")))
    assert "megatron.core.recompute.checkpointed_forward_v2" in str(e.value)
    assert "0.19.2" in str(e.value)
    assert registry.applied() == []
    monkeypatch.setattr(registry, "PATCHES", registry.PATCHES[:-1])
    assert snapshot() == before


def test_a_function_without_a_keyword_the_patch_passes_fails_naming_it_and_patches_nothing(monkeypatch):
    # megatron-core 0.17.1's GPTModel.forward took no output_processor: the call would have raised at step 1.
    vocab_forward = next(p for p in registry.PATCHES if p.symbol.endswith("GPTModel.forward"))
    assert "output_processor" in vocab_forward.needs_params
    bogus = registry.Patch("sco", "megatron.core.recompute", "checkpointed_forward",
                           "megatron_peakflat.integration.sco:wrap_checkpointed_forward", "test entry",
                           needs_params=("no_such_keyword",))
    before = snapshot()
    monkeypatch.setattr(registry, "PATCHES", (bogus,))
    with pytest.raises(registry.PeakflatIntegrationError) as e:
        megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True), general=GeneralConfig(attention="local")))
    assert "no_such_keyword" in str(e.value) and "megatron.core.recompute.checkpointed_forward" in str(e.value)
    assert registry.applied() == []
    monkeypatch.undo()
    assert snapshot() == before


def test_keywords_taken_by_kwargs_or_unreadable_signatures_are_accepted():
    def named(a, output_processor=None): ...
    def catch_all(a, **kw): ...
    def positional(a, b): ...
    assert registry._accepts(named, "output_processor")
    assert registry._accepts(catch_all, "output_processor")
    assert registry._accepts(staticmethod(named), "output_processor")
    assert not registry._accepts(positional, "output_processor")
    assert registry._accepts(max, "output_processor")  # builtins without a signature: the call decides


def test_a_missing_module_fails_naming_it(monkeypatch):
    bogus = registry.Patch("sco", "megatron.core.no_such_module", "f", "x:y", "test entry")
    monkeypatch.setattr(registry, "PATCHES", (bogus,))
    with pytest.raises(registry.PeakflatIntegrationError, match="megatron.core.no_such_module"):
        megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True), general=GeneralConfig(attention="local")))


def _megatron_args(seq: int, mask: bool, micro_batch: int = 1):
    from tests.test_config import parse_with_megatron

    ns = parse_with_megatron("--peakflat-sco", "--peakflat-attention", "sdpa", seq_length=seq,
                             micro_batch_size=micro_batch, create_attention_mask_in_dataloader=mask)
    return ns


def test_a_dataloader_mask_too_large_to_hold_fails_at_startup_and_patches_nothing():
    """At 64K tokens Megatron's default dataloader mask is 4 GiB per sample (its workers get killed minutes
    in): apply() names the flag, the value and the fix before anything is patched."""
    before = snapshot()
    with pytest.raises(megatron_peakflat.PeakflatConfigError) as e:
        megatron_peakflat.apply(_megatron_args(65536, True))
    assert e.value.flag == "--create-attention-mask-in-dataloader" and e.value.value is True
    assert "[1, 1, 65536, 65536]" in str(e.value) and "4.00 GiB" in str(e.value)
    assert e.value.fix.startswith("pass --no-create-attention-mask-in-dataloader")
    assert registry.applied() == [] and snapshot() == before and state.get() is None


def test_a_large_dataloader_mask_is_warned_about_and_none_is_quiet(caplog):
    """From 256 MiB per micro-batch (16K tokens) the mask is a warning naming the fix; without the mask, or
    at short context, nothing is said and the run proceeds."""
    with caplog.at_level("WARNING", logger="megatron_peakflat"):
        megatron_peakflat.apply(_megatron_args(8192, True, micro_batch=4))  # 256 MiB per micro-batch
    assert any("--no-create-attention-mask-in-dataloader" in r.getMessage() and "[4, 1, 8192, 8192]" in r.getMessage()
               for r in caplog.records), caplog.text
    assert registry.applied()
    megatron_peakflat.remove()
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron_peakflat"):
        megatron_peakflat.apply(_megatron_args(131072, False))
        megatron_peakflat.remove()
        megatron_peakflat.apply(_megatron_args(8192, True))  # 64 MiB
    assert not [r for r in caplog.records if "attention mask" in r.getMessage()], caplog.text


def test_static_methods_stay_static_and_remove_restores_the_very_descriptor():
    """CheckpointFunction.forward/backward are staticmethods: patched, they stay staticmethods (a call through an
    instance gets no self), and remove() puts back the original descriptor object, not the bare function."""
    import inspect

    from megatron.core.tensor_parallel.random import CheckpointFunction

    names = ("forward", "backward")
    before = {n: inspect.getattr_static(CheckpointFunction, n) for n in names}
    assert all(isinstance(d, staticmethod) for d in before.values())
    megatron_peakflat.apply(PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep"),
                                           general=GeneralConfig(attention="local")))
    for n in names:
        patched = inspect.getattr_static(CheckpointFunction, n)
        assert isinstance(patched, staticmethod) and patched is not before[n], n
    megatron_peakflat.remove()
    assert {n: inspect.getattr_static(CheckpointFunction, n) for n in names} == before


def test_apply_validates_a_config_object_before_patching():
    """``apply(PeakflatConfig(...))`` runs the field checks too: a bad value fails naming its flag, and nothing
    is patched."""
    before = snapshot()
    with pytest.raises(megatron_peakflat.PeakflatConfigError) as e:
        megatron_peakflat.apply(PeakflatConfig(dispatch=DispatchConfig(impl="pipelined-llep", chunk_cap=0),
                                               general=GeneralConfig(attention="local")))
    assert e.value.flag == "--peakflat-dispatch-chunk-cap"
    assert registry.applied() == [] and snapshot() == before


def test_auto_attention_patches_sdpa_only_without_transformer_engine(monkeypatch):
    """The default --peakflat-attention auto puts SDPA in Megatron's local spec when Transformer Engine is
    absent, and leaves attention alone when it is present."""
    from megatron_peakflat.integration import attention

    for te, patched in ((False, ["megatron.core.models.backends.LocalSpecProvider.core_attention"]), (True, [])):
        monkeypatch.setattr(attention, "transformer_engine_available", lambda te=te: te)
        megatron_peakflat.apply(PeakflatConfig())
        assert registry.applied() == patched, te
        megatron_peakflat.remove()


def test_a_dataloader_mask_is_left_alone_when_no_component_is_on():
    """With every component off Megatron runs unchanged: its dataloader mask at 64K tokens is not refused."""
    from tests.test_config import parse_with_megatron

    ns = parse_with_megatron("--peakflat-attention", "local", seq_length=65536, micro_batch_size=1,
                             create_attention_mask_in_dataloader=True)
    cfg = megatron_peakflat.apply(ns)
    assert not any(cfg.enabled.values()) and registry.applied() == []


def test_a_moved_class_fails_naming_it_even_for_its_dunder_methods(monkeypatch):
    """An entry like ``MoELayer.__init__`` whose class this megatron-core lacks fails at start-up naming the
    symbol (``None`` has an ``__init__`` too, so the missing class must be caught, not the missing attribute)."""
    bogus = registry.Patch("sco", "megatron.core.recompute", "NoSuchLayer.__init__",
                           "megatron_peakflat.integration.sco:wrap_checkpointed_forward", "test entry")
    monkeypatch.setattr(registry, "PATCHES", (bogus,))
    with pytest.raises(registry.PeakflatIntegrationError, match=r"megatron\.core\.recompute\.NoSuchLayer\.__init__"):
        megatron_peakflat.apply(PeakflatConfig(sco=SCOConfig(enabled=True), general=GeneralConfig(attention="local")))
    assert registry.applied() == []
