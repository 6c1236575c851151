"""Megatron-Core's versions live in ``integration/compat.py``: the install requirement, the Makefile's pin and the
messages that name a version agree with it, and the planner's copy of Megatron's defaults agrees with the installed
megatron-core's parser."""

from __future__ import annotations

import argparse
import re
import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megatron_peakflat.integration import compat

ROOT = Path(__file__).resolve().parents[1]


def test_the_install_requirement_is_compats():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    mcore = [d for d in deps if Requirement(d).name == "megatron-core"]
    assert mcore == [compat.REQUIREMENT]
    spec = Requirement(compat.REQUIREMENT).specifier
    assert all(v in spec for v in compat.CHECKED_ON), (spec, compat.CHECKED_ON)


def test_the_makefile_pins_a_checked_release():
    pin = re.search(r"^MCORE_SPEC \?= megatron-core==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin and pin.group(1) in compat.CHECKED_ON, pin


def test_pip_spec_and_checked_since():
    assert compat.pip_spec() == f"'{compat.REQUIREMENT}'"
    assert compat.pip_spec((0, 19)) == "'megatron-core>=0.19,<0.20'"
    assert compat.checked_since((0, 19)) == ("0.19.2",)
    assert compat.version_tuple("0.19.2rc1") == (0, 19, 2) and compat.version_tuple("0.18.2+cu130") == (0, 18, 2)


def test_no_version_literal_outside_compat():
    """The modules that used to write a megatron-core range or release themselves now ask compat."""
    for rel in ("check.py", "pretrain.py", "config.py", "integration/registry.py", "integration/sco.py"):
        text = (ROOT / "megatron_peakflat" / rel).read_text()
        assert not re.search(r"[<>=]=?\s*0\.(1[89]|20)\b|CHECKED_ON = ", text), rel


def test_the_planners_megatron_defaults_are_megatrons():
    """``MEGATRON_DEFAULTS`` copies the defaults of a few Megatron flags that start-up checks read: they must be what
    the installed megatron-core's parser gives an empty command line (on CPU, no process group)."""
    from megatron_peakflat.planner.megatron_args import MEGATRON_DEFAULTS

    arguments = pytest.importorskip("megatron.training.arguments")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, add in vars(arguments).items():
            if name.startswith("_add_") and name.endswith("_args"):
                add(parser)
    ns = parser.parse_args([])
    assert {k: getattr(ns, k) for k in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS
