"""Machinery shared by every component's config: field docs, size parsing, flag derivation, errors.

A component config is a keyword-only dataclass whose fields carry a docstring on the line below
them (Megatron's habit). ``field_docs`` reads those docstrings from the source once, so that the
``--peakflat-*`` flags and their help text are derived from the dataclass and never written twice.

No Megatron import here: the components import this module.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import math
import os
import re
import sys
import textwrap
import types
import typing
from functools import cache
from typing import Any, Callable, Literal, get_args, get_origin

__all__ = [
    "PeakflatConfigError",
    "Bytes",
    "Count",
    "parse_size",
    "parse_count",
    "format_bytes",
    "field_docs",
    "flag_name",
    "former_flags",
    "shown_default",
    "ComponentConfig",
    "megatron_arg",
    "cuda_graph_flag",
]


class PeakflatConfigError(ValueError):
    """A bad flag value or combination. The message names the flag, the value (``None``: a flag that is missing
    or takes none) and the fix."""

    def __init__(self, flag: str, value: Any, problem: str, fix: str) -> None:
        self.flag, self.value, self.problem, self.fix = flag, value, problem, fix
        super().__init__(f"{flag}{'' if value is None else f'={value!r}'}: {problem}. Fix: {fix}")


class Bytes(int):
    """Annotation marker: a byte count, given on the command line as ``16GiB``, ``512MiB``, ``1e9``."""


class Count(int):
    """Annotation marker: a count, given as ``100M``, ``2.5B``, ``50k`` or a plain integer."""


_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUM_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse(text: str | int | float, units: dict[str, int], what: str) -> int:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _NUM_RE.match(str(text))
        if not m:
            raise ValueError(f"{text!r} is not a {what} (examples: {', '.join(_EXAMPLES[what])})")
        value, unit = float(m.group(1)), m.group(2).lower()
    if unit not in units:
        raise ValueError(f"{text!r}: unknown unit {unit!r} for a {what}; use one of {sorted(k for k in units if k)}")
    if not math.isfinite(value * units[unit]):
        raise ValueError(f"{text!r} is not a finite {what}")
    n = int(round(value * units[unit]))
    if n == 0 and value != 0:
        raise ValueError(f"{text!r} rounds to 0 (examples: {', '.join(_EXAMPLES[what])})")
    return n


_EXAMPLES = {"size": ["16GiB", "512MiB", "2e9"], "count": ["100M", "2.5B", "50k"]}


def parse_size(text: str | int | float) -> int:
    """Parse a byte size. Binary units (KiB, MiB, GiB, TiB) and decimal ones (KB, MB, GB, TB)."""
    return _parse(text, _BYTE_UNITS, "size")


def parse_count(text: str | int | float) -> int:
    """Parse a count with an optional k/M/B/T suffix (decimal)."""
    return _parse(text, _COUNT_UNITS, "count")


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``3.12 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each dataclass field of ``cls`` (and its bases) to the docstring written below it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_name(cfg_cls: type["ComponentConfig"], field: str) -> str:
    """The command-line flag of one field: the mode field gets the bare component flag."""
    if field == cfg_cls.MODE_FIELD:
        return f"--peakflat-{cfg_cls.MODE_FLAG}"
    return _spelt(cfg_cls.PREFIX, field)


def _spelt(prefix: str, field: str) -> str:
    """``--peakflat-<prefix>-<field>`` (``--peakflat-<field>`` without a prefix), underscores as dashes."""
    return f"--peakflat-{prefix}-{field.replace('_', '-')}" if prefix else f"--peakflat-{field.replace('_', '-')}"


def former_flags(cfg_cls: type["ComponentConfig"]) -> dict[str, str]:
    """``{former spelling: flag}`` for every field of ``cfg_cls`` but its mode field, one entry per name in
    ``FORMER_PREFIXES`` (``--peakflat-opt-bucket`` -> ``--peakflat-optimizer-bucket``)."""
    out: dict[str, str] = {}
    for old in cfg_cls.FORMER_PREFIXES:
        for f in dataclasses.fields(cfg_cls):
            if f.name != cfg_cls.MODE_FIELD:
                out[_spelt(old, f.name)] = flag_name(cfg_cls, f.name)
    return out


_log = logging.getLogger("megatron_peakflat")
_warned_former: set[str] = set()


def _rank_zero() -> bool:
    """Whether this process is rank 0: torch.distributed's rank where it is already initialised (torch is not
    imported for it), else torchrun's RANK. Flags are parsed before Megatron sets up its process groups."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
        return int(os.environ.get("RANK", "0") or 0) == 0
    except (ValueError, RuntimeError):
        return True


def warn_former_flag(former: str, flag: str) -> None:
    """Log, once per former flag and process and from rank 0, that ``former`` is an earlier spelling of ``flag``
    (``--no-x`` counts as ``--x``)."""
    key = "--" + former[len("--no-"):] if former.startswith("--no-") else former
    if key in _warned_former:
        return
    _warned_former.add(key)
    if _rank_zero():
        _log.warning("peakflat: %s is deprecated: it is now spelt %s, and the old spelling will be removed. Fix: "
                     "write %s", former, flag, flag)


@cache
def _former_action(action: type[argparse.Action]) -> type[argparse.Action]:
    """``action`` for a former spelling of a flag: it logs ``warn_former_flag`` naming the current flag
    (``current``, set on the action by ``add_flags``), then acts as ``action`` does, on the same dest."""

    class Former(action):  # type: ignore[valid-type,misc]
        current: str = ""

        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:
            said = option_string or self.option_strings[0]
            now = "--no-" + self.current[2:] if said.startswith("--no-") else self.current
            warn_former_flag(said, now)
            super().__call__(parser, namespace, values, option_string)

    Former.__name__ = Former.__qualname__ = f"Former{action.__name__}"
    return Former


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default value, from ``default`` or a fresh one from ``default_factory``."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(tp, False)``."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


@dataclasses.dataclass(kw_only=True)
class ComponentConfig:
    """Base of every component config.

    Subclasses set ``PREFIX`` (flags are ``--peakflat-<PREFIX>-<field>``), and optionally
    ``MODE_FIELD``/``MODE_FLAG`` for the field that switches the component on
    (``--peakflat-<MODE_FLAG>``). ``validate()`` raises PeakflatConfigError.
    """

    PREFIX: typing.ClassVar[str] = ""
    MODE_FIELD: typing.ClassVar[str | None] = None
    MODE_FLAG: typing.ClassVar[str] = ""
    FORMER_PREFIXES: typing.ClassVar[tuple[str, ...]] = ()
    """Earlier spellings of ``PREFIX``: each ``--peakflat-<former>-<field>`` still parses, into the same dest, as
    an alias hidden from --help that logs one deprecation warning per flag and process, naming the current flag."""

    def validate(self) -> None:
        """Check field values on their own. Cross-component checks live in config.py."""

    def check_against_megatron(self, args: Any) -> None:
        """Refuse, at start-up, Megatron flags that this part cannot run beside (``PeakflatConfigError`` naming the
        flag and the fix). ``args``: Megatron's parsed args, read as a plain namespace (``megatron_arg``); a
        component that is off usually has nothing to check. Run by ``PeakflatConfig.validate(args)``."""

    def flag(self, field: str) -> str:
        return flag_name(type(self), field)

    @classmethod
    def add_flags(cls, group: Any) -> None:
        """Add one argparse option per field to ``group``; ``dest`` is ``peakflat_<prefix>_<field>``."""
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            tp, optional = _unwrap_optional(hints[f.name])
            default = field_default(f)
            if isinstance(default, (Bytes, Count)):
                # Megatron saves args in its checkpoints and torch.load(weights_only=True) refuses our classes
                default = int(default)
            kw: dict[str, Any] = {"dest": cls.dest(f.name), "default": default}
            help_text = docs.get(f.name, "")
            if tp is bool:
                kw["action"] = Switch
            elif get_origin(tp) is Literal:
                kw["choices"] = list(get_args(tp))
                kw["type"] = type(get_args(tp)[0])
            elif tp in _PARSERS:
                parse, kw["metavar"] = _PARSERS[tp]
                kw["type"] = _or_auto(parse, optional)
                if optional:
                    kw["metavar"] += "|auto"
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: unsupported flag type {tp}")
            if optional:
                help_text += " ('auto' or omitted: chosen at start-up.)"
            kw["help"] = f"{help_text} (default: {shown_default(default)})".replace("%", "%%")
            action = group.add_argument(flag_name(cls, f.name), **kw)
            if f.name == cls.MODE_FIELD:
                continue
            for old in cls.FORMER_PREFIXES:
                alias = group.add_argument(_spelt(old, f.name),
                                           **{**kw, "action": _former_action(kw.get("action", action.__class__)),
                                              "help": argparse.SUPPRESS, "default": argparse.SUPPRESS})
                alias.current = flag_name(cls, f.name)

    def unused_flag_notes(self) -> list[str]:
        """One warning per sub-flag set away from its default while the component is off (the mode field at its
        default): such a flag changes nothing, and a user who passed it most likely meant the component on."""
        if self.MODE_FIELD is None:
            return []
        mode = next(f for f in dataclasses.fields(self) if f.name == self.MODE_FIELD)
        if getattr(self, mode.name) != mode.default:
            return []
        hints = typing.get_type_hints(type(self))
        tp, _ = _unwrap_optional(hints[mode.name])
        if tp is bool:
            turn_on, now = self.flag(mode.name), f"{self.flag(mode.name)} is not set"
        else:
            on = next(c for c in get_args(tp) if c != mode.default)
            turn_on, now = f"{self.flag(mode.name)} {on}", f"{self.flag(mode.name)} is {mode.default!r}"
        notes = []
        for f in dataclasses.fields(self):
            if f.name == mode.name:
                continue
            default = field_default(f)
            value = getattr(self, f.name)
            if value != default:
                shown = format_bytes(value) if _unwrap_optional(hints[f.name])[0] is Bytes else shown_default(value)
                notes.append(f"peakflat: {self.flag(f.name)}={shown} has no effect: {now}, so the "
                             f"component is off. Fix: add {turn_on}, or drop {self.flag(f.name)}")
        return notes

    @classmethod
    def dest(cls, field: str) -> str:
        return "peakflat_" + ((cls.PREFIX + "_") if cls.PREFIX else "") + field

    @classmethod
    def from_namespace(cls, ns: Any) -> "ComponentConfig":
        """Build from an argparse namespace made by ``add_flags`` (missing dests keep defaults)."""
        kw = {}
        for f in dataclasses.fields(cls):
            d = cls.dest(f.name)
            if hasattr(ns, d):
                kw[f.name] = getattr(ns, d)
        return cls(**kw)


def megatron_arg(args: Any, name: str, default: Any = None) -> Any:
    """Megatron's parsed flag ``name`` (its dest) from ``args``, a plain namespace; ``default`` where it has none."""
    return getattr(args, name, default)


def cuda_graph_flag(args: Any) -> str:
    """The Megatron flag that captures the layers in CUDA graphs, as the user wrote it, or ''. ``args``: Megatron's
    parsed args or its TransformerConfig (the same two fields)."""
    impl = megatron_arg(args, "cuda_graph_impl", "none") or "none"
    if impl != "none":
        return f"--cuda-graph-impl {impl}"
    return "--enable-cuda-graph" if megatron_arg(args, "enable_cuda_graph") else ""


class Switch(argparse.BooleanOptionalAction):
    """``--x`` turns it on and ``--no-x`` off, as ``BooleanOptionalAction``; a value given to it (``--x=false``,
    ``--x yes``) is read when it says on or off and refused by name otherwise. Plain argparse would answer
    "ignored explicit argument" or "unrecognized arguments", naming neither the value's meaning nor the fix."""

    ON, OFF = ("true", "yes", "on", "1"), ("false", "no", "off", "0")

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.nargs = "?"
        self.metavar = "on|off"

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        negative = bool(option_string) and option_string.startswith("--no-")
        if values is None:
            setattr(namespace, self.dest, not negative)
            return
        text = str(values).strip().lower()
        on, off = self.option_strings[0], self.option_strings[-1]
        if negative:
            raise argparse.ArgumentError(self, f"{off} takes no value ({values!r}). Fix: pass {off} alone to turn it "
                                               f"off, or {on} alone to turn it on")
        if text not in self.ON + self.OFF:
            raise argparse.ArgumentError(self, f"{values!r} is not on or off. Fix: pass {on} alone to turn it on, "
                                               f"or {off} to turn it off")
        setattr(namespace, self.dest, text in self.ON)


_DASH_VALUE = re.compile(r"-[\d.]")


def read_dash_values(parser: argparse.ArgumentParser, prefix: str = "--peakflat-") -> None:
    """Let ``parser``'s value-taking flags that start with ``prefix`` take a value that starts with '-' and a digit
    or '.' (``--peakflat-sco-budget -1GiB``), as they take it written with '='.

    argparse reads such a word as a flag unless it is a plain negative number, and answers "expected one
    argument", naming neither the value nor the fix. Joined to its flag, the value meets the flag's own checks,
    which name both. Words after a bare ``--`` are left as they are."""
    options = {o for a in parser._actions if a.nargs is None for o in a.option_strings if o.startswith(prefix)}
    original = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        out: list[str] = []
        i = 0
        while i < len(argv):
            word = argv[i]
            if word == "--":
                out += argv[i:]
                break
            if word in options and i + 1 < len(argv) and _DASH_VALUE.match(argv[i + 1]):
                out.append(f"{word}={argv[i + 1]}")
                i += 2
                continue
            out.append(word)
            i += 1
        return original(out, namespace)

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def shown_default(default: Any) -> Any:
    """A flag's default as help and the README show it: None is an optional field's 'auto'."""
    return "auto" if default is None else default


def _or_auto(parse: Callable[[str], Any], optional: bool) -> Callable[[str], Any]:
    """An argparse ``type``: ``parse``, plus 'auto'/'none' -> None for optional fields."""

    def convert(text: str) -> Any:
        if optional and str(text).lower() in ("auto", "none"):
            return None
        try:
            return parse(text)
        except ValueError as e:  # argparse prints this after the flag's name
            kind = {int: "an integer", float: "a number"}.get(parse, "")
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}" if kind else str(e)) from None

    return convert


_PARSERS: dict[type, tuple[Callable[[str], Any], str]] = {
    Bytes: (parse_size, "SIZE"),
    Count: (parse_count, "N"),
    int: (int, "INT"),
    float: (float, "FLOAT"),
    str: (str, "STR"),
}
