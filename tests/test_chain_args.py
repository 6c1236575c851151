"""``megatron_peakflat.chain_args``: peakflat's flags beside another ``extra_args_provider`` (modelopt's, which
Megatron-LM's pretrain_gpt.py passes where modelopt is installed), through Megatron's own parser."""

from __future__ import annotations

import argparse

import pytest

import megatron_peakflat


def _modelopt_like(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Stands in for modelopt's add_modelopt_args: a group of its own flags, the parser returned."""
    group = parser.add_argument_group(title="modelopt-like")
    group.add_argument("--export-te-mcore-model", action="store_true")
    group.add_argument("--export-kd-teacher-load", type=str, default=None)
    return parser


def _returns_none(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--returns-none-flag", type=int, default=0)


def test_megatron_parses_both_providers_flags(monkeypatch):
    """Megatron's parse_args with the chained provider reads peakflat's flags and the other provider's, each
    with its value, beside Megatron's own."""
    from megatron.training.arguments import parse_args

    provider = megatron_peakflat.chain_args(megatron_peakflat.add_args, _modelopt_like)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--peakflat-vocab", "ring-dtp", "--export-te-mcore-model",
                                     "--export-kd-teacher-load", "/ckpt/teacher", "--lr", "1e-4"])
    args = parse_args(provider)
    assert args.peakflat_vocab_impl == "ring-dtp"
    assert args.export_te_mcore_model is True and args.export_kd_teacher_load == "/ckpt/teacher"
    assert args.lr == 1e-4
    assert megatron_peakflat.PeakflatConfig.from_args(args, validate=False).vocab.impl == "ring-dtp"


def test_none_is_skipped_and_a_provider_returning_none_still_chains():
    """``add_modelopt_args if has_nvidia_modelopt else None`` can be passed as it is; a provider that returns
    None instead of the parser does not break the chain."""
    parser = argparse.ArgumentParser()
    out = megatron_peakflat.chain_args(None, _returns_none, megatron_peakflat.add_args)(parser)
    assert out is parser
    ns = parser.parse_args(["--returns-none-flag", "3", "--peakflat-sco"])
    assert ns.returns_none_flag == 3 and ns.peakflat_sco_enabled is True


def test_the_order_is_kept_and_a_clash_is_argparses_error():
    """Providers run in the order given; two providers adding one flag fail as argparse fails, not silently."""
    calls: list[str] = []

    def first(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        calls.append("first")
        p.add_argument("--same")
        return p

    def second(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        calls.append("second")
        p.add_argument("--same")
        return p

    with pytest.raises(argparse.ArgumentError, match="--same"):
        megatron_peakflat.chain_args(first, second)(argparse.ArgumentParser())
    assert calls == ["first", "second"]


def test_a_non_callable_is_refused_when_chained():
    with pytest.raises(TypeError, match="not an extra_args_provider"):
        megatron_peakflat.chain_args(megatron_peakflat.add_args, "add_modelopt_args")
