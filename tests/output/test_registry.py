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
