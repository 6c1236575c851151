"""The components of megatron-peakflat: one row each, the one place that lists them.

Everything that goes over the components reads this table: the ``--peakflat-*`` flags and their --help groups,
``PeakflatConfig``'s fields and ``enabled``, the start-up checks against Megatron's flags (each config class's
``check_against_megatron``), the patch registry's owners, the planner's component rows, the recommendation's
flags, ``--peakflat auto``'s table, the runtime peak report and the demo. Adding a component is its package (an
algorithm package holding a ``config.py`` with a ``ComponentConfig``) plus one row here.

Light on purpose: no Megatron, no planner, and no config class is imported until a row's ``config_class`` is
first read.
"""

from __future__ import annotations

import dataclasses
import importlib
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config_base import ComponentConfig

__all__ = ["Component", "COMPONENTS", "names", "get", "planner_terms", "meter_names", "term_label"]


@dataclasses.dataclass(frozen=True)
class Component:
    """One component: how it is named, configured, turned on, planned and measured."""

    name: str
    """The one name everywhere: ``PeakflatConfig``'s field, ``enabled``'s key, the registry's ``Patch.component``."""
    label: str
    """What tables and messages call its algorithm (``PipelinedLLEP``); its log lines begin ``peakflat <name>:``."""
    title: str
    """Its --help group's heading, after 'peakflat <name>: '."""
    config: str | type
    """Its config class (a ``config_base.ComponentConfig``), or its ``module:Class`` path, imported on first use."""
    package: str
    """Its algorithm package under ``megatron_peakflat/``: it never imports Megatron, the planner or integration/."""
    on: Any
    """The value of the config's mode field (``MODE_FIELD``, the ``--peakflat-<MODE_FLAG>`` switch) that turns it on."""
    planner_terms: tuple[str, ...] = ()
    """The planner's rows that it bounds (``planner.model``), named for it: ``(name,)``."""
    off_term_is_baseline: bool = True
    """Whether the planner sets its rows' peakflat column to Megatron's baseline while it is off (the optimizer row
    decides that itself: the output layer's EP shard changes Megatron's optimizer too)."""
    meters: tuple[str, ...] = ()
    """The names it measures under in ``runtime.meter`` and reports under in the runtime peak report (a planner row's
    name, so the report sets the prediction beside it)."""
    meter_aliases: tuple[str, ...] = ()
    """Other names a region of it may be measured under, reported as ``meters[0]`` (its planner rows' former
    names among them: ``boundaries`` for SCO, ``attention backward`` for the tile)."""
    peak: str = ""
    """The memory peak it bounds, in the demo's table, and beside its planner row's name where the name alone does
    not say it (``term_label``)."""
    replaces: str = ""
    """The Megatron part whose peak that is, in the demo's table."""

    @cached_property
    def config_class(self) -> type["ComponentConfig"]:
        """The config class, imported on first use."""
        if isinstance(self.config, type):
            return self.config
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def switch(self) -> str:
        """The flag that turns it on (``--peakflat-dispatch``)."""
        from .config_base import flag_name

        cls = self.config_class
        assert cls.MODE_FIELD is not None, f"{cls.__name__} has no MODE_FIELD"
        return flag_name(cls, cls.MODE_FIELD)

    def is_on(self, cfg: "ComponentConfig") -> bool:
        """Whether ``cfg`` (this component's config) turns it on: its mode field away from the default (off)."""
        mode = self.config_class.MODE_FIELD
        default = next(f for f in dataclasses.fields(cfg) if f.name == mode).default
        return getattr(cfg, mode) != default

    def turned_on(self, cfg: "ComponentConfig | None" = None) -> "ComponentConfig":
        """``cfg`` (default: the defaults) with this component on."""
        return dataclasses.replace(cfg if cfg is not None else self.config_class(),
                                   **{self.config_class.MODE_FIELD: self.on})


COMPONENTS: tuple[Component, ...] = (
    Component("dispatch", "PipelinedLLEP", "PipelinedLLEP expert dispatch",
              "megatron_peakflat.dispatch.config:DispatchConfig", "dispatch", on="pipelined-llep",
              planner_terms=("dispatch",), meters=("dispatch",),
              peak="expert dispatch", replaces="MoELayer alltoall dispatcher"),
    Component("vocab", "Ring-DTP", "Ring-DTP vocabulary projection",
              "megatron_peakflat.vocab.config:VocabConfig", "vocab", on="ring-dtp",
              planner_terms=("vocab",), meters=("vocab",),
              peak="vocabulary projection", replaces="output layer + cross-entropy"),
    Component("sco", "SCO", "SCO checkpoint-boundary offload",
              "megatron_peakflat.sco.config:SCOConfig", "sco", on=True,
              planner_terms=("sco",), meters=("sco",), meter_aliases=("boundaries", "recompute"),
              peak="checkpoint boundaries", replaces="full-recompute boundary inputs"),
    Component("optimizer", "OffloadStreamAdamW", "OffloadStreamAdamW",
              "megatron_peakflat.optimizer.config:OptimizerConfig", "optimizer", on="offload-stream",
              planner_terms=("optimizer",), off_term_is_baseline=False, meters=("optimizer",),
              peak="optimizer state", replaces="Adam state on the GPU / HybridDeviceOptimizer"),
    Component("tile", "TiledAttention", "tiled attention sublayer",
              "megatron_peakflat.tile.config:TileConfig", "tile", on=True,
              planner_terms=("tile",), meters=("tile",), meter_aliases=("attention backward",),
              peak="attention working set", replaces="attention sublayer over the whole sequence"),
)
"""Every component, in the order flags, tables and logs list them."""


def names() -> tuple[str, ...]:
    """The components' names, in table order."""
    return tuple(c.name for c in COMPONENTS)


def get(name: str) -> Component:
    """The row named ``name``; KeyError naming the known ones otherwise."""
    for c in COMPONENTS:
        if c.name == name:
            return c
    raise KeyError(f"no component {name!r}; the components are {', '.join(names())}")


def planner_terms() -> tuple[str, ...]:
    """The planner rows that some component bounds, in table order."""
    return tuple(t for c in COMPONENTS for t in c.planner_terms)


def term_label(term: str) -> str:
    """A planner row as tables and messages print it: a component's row (named for the component) with the peak it
    bounds beside the name where the name does not already say it (``sco (checkpoint boundaries)``; ``dispatch``
    stays ``dispatch``); any other row as it is."""
    for c in COMPONENTS:
        if term in c.planner_terms and c.peak and c.name not in c.peak:
            return f"{term} ({c.peak})"
    return term


def meter_names() -> dict[str, str]:
    """Every name a component is measured under -> the name the peak report shows it under (its first meter)."""
    out: dict[str, str] = {}
    for c in COMPONENTS:
        for m in (*c.meters, *c.meter_aliases):
            out[m] = c.meters[0]
    return out
