"""The table of components (``megatron_peakflat.components``) is the one list: what reads the components reads
it, and a new row is picked up by the flags, the config, the planner's component rows and the peak report with
no other edit."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_peakflat import components
from megatron_peakflat.components import COMPONENTS

ROOT = Path(__file__).resolve().parents[1]


def test_names_are_unique_and_each_row_names_its_package_and_config():
    assert len(set(components.names())) == len(COMPONENTS) == 5
    for c in COMPONENTS:
        cls = c.config_class
        assert cls.__module__.startswith(f"megatron_peakflat.{c.package}."), (c.name, cls.__module__)
        assert cls.MODE_FIELD is not None and c.is_on(c.turned_on()) and not c.is_on(cls())
        assert c.meters and c.planner_terms and c.label and c.title and c.peak and c.replaces


def test_config_flags_and_enabled_follow_the_table():
    from megatron_peakflat.config import PeakflatConfig, add_args

    assert [f.name for f in dataclasses.fields(PeakflatConfig)] == [*components.names(), "general"]
    parser = add_args(argparse.ArgumentParser())
    titles = {g.title for g in parser._action_groups}
    options = {o for a in parser._actions for o in a.option_strings}
    for c in COMPONENTS:
        assert f"peakflat {c.name}: {c.title}" in titles
        assert c.switch in options
        cfg = PeakflatConfig(**{c.name: c.turned_on()})
        assert [n for n, on in cfg.enabled.items() if on] == [c.name]


def test_each_component_has_one_name_in_its_flags_help_group_and_log_lines():
    """A component's switch, knobs, --help group and log lines all carry its name (``--peakflat-optimizer``,
    ``--peakflat-optimizer-bucket``, 'peakflat optimizer: OffloadStreamAdamW', 'peakflat optimizer: ...'); its
    algorithm's name (the label) may describe it, but no flag or log line is named for it. Former spellings of the
    knobs parse, hidden from --help."""
    from megatron_peakflat.config import add_args

    parser = add_args(argparse.ArgumentParser())
    groups = {g.title: g for g in parser._action_groups}
    for c in COMPONENTS:
        cls = c.config_class
        assert cls.PREFIX == c.name and cls.MODE_FLAG == c.name, (c.name, cls.PREFIX, cls.MODE_FLAG)
        group = groups[f"peakflat {c.name}: {c.title}"]
        shown = [o for a in group._group_actions if a.help != argparse.SUPPRESS for o in a.option_strings]
        assert shown and all(o.startswith((f"--peakflat-{c.name}", f"--no-peakflat-{c.name}")) for o in shown), shown
        hidden = [o for a in group._group_actions if a.help == argparse.SUPPRESS for o in a.option_strings]
        assert bool(hidden) == bool(cls.FORMER_PREFIXES), (c.name, hidden)
        assert all(any(o.startswith(f"--peakflat-{p}-") or o.startswith(f"--no-peakflat-{p}-")
                       for p in cls.FORMER_PREFIXES) for o in hidden), (c.name, hidden)
    seconds = {c.name: [f"peakflat {n}" for n in {c.label, c.label.lower(), c.name.upper()} if n != c.name]
               for c in COMPONENTS}
    root = Path(components.__file__).parent
    said = {(c, path.relative_to(root).as_posix(), s) for path in root.rglob("*.py")
            for c, names in seconds.items() for s in names if f'"{s}:' in path.read_text() or f'"{s} (' in path.read_text()}
    assert not said, sorted(said)


def test_type_checkers_see_the_table_fields():
    """PeakflatConfig spells the table's fields out for type checkers only (``if TYPE_CHECKING``): each one it
    spells is a row, with the row's config class."""
    from megatron_peakflat import config

    tree = ast.parse(inspect.getsource(config.PeakflatConfig))
    block = next(n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    spelled = {n.target.id: ast.unparse(n.annotation) for n in block.body if isinstance(n, ast.AnnAssign)}
    assert spelled, "no fields spelled out for type checkers"
    for name, annotation in spelled.items():
        assert annotation == components.get(name).config_class.__name__, (name, annotation)


def test_every_patch_belongs_to_a_component_or_a_named_other_owner():
    from megatron_peakflat.integration.registry import OTHER_OWNERS, PATCHES

    owners = {p.component for p in PATCHES}
    assert owners <= set(components.names()) | set(OTHER_OWNERS), owners - set(components.names())
    assert set(components.names()) <= owners  # every component patches something
    assert set(OTHER_OWNERS) <= owners  # and every other owner is one


def test_planner_and_peak_report_names_follow_the_table():
    from megatron_peakflat.integration.peaks import report_name
    from megatron_peakflat.planner.model import COMPONENTS as PLANNED

    assert PLANNED == ("dispatch", "vocab", "sco", "optimizer", "tile")
    for c in COMPONENTS:  # each component-bound row, and the report's row, carries the component's name
        assert c.planner_terms == (c.name,) and c.meters == (c.name,), c
    # the rows' former names, under which a region may still be measured, report under the component's
    assert report_name("sco") == report_name("recompute") == report_name("boundaries") == "sco"
    assert report_name("tile") == report_name("attention backward") == "tile"
    assert report_name("dispatch") == "dispatch" and report_name("elsewhere") == "elsewhere"


def test_a_component_row_prints_with_its_peak_where_its_name_does_not_say_it():
    assert components.term_label("sco") == "sco (checkpoint boundaries)"
    assert components.term_label("tile") == "tile (attention working set)"
    assert [components.term_label(n) for n in ("dispatch", "vocab", "optimizer", "gradients")] == [
        "dispatch", "vocab", "optimizer", "gradients"]


def test_demo_and_auto_list_every_component():
    from megatron_peakflat.cli import demo

    assert [p[2] for p in demo.PEAKS] == list(components.names())


DUMMY = '''
import argparse, contextlib, dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from megatron_peakflat import components
from megatron_peakflat.config_base import ComponentConfig, PeakflatConfigError


@dataclass(kw_only=True)
class SketchConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "sketch"
    MODE_FIELD: ClassVar[str] = "impl"
    MODE_FLAG: ClassVar[str] = "sketch"

    impl: Literal["megatron", "sketched"] = "megatron"
    """Sketched attention."""
    sketch_rows: int = 128
    """Rows per sketch."""

    def check_against_megatron(self, args: Any) -> None:
        if self.impl != "megatron" and getattr(args, "seq_length", 0) % self.sketch_rows:
            raise PeakflatConfigError(self.flag("sketch_rows"), self.sketch_rows, "it does not divide --seq-length",
                                      "pass a divisor")


ROW = components.Component("sketch", "Sketched", "sketched attention", SketchConfig, "sketching", on="sketched",
                           planner_terms=("sketches",), meters=("sketches",), meter_aliases=("sketch",))


@contextlib.contextmanager
def registered(row):
    """The table with ``row`` added, restored afterwards (test only: before anything reads the table)."""
    saved = components.COMPONENTS
    components.COMPONENTS = (*saved, row)
    try:
        yield
    finally:
        components.COMPONENTS = saved


with registered(ROW):
    from megatron_peakflat.config import PeakflatConfig, add_args
    from megatron_peakflat.integration.peaks import report_name
    from megatron_peakflat.planner import model

    parser = add_args(argparse.ArgumentParser())
    assert "peakflat sketch: sketched attention" in {g.title for g in parser._action_groups}
    ns = parser.parse_args(["--peakflat-sketch", "sketched", "--peakflat-sketch-sketch-rows", "64"])
    cfg = PeakflatConfig.from_args(ns, validate=False)
    assert cfg.sketch == SketchConfig(impl="sketched", sketch_rows=64), cfg.sketch
    assert cfg.enabled == dict(dispatch=False, vocab=False, sco=False, optimizer=False, tile=False, sketch=True), cfg.enabled
    assert model.COMPONENTS[-1] == "sketches", model.COMPONENTS
    assert report_name("sketch") == "sketches"
    ns.seq_length = 100
    try:
        PeakflatConfig.from_args(ns)
    except PeakflatConfigError as e:
        assert e.flag == "--peakflat-sketch-sketch-rows", e
    else:
        raise AssertionError("the new component's start-up check did not run")
    ns.seq_length = 128
    PeakflatConfig.from_args(ns)
assert components.COMPONENTS[-1].name == "tile"
print("picked up")
'''


def test_a_new_row_is_picked_up_with_no_other_edit(tmp_path):
    """A dummy 'sketch' row added to the table (in a fresh process, before anything reads the table; restored after):
    its flags and --help group, its PeakflatConfig field, ``enabled``, its start-up check, the planner's component
    rows and the peak report's names."""
    script = tmp_path / "dummy_component.py"
    script.write_text(textwrap.dedent(DUMMY))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "picked up" in out.stdout, out.stderr[-3000:]
