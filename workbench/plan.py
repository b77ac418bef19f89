"""`wb.plan(...)` and `Plan`: the dry-run of a conversion (see `workbench.planning`).

The module itself is callable, so `workbench.plan(...)` works even after `import workbench.plan`
has made the package attribute point at this module instead of the function.
"""

from __future__ import annotations

import sys
import types

from .planning import Plan, PlanOptions, format_bytes, parse_size, plan

__all__ = ["Plan", "PlanOptions", "format_bytes", "parse_size", "plan"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
