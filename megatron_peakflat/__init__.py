"""megatron-peakflat: bounded-memory schedules for long-context MoE training on Megatron-Core.

Public surface (nothing of Megatron is imported or patched on import; each name loads its module on first use):

- ``add_args(parser)``: the ``--peakflat-*`` flags, usable as Megatron's ``extra_args_provider``;
- ``chain_args(*providers)``: one ``extra_args_provider`` of several (``add_args`` beside modelopt's);
- ``PeakflatConfig``: every knob, validated against Megatron's flags;
- ``apply(config_or_args)`` / ``remove()``: patch Megatron-Core for the enabled components and undo it;
- ``auto_argv(argv)``: resolve ``--peakflat auto`` into flags, before Megatron parses the command line.
"""

from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, _exported = lazy_exports(__name__, {
    "PeakflatConfig": ".config", "PeakflatConfigError": ".config", "add_args": ".config", "chain_args": ".config",
    "apply": ".startup", "remove": ".startup", "auto_argv": ".startup", "_attention_wanted": ".startup",
})
__all__ = [*(n for n in _exported if not n.startswith("_")), "__version__"]


def __dir__() -> list[str]:
    return sorted({*globals(), *_exported})
