"""Griffe extension for the documentation site: the public names of `workbench`, `workbench.mapper` and
`workbench.mapper.presets` as the API reference shows them.

Those packages resolve most public names on first use (a module `__getattr__` over a table), which a static
reader cannot follow. This extension imports each package, takes its public names (`__all__`, or for the
presets the registry `PRESETS` and the functions defined under the presets package) and adds each as an alias
to wherever it is defined now, so the reference pages name only public paths (`workbench.convert`,
`workbench.mapper.Sequential`) and keep working while modules move behind them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import griffe

# The checkout this site documents, ahead of any installed copy (the `mkdocs` script does not put it on sys.path).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PUBLIC_MODULES = ("workbench", "workbench.mapper", "workbench.mapper.presets")


def public_names(module: Any) -> list[str]:
    """A public module's names: its `__all__`, else (the presets) `PRESETS` and the functions defined under it."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    found = set(getattr(module, "PRESETS", {}))
    found.update(
        name for name, value in vars(module).items()
        if not name.startswith("_") and inspect.isfunction(value) and value.__module__.startswith(module.__name__)
    )
    if hasattr(module, "PRESETS"):
        found.add("PRESETS")
    return sorted(found)


def _target(value: Any) -> str | None:
    """The dotted path where `value` is defined, or None for plain values (constants)."""
    if inspect.ismodule(value):
        return value.__name__
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        return f"{module}.{qualname}"
    return None


class PublicNames(griffe.Extension):
    """Alias every public name of the public modules to its definition and mark it exported."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.path != "workbench":
            return
        for path in PUBLIC_MODULES:
            runtime = importlib.import_module(path)
            static = pkg if path == pkg.path else pkg[path[len(pkg.path) + 1:]]
            names = public_names(runtime)
            for name in names:
                if name in static.members and not static.members[name].is_alias:
                    continue
                target = _target(getattr(runtime, name))
                if target is None or target == f"{path}.{name}":
                    continue
                static.set_member(name, griffe.Alias(name, target, parent=static))
            static.exports = list(names)
            _describe_registry(static, runtime)


def _describe_registry(static: griffe.Module, runtime: Any) -> None:
    """Give the presets registry `PRESETS` (a dict under a comment, not a docstring) a docstring, so it is listed."""
    member = static.members.get("PRESETS")
    if member is not None and member.is_alias:
        member = member.final_target
    if not hasattr(runtime, "PRESETS") or member is None or member.docstring:
        return
    member.docstring = griffe.Docstring(
        "The presets front ends offer (`workbench convert --preset NAME`, `ck.suggest()`, the MapperBuilder): "
        "name under `M.presets` -> what it does, in a few words. Register a preset here to offer it everywhere.",
        parent=member,
    )
