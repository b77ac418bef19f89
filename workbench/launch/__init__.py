"""N ranks: torchrun, the local launcher, the worker entry point, job folders, in place under torchrun.

`Launch` and `launch` are imported on first use: a one-process conversion (`launch.in_process`) never starts
worker processes, and its start-up is measured against `cp -r` (benchmarks/paired.py)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["Launch", "launch"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(import_module(".launcher", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
