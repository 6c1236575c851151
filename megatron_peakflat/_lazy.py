"""Lazy package exports (PEP 562), so that importing a component's config (the flags) costs no torch import."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """Return ``(__getattr__, __all__)`` for ``package``: each name loads from its submodule on first use."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, list(exports)
