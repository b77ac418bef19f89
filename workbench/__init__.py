"""Checkpoint Workbench: look inside PyTorch checkpoints without loading them, describe layout
conversions as small graphs of tensor operations, see what a conversion costs before running it,
and run it with bounded memory on one process or many.

`import workbench` stays cheap (no torch import): names are resolved on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    CastOverflowError,
    CastOverflowWarning,
    CheckpointError,
    MapperError,
    PlanError,
    WorkbenchError,
)

_LAZY = {
    "open_checkpoint": ("workbench.explore.checkpoint", "open_checkpoint"),
    "Checkpoint": ("workbench.explore.checkpoint", "Checkpoint"),
    "Catalog": ("workbench.catalog", "Catalog"),
    "TensorInfo": ("workbench.catalog", "TensorInfo"),
    "plan": ("workbench.planning", "plan"),
    "Plan": ("workbench.planning", "Plan"),
    "convert": ("workbench.conversion", "convert"),
    "merge_config": ("workbench.mergekit_config", "merge_config"),
    "lightning_to_hf": ("workbench.training.extract", "lightning_to_hf"),
    "lightning_matching": ("workbench.training.extract", "lightning_matching"),
    "mapper": ("workbench.mapper", None),
    "load_into": ("workbench.model_io", "load_into"),
    "save_from": ("workbench.model_io", "save_from"),
}

__all__ = ["CastOverflowError", "CastOverflowWarning", "CheckpointError", "MapperError", "PlanError", "WorkbenchError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}") from None
    module = import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
