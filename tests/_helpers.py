"""Helpers that the CPU tests (tests/) and their GPU counterparts (tests/gpu/) share: one copy each."""

from __future__ import annotations

import subprocess
from typing import Any, Mapping

import pytest

from megatron_peakflat.testing.pretrain_hooks import KILL_AT, TRACE
from megatron_peakflat.testing.subproc import run_module


def native_available() -> bool:
    """Whether the compiled extension (``megatron_peakflat._C``) loads here (built, or compiled on first use)."""
    from megatron_peakflat import _ext

    return _ext.load() is not None


def run_traced(monkeypatch: pytest.MonkeyPatch, module: str, *args: str, trace: str,
               env: Mapping[str, object] | None = None, **run: Any) -> subprocess.CompletedProcess:
    """``run_module(module, *args, **run)`` for a pretrain entry with ``testing.pretrain_hooks``' hooks, its
    trace written to ``trace``, each variable of ``env`` set (a value of None unsets it, so that an earlier
    run's value does not carry over)."""
    monkeypatch.setenv(TRACE, trace)
    for name, value in (env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    return run_module(module, *args, **run)


def run_to_kill_or_end(monkeypatch: pytest.MonkeyPatch, module: str, *args: str, trace: str,
                       kill_at: int | None, **run: Any) -> str:
    """``run_traced``, SIGKILLed inside the forward of iteration ``kill_at`` (None: run to the end); asserts
    that it exits 0 exactly when not killed and returns its output."""
    out = run_traced(monkeypatch, module, *args, trace=trace, env={KILL_AT: kill_at}, **run)
    text = out.stdout + out.stderr
    assert (out.returncode == 0) == (kill_at is None), text[-4000:]
    return text


def no_logits(*args: object, **kwargs: object) -> None:
    """Stands in for the output layer's forward where the vocabulary component must not build logits."""
    raise AssertionError("the output layer was called: logits were built")
