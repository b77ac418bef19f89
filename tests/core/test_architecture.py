"""The package's shape: imports run with the flow (formats -> catalog -> mapper (the algebra, then its presets) ->
planning -> engine -> launch -> front ends), no two parts import each other (directly or through others), and every
module imports cleanly."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "workbench"

# part -> parts it must never import (directly, at any depth of the module, lazily or not). `mapper.presets` (the
# family presets) is a part of its own: presets build on the algebra (the rest of `mapper/`), which never imports them.
_ABOVE_MAPPER = {"planning", "engine", "launch", "output", "explore", "training", "model_io", "widgets", "cli", "conversion"}
_VOCABULARY_NEVER = {"formats", "mapper", "mapper.presets", "planning", "engine", "launch", "output", "explore", "widgets", "cli"}
NEVER = {
    "formats": {"mapper", "mapper.presets", "planning", "engine", "launch", "output", "explore", "training", "model_io", "widgets",
                "cli", "conversion"},
    "output": {"mapper", "mapper.presets", "planning", "engine", "launch", "explore", "training", "model_io", "widgets", "cli",
               "conversion"},
    "mapper": _ABOVE_MAPPER | {"mapper.presets"},
    "mapper.presets": _ABOVE_MAPPER,
    "planning": {"engine", "launch", "explore", "training", "model_io", "widgets", "cli", "conversion"},
    "engine": {"launch", "explore", "training", "model_io", "widgets", "cli", "conversion"},
    "launch": {"widgets", "cli", "training", "model_io", "explore"},
    "explore": {"engine", "launch", "widgets", "cli", "conversion", "model_io", "training"},
    "training": {"launch", "widgets", "cli", "explore", "model_io"},
    "model_io": {"widgets", "cli", "launch"},
    "catalog": _VOCABULARY_NEVER,
    "dtypes": _VOCABULARY_NEVER,
    "errors": _VOCABULARY_NEVER,
    "names": _VOCABULARY_NEVER,
    "display": _VOCABULARY_NEVER,
    "module_state": _VOCABULARY_NEVER | {"model_io", "training", "conversion"},
}


def _part(module: str) -> str:
    parts = module.split(".")
    if parts[1:3] == ["mapper", "presets"]:
        return "mapper.presets"
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> set[str]:
    """Absolute names of the workbench modules a file imports, relative imports resolved."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "workbench":
                found.update(f"workbench.{alias.name}" for alias in node.names)
            elif module.startswith("workbench."):
                found.add(module)
                # `from . import presets`: a submodule named as an imported name
                found.update(f"{module}.{alias.name}" for alias in node.names if _is_module(f"{module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("workbench."))
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _part("workbench." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for module in _imports(path):
            if _part(module) in NEVER.get(here, ()):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    return bad


def test_imports_run_with_the_flow() -> None:
    assert _violations() == []


def test_the_check_sees_a_wrong_way_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "workbench"
    (fake / "formats").mkdir(parents=True)
    (fake / "formats" / "bad.py").write_text("from ..planning.model import Plan\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _violations() == ["workbench/formats/bad.py imports workbench.planning.model"]


def test_the_check_sees_the_algebra_import_a_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mapper/` is the algebra; the family presets build on it from `mapper/presets/`, never the other way."""
    fake = tmp_path / "workbench"
    (fake / "mapper" / "presets").mkdir(parents=True)
    (fake / "mapper" / "presets" / "__init__.py").write_text("")
    (fake / "mapper" / "presets" / "megatron.py").write_text("from ..bind import bind\nfrom ..ops import Rename\n")
    (fake / "mapper" / "bind.py").write_text("def bind():\n    from .presets.megatron import megatron_merge\n")
    (fake / "mapper" / "ops.py").write_text("from . import presets\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _violations() == ["workbench/mapper/bind.py imports workbench.mapper.presets.megatron",
                             "workbench/mapper/ops.py imports workbench.mapper.presets"]


def test_no_algebra_module_imports_a_preset() -> None:
    assert [v for v in _violations() if v.startswith("workbench/mapper/") and not v.startswith("workbench/mapper/presets/")] == []
    assert _part("workbench.mapper.presets.megatron") == "mapper.presets" and "mapper.presets" in NEVER["mapper"]


def _package_cycles() -> list[list[str]]:
    """Cycles in the graph of parts (`formats`, `planning`, `conversion` ...): part -> parts its modules import, at
    module level or inside a function. Each cycle as its parts in import order, starting from the smallest name."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _part("workbench." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if here == "__init__":  # the facade (`wb.*`, lazy) imports everything
            continue
        graph.setdefault(here, set()).update(p for p in map(_part, _imports(path)) if p and p != here)
    cycles: set[tuple[str, ...]] = set()

    def walk(part: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(part, ())):
            if nxt in trail:
                cycle = trail[trail.index(nxt):]
                start = cycle.index(min(cycle))
                cycles.add(tuple(cycle[start:] + cycle[:start]))
            elif nxt > trail[0]:  # each cycle found once, from its smallest part
                walk(nxt, [*trail, nxt])

    for part in sorted(graph):
        walk(part, [part])
    return sorted(map(list, cycles))


def test_no_two_packages_import_each_other() -> None:
    """The flow is a direction: a part that imports another is never imported back by it, through any detour."""
    assert _package_cycles() == []


def test_the_check_sees_a_cycle_between_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "workbench"
    for part in ("widgets", "launch"):
        (fake / part).mkdir(parents=True)
    (fake / "conversion.py").write_text("def run():\n    from .widgets.panel import show\n")
    (fake / "widgets" / "panel.py").write_text("from ..launch.here import run_local\n")
    (fake / "launch" / "here.py").write_text("from ..conversion import run\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _package_cycles() == [["conversion", "widgets", "launch"]]


def _module_cycles(folder: str) -> list[list[str]]:
    """Circles among the modules of one part (`planning` ...): module -> modules of the part it imports, lazily or
    not; imports for annotations only (under `TYPE_CHECKING`) do not run and do not count."""
    root = PACKAGE / folder
    names = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        hidden = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                  for n in ast.walk(node)}
        found = graph.setdefault(path.stem, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and id(node) not in hidden:
                found.update([node.module] if node.module else [a.name for a in node.names if a.name in names])
        found &= names - {path.stem}
    cycles: set[tuple[str, ...]] = set()

    def walk(module: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(module, ())):
            if nxt == trail[0]:
                cycles.add(tuple(trail))
            elif nxt not in trail and nxt > trail[0]:
                walk(nxt, [*trail, nxt])

    for module in sorted(graph):
        walk(module, [module])
    return sorted(map(list, cycles))


def test_planning_modules_import_each_other_without_a_circle() -> None:
    """Runs, schedule, layout and the plan build on each other in one direction (runs -> schedule, never back)."""
    assert _module_cycles("planning") == []


def test_presets_import_each_other_without_a_circle() -> None:
    """The family presets build on shared layouts in one direction (megatron, quantized -> layouts, never back)."""
    assert _module_cycles("mapper/presets") == []


def test_the_engine_runs_steps_by_kind_not_by_planning_classes() -> None:
    """The schedule's steps say what they are (`Step.kind`, `Step.run`); the engine never imports the planner's
    run classes to ask a group's type."""
    from workbench.engine.steps import RUNNERS
    from workbench.planning.schedule import CAST, COPY

    assert {COPY, CAST} <= set(RUNNERS)
    assert [str(p.relative_to(PACKAGE.parent)) for p in sorted((PACKAGE / "engine").rglob("*.py"))
            if "workbench.planning.runs" in _imports(p)] == []


def test_every_module_imports_without_deprecated_paths() -> None:
    names = sorted(
        "workbench." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for p in PACKAGE.rglob("*.py") if p.name != "__main__.py"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in names:
            importlib.import_module(name.removesuffix(".__init__"))


def test_every_relative_import_names_a_module_that_exists() -> None:
    """Imports inside functions run late: one left pointing at a module's old place would fail only there."""
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = list(path.relative_to(PACKAGE.parent).parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = PACKAGE.parent.joinpath(*base, *(node.module.split(".") if node.module else []))
                if not (target.with_suffix(".py").exists() or (target / "__init__.py").exists()):
                    broken.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert broken == []


def test_public_entry_points_type_their_closed_choices_and_show_an_example() -> None:
    import typing

    import workbench as wb
    from workbench.conversion import execute
    from workbench.mapper import check_target

    entry_points = [wb.convert, wb.plan, execute, wb.open_checkpoint, wb.load_into, wb.save_from, check_target]
    for function in entry_points:
        hints = typing.get_type_hints(function)
        for name, choices in (("rest", {"keep", "drop", "error"}), ("launcher", {"auto", "torchrun", "local"}),
                              ("on_overflow", {"warn", "error"})):
            if name in hints:
                assert set(typing.get_args(hints[name])) == choices, (function.__name__, name)
    for function in entry_points[:5]:
        assert f"{function.__name__}(" in (function.__doc__ or ""), f"{function.__name__} has no example"
