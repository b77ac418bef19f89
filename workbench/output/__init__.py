"""WRITE: the output formats a conversion can produce, and the destination lock.

Each format is an `OutputFormat` (see `base.py`) registered here under the names users pass as
`to=` / `--to`; the planner lays files out through it and the engine fills and commits them through
it. Adding a format is one module defining a subclass, plus one line in `_BUILT_IN` below. Built-in
formats are imported on first use: a safetensors conversion does not pay for the GGUF, DCP and pth writers.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import PlanError
from .base import OutputFormat

_LOADED: dict[str, OutputFormat] = {}
_ALIASES: dict[str, str] = {"hf": "safetensors"}
_BUILT_IN: dict[str, tuple[str, str]] = {  # name -> (module, class), imported by `output_format`
    "safetensors": ("safetensors", "SafetensorsOutput"),
    "dcp": ("dcp", "DcpOutput"),
    "gguf": ("gguf.container", "GgufOutput"),
    "pth": ("pth", "PthOutput"),
}


def register(output: OutputFormat, *aliases: str) -> None:
    """Make `output` available as `to=output.name` (and any alias)."""
    _LOADED[output.name] = output
    for alias in aliases:
        _ALIASES[alias] = output.name


def output_format(name: str) -> OutputFormat:
    """The registered format called `name` (case-insensitive, aliases allowed); PlanError for anything else."""
    key = name.lower() if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key not in _LOADED and key in _BUILT_IN:
        _load(key)
    if key not in _LOADED:
        choices = ", ".join(f"to={n!r}" for n in sorted({*_LOADED, *_BUILT_IN, *_ALIASES}))
        raise PlanError(f"Cannot plan an output in format {name!r}: it is not an output format the workbench writes. "
                        f"Choose {choices}.")
    return _LOADED[key]


def owned(name: str) -> bool:
    """Whether a file called `name` in a destination is one some registered format writes (`OutputFormat.owns`):
    what `overwrite=True` removes as an older conversion's output. Imports every built-in format's module."""
    return any(output.owns(name) for output in __getattr__("OUTPUT_FORMATS").values())


def _load(name: str) -> None:
    module, cls = _BUILT_IN[name]
    register(getattr(importlib.import_module(f".{module}", __name__), cls)())


def __getattr__(attr: str) -> Any:
    if attr == "OUTPUT_FORMATS":  # every format by name (the built-in ones imported now)
        for name in _BUILT_IN:
            if name not in _LOADED:
                _load(name)
        return _LOADED
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["OUTPUT_FORMATS", "OutputFormat", "output_format", "owned", "register"]
