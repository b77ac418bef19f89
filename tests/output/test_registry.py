"""The output-format registry: the planner and the engine reach formats only through it, so a new format
is one subclass and one `register` call, and an unknown one is refused with the list of choices."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from safetensors.numpy import load_file

import workbench as wb
from workbench import output
from workbench.cli.commands import main as cli_main
from workbench.errors import PlanError
from workbench.files import atomic_write
from workbench.output.safetensors import FileLayout, SafetensorsOutput

PACKAGE = Path(__file__).resolve().parents[2] / "workbench"


class PartsOutput(SafetensorsOutput):
    """A toy format: `part-<k>.safetensors` files committed by a `parts.json` listing them."""

    name = "parts"
    title = "parts"
    label = " (parts)"

    def file_name(self, k: int, n: int) -> str:
        return f"part-{k}.safetensors"

    def index(self, layouts: Sequence[FileLayout]) -> dict | None:
        return None

    def commit_files(self, layouts: Sequence[FileLayout], objects: bool) -> list[str]:
        return ["parts.json"]

    def commit(self, dest: Path, layouts: Sequence[FileLayout], reader: Any, *, objects: bool) -> bool:
        atomic_write(dest / "parts.json", json.dumps([layout.file for layout in layouts]))
        return True


@pytest.fixture
def parts_format():
    output.register(PartsOutput())
    yield
    del output.OUTPUT_FORMATS["parts"]


def test_a_registered_format_converts_end_to_end_with_no_other_change(parts_format, llama_sample: Path, tmp_path: Path) -> None:
    plan = wb.plan(llama_sample, shard_size="300KB", to="parts", dest=tmp_path / "out")
    assert plan.ok and plan.commit_files == ["parts.json"] and "(parts)" in plan.summary()
    report = wb.convert(llama_sample, tmp_path / "out", shard_size="300KB", to="parts", quiet=True)
    names = json.loads((tmp_path / "out" / "parts.json").read_text())
    assert report.index_written and names == [f"part-{k}.safetensors" for k in range(len(names))] and len(names) > 1
    merged: dict = {}
    for name in names:
        merged.update(load_file(tmp_path / "out" / name))
    source = wb.open_checkpoint(llama_sample)
    assert sorted(merged) == sorted(source.catalog.tensors)
    name = sorted(merged)[0]
    assert merged[name].tobytes() == source.catalog.read_bytes(name)


def test_an_unknown_format_is_refused_with_the_choices(llama_sample: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(PlanError, match=r"format 'gguff'.*to='dcp'.*to='safetensors'"):
        wb.plan(llama_sample, to="gguff")
    assert cli_main(["convert", str(llama_sample), str(tmp_path / "o"), "--to", "gguff"]) == 2
    assert "'safetensors'" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_aliases_and_case_resolve_to_the_registered_format() -> None:
    assert output.output_format("HF") is output.output_format("safetensors")
    assert output.output_format("DCP").name == "dcp"


def test_no_module_outside_output_branches_on_the_format_name() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "output":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "to":
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert offenders == []


# Names users pass as `to=`: planning/ and engine/ reach a format through its `OutputFormat`, never by its name.
FORMAT_NAMES = {"safetensors", "dcp", "gguf", "pth"}


def _names_a_format(node: ast.AST) -> bool:
    """A string constant that is a format name, or a literal tuple / list / set holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.lower() in FORMAT_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_format(item) for item in node.elts)
    return False


def format_comparisons(source: str) -> list[int]:
    """Lines of `source` comparing with a format name: `==` / `!=` / `in` / `not in` with one as either operand, or a
    `match` case on one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else \
            (node.value,) if isinstance(node, ast.MatchValue) else ()
        if any(_names_a_format(side) for side in sides):
            lines.append(node.lineno)
    return lines


def test_planning_and_the_engine_compare_with_no_format_name() -> None:
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}"
                 for part in ("planning", "engine") for path in sorted((PACKAGE / part).rglob("*.py"))
                 for line in format_comparisons(path.read_text(encoding="utf-8"))]
    assert offenders == []


@pytest.mark.parametrize("source", [
    "runs = output.name == 'safetensors'",
    "if 'gguf' != plan.options.to: pass",
    "ok = to in ('dcp', 'hf')",
    "ok = to not in {'PTH'}",
    "match output.name:\n    case 'gguf':\n        pass",
])
def test_the_format_name_check_sees_each_kind_of_comparison(source: str) -> None:
    assert format_comparisons(source) != []
    assert format_comparisons("to = 'gguf'\nok = scheme == 'hf'\nfiles = {'.gguf': 1}") == []


# A stale file of each format an older conversion may have left, and user files that only look alike.
STALE = {"safetensors": ["model.safetensors", "model-00007-of-00009.safetensors", "model.safetensors.index.json"],
         "dcp": ["__0_7.distcp", "__1_0.distcp", ".metadata"],
         "gguf": ["model.gguf", "model-00002-of-00003.gguf"],
         "pth": ["consolidated.03.pth", "params.json"]}
USER_FILES = ["notes.txt", "model.gguf.bak", "my-model.gguf", "consolidated.pth", "params.json.orig", "model.safetensors.txt",
              "__0_x.distcp", "model-1-of-2.safetensors"]


def test_every_format_owns_the_files_it_writes_and_no_user_file() -> None:
    formats = output.OUTPUT_FORMATS
    assert set(STALE) <= set(formats)
    for name, fmt in formats.items():
        for n in (1, 3):
            assert all(fmt.owns(fmt.file_name(k, n)) for k in range(n)), name
        assert all(fmt.owns(stale) for stale in STALE.get(name, ())), name
        assert not any(fmt.owns(user) for user in USER_FILES), name
    assert output.owned("model-00002-of-00003.gguf") and not output.owned("notes.txt")


def test_overwrite_removes_stale_files_of_every_format_and_keeps_the_users(llama_sample: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    for name in [*(stale for names in STALE.values() for stale in names), *USER_FILES]:
        (dest / name).write_bytes(b"older")
    wb.convert(llama_sample, dest, shard_size="300KB", quiet=True, overwrite=True)
    left = {p.name for p in dest.iterdir()}
    written = {name for name in left if (dest / name).read_bytes() != b"older"}
    for fmt, names in STALE.items():
        assert not [name for name in names if name in left and name not in written], fmt
    assert set(USER_FILES) <= left
    assert "model.safetensors.index.json" in written and "model.safetensors" not in left
