"""``environment(values)``: environment variables set for a block, then restored as they were."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["environment"]


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the block (processes spawned in it inherit them), then as it was:
    a variable that was unset is unset again."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
