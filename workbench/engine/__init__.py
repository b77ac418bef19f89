"""One rank's share of a plan: read, transform, write, with progress and a measured report.

Importing it does not import torch or pandas; torch is loaded only when a step computes on tensors.
`wb.convert` (the orchestrator) lives in `workbench.conversion` and the N-rank launchers in
`workbench.launch`; their old names here still resolve, with a `DeprecationWarning`, for one release.
"""

from __future__ import annotations

import warnings
from importlib import import_module
from typing import Any

from .report import RankResult, RunReport
from .status import Cancelled

__all__ = ["Cancelled", "RankResult", "RunReport"]

_MOVED = {
    "convert": "workbench.conversion",
    "execute": "workbench.conversion",
    "run_local": "workbench.conversion",
    "Launch": "workbench.launch.launcher",
    "launch": "workbench.launch.launcher",
}


def __getattr__(name: str) -> Any:
    try:
        module_name = _MOVED[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    warnings.warn(f"workbench.engine.{name} moved to {module_name}.{name}.", DeprecationWarning, stacklevel=2)
    return getattr(import_module(module_name), name)
