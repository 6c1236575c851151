"""``--peakflat-tile`` and ``--peakflat-tile-tokens``: parsed into ``TileConfig``, and every refusal at start-up
names the flag, the value and the fix."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from megatron_peakflat.config import PeakflatConfig, PeakflatConfigError, add_args
from megatron_peakflat.tile.bound import auto_tile_tokens
from megatron_peakflat.tile.config import TileConfig


def _parse(*argv: str) -> argparse.Namespace:
    return add_args(argparse.ArgumentParser()).parse_args(list(argv))


def _megatron(**kw) -> SimpleNamespace:
    base = dict(transformer_impl="transformer_engine", context_parallel_size=1, sequence_parallel=False,
                hidden_dropout=0.0, attention_dropout=0.0, seq_length=65536)
    base.update(kw)
    return SimpleNamespace(**base)


def _with(ns: argparse.Namespace, **megatron) -> argparse.Namespace:
    for k, v in vars(_megatron(**megatron)).items():
        setattr(ns, k, v)
    return ns


def test_flags_parse():
    cfg = PeakflatConfig.from_args(_with(_parse("--peakflat-tile", "--peakflat-tile-tokens", "16384")))
    assert cfg.tile.enabled and cfg.tile.tokens == 16384 and cfg.enabled["tile"]
    assert cfg.tile.tile_tokens(65536) == 16384
    auto = PeakflatConfig.from_args(_with(_parse("--peakflat-tile", "--peakflat-tile-tokens", "auto")))
    assert auto.tile.tokens is None and auto.tile.tile_tokens(65536) == auto_tile_tokens(65536) == 16384
    off = PeakflatConfig.from_args(_with(_parse()))
    assert not off.tile.enabled and not off.enabled["tile"]


def test_tile_tokens_must_be_positive():
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(_with(_parse("--peakflat-tile", "--peakflat-tile-tokens", "0")))
    assert e.value.flag == "--peakflat-tile-tokens" and e.value.value == 0
    assert "--peakflat-tile-tokens 16384" in e.value.fix


def test_tile_tokens_without_the_tile_is_noted(caplog):
    with caplog.at_level("WARNING", logger="megatron_peakflat"):
        PeakflatConfig.from_args(_with(_parse("--peakflat-tile-tokens", "4096")))
    assert any("--peakflat-tile-tokens=4096 has no effect" in r.message and "--peakflat-tile" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("megatron, words", [
    (dict(context_parallel_size=3, seq_length=65536), ["--context-parallel-size 3",
                                                        "pass a --seq-length that is a multiple of 6 (e.g. 65538)"]),
    (dict(sequence_parallel=True), ["--sequence-parallel", "drop --sequence-parallel"]),
    (dict(hidden_dropout=0.1), ["--hidden-dropout is 0.1", "pass --hidden-dropout 0"]),
    (dict(attention_dropout=0.1), ["--attention-dropout is 0.1", "pass --attention-dropout 0"]),
    (dict(multi_latent_attention=True), ["multi-latent", "drop --multi-latent-attention"]),
    (dict(cuda_graph_impl="local"), ["--cuda-graph-impl local", "drop --cuda-graph-impl"]),
    (dict(transformer_impl="local"), ["DotProductAttention", "pass --peakflat-attention sdpa"]),
    (dict(create_attention_mask_in_dataloader=True), ["explicit attention mask",
                                                      "pass --no-create-attention-mask-in-dataloader"]),
])
def test_refusals_name_flag_value_and_fix(megatron, words):
    argv = ["--peakflat-tile"] + (["--peakflat-attention", "local"] if megatron.get("transformer_impl") == "local"
                                  else [])
    with pytest.raises(PeakflatConfigError) as e:
        PeakflatConfig.from_args(_with(_parse(*argv), **megatron))
    assert e.value.flag == "--peakflat-tile" and e.value.value is True
    text = str(e.value)
    assert all(w in text for w in words), text
    assert text.index("Fix: ") < min(text.rindex(w) for w in words[1:]), text  # the fix is named after "Fix:"


def test_local_spec_with_sdpa_is_accepted():
    cfg = PeakflatConfig.from_args(_with(_parse("--peakflat-tile", "--peakflat-attention", "sdpa"),
                                         transformer_impl="local"))
    assert cfg.tile.enabled


def test_context_parallelism_is_accepted():
    """CP > 1 runs (tiles within each rank's two chunks) where the sequence splits into 2 x CP chunks; a tile
    never spans the two chunks of a rank."""
    cfg = PeakflatConfig.from_args(_with(_parse("--peakflat-tile", "--peakflat-tile-tokens", "16384"),
                                         context_parallel_size=4, seq_length=65536))
    assert cfg.tile.enabled
    assert cfg.tile.tile_tokens(16384, cp=4) == 8192 and cfg.tile.tile_tokens(65536, cp=2) == 16384
    assert TileConfig(tokens=None).tile_tokens(65536, cp=2) == auto_tile_tokens(65536) == 16384


def test_component_config_alone():
    TileConfig(enabled=True, tokens=1).validate()
    with pytest.raises(PeakflatConfigError):
        TileConfig(enabled=True, tokens=-3).validate()


def test_the_planners_fix_names_what_the_start_up_check_refuses():
    """One table (``PREREQUISITES``) behind both: every setting the start-up check refuses is in the planner's fix
    for a line that leaves it on (or out, at Megatron's default), and a line meeting the fix is accepted."""
    from megatron_peakflat.planner.te_limits import tile_prerequisites
    from megatron_peakflat.tile.config import PREREQUISITES

    assert tile_prerequisites(SimpleNamespace()) == [fix for _, _, _, fix, _ in PREREQUISITES]
    met = dict(create_attention_mask_in_dataloader=False)
    assert tile_prerequisites(_megatron(**met)) == []
    TileConfig(enabled=True).check_against_megatron(_megatron(**met))
    for dest, _, default, fix, _ in PREREQUISITES:
        line = _megatron(**{**met, dest: default})
        with pytest.raises(PeakflatConfigError) as e:
            TileConfig(enabled=True).check_against_megatron(line)
        assert f"pass {fix}" in str(e.value)
        assert tile_prerequisites(line) == [fix]
