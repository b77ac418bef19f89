"""Notebook front ends (ipywidgets 8) over the Python API: `Explorer` for looking inside checkpoints,
`MapperBuilder` for composing and exporting mappers, and the planning / running panels.

Names load on first use, so `import workbench.widgets` costs nothing until a widget is built. Each
widget also renders as static HTML where no widget manager runs (GitHub, nbviewer).
"""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec
from typing import Any

_LAZY = {
    "Explorer": ("explorer", "Explorer"),
    "MapperBuilder": ("builder", "MapperBuilder"),
    "compare_to_target": ("builder", "compare_to_target"),
    "mapper_graph_figure": ("graph", "mapper_graph_figure"),
    "PlanPanel": ("plan_panel", "PlanPanel"),
    "RunPanel": ("run_panel", "RunPanel"),
}

__all__ = [name for name, (module, _) in _LAZY.items() if find_spec(f"{__name__}.{module}") is not None]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    if find_spec(f"{__name__}.{module_name}") is None:
        raise AttributeError(f"{__name__}.{name} is not available yet: module {module_name!r} is not installed in this version.")
    value = getattr(import_module(f"{__name__}.{module_name}"), attr)
    globals()[name] = value
    return value
