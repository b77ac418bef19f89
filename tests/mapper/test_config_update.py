"""`M.ConfigUpdate`: a mapper states an edit of config.json; the plan shows it and the extras step writes it.

The mechanism under lora_merge's untie (issue 29 D6): any mapper or preset can say the output's config must differ
from the source's, instead of the byte copy of a config that no longer describes the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError

CONFIG = {"model_type": "llama", "tie_word_embeddings": True, "text_config": {"hidden_size": 4}, "torch_dtype": "float32"}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a.weight": torch.ones(2, 2), "b.weight": torch.zeros(2)}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return src


def _mapper(*edits: M.ConfigUpdate) -> M.Mapper:
    return M.Sequential(M.Rename("a.weight", "c.weight"), *edits)


def test_edits_are_planned_shown_and_written(folder: Path, tmp_path: Path) -> None:
    mapper = _mapper(M.ConfigUpdate("tie_word_embeddings", False, why="the test unties"),
                     M.ConfigUpdate("text_config.vocab_size", 8))
    plan = wb.plan(folder, mapper, dest=tmp_path / "out")
    assert plan.ok
    summary = plan.summary()
    assert "config.json: tie_word_embeddings true -> false (the test unties)" in summary
    assert "config.json: text_config.vocab_size (absent) -> 8" in summary
    wb.convert(folder, tmp_path / "out", mapper, quiet=True)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {**CONFIG, "tie_word_embeddings": False, "text_config": {"hidden_size": 4, "vocab_size": 8}}
    assert not list((tmp_path / "out").glob("*.partial*"))


def test_edits_apply_on_top_of_the_dtype_policy(folder: Path, tmp_path: Path) -> None:
    wb.convert(folder, tmp_path / "out", _mapper(M.ConfigUpdate("tie_word_embeddings", False)), dtype="bf16", quiet=True)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written["tie_word_embeddings"] is False


def test_a_value_already_there_changes_nothing(folder: Path, tmp_path: Path) -> None:
    plan = wb.plan(folder, _mapper(M.ConfigUpdate("tie_word_embeddings", True)), dest=tmp_path / "out")
    assert [e.action for e in plan.extra_files if e.path == "config.json"] == ["copy"]


def test_conflicting_or_impossible_edits_are_problems(folder: Path, tmp_path: Path) -> None:
    plan = wb.plan(folder, _mapper(M.ConfigUpdate("x", 1), M.ConfigUpdate("x", 2)))
    assert not plan.ok and "sets 'x' to both 1 and 2" in plan.errors[0].message
    plan = wb.plan(folder, _mapper(M.ConfigUpdate("model_type.deeper", 1)))
    assert any("config.json has no object 'model_type'" in p.message for p in plan.problems if p.severity == "warning")
    plan = wb.plan(folder, _mapper(M.ConfigUpdate("tie_word_embeddings", False)), extras=False)
    assert any("no config.json is written" in p.message for p in plan.problems if p.severity == "warning")


def test_the_statement_travels_with_the_mapper(folder: Path) -> None:
    mapper = _mapper(M.ConfigUpdate("tie_word_embeddings", False, why="w"))
    assert M.from_json(mapper.to_json()) == mapper
    scope: dict = {}
    exec(mapper.to_code(), scope)
    assert scope["mapper"] == mapper
    assert set(mapper.bind(wb.open_checkpoint(folder)).outputs) == {"c.weight", "b.weight"}
    assert mapper.apply({"a.weight": torch.ones(1), "b.weight": torch.ones(1)}).keys() == {"c.weight", "b.weight"}
    with pytest.raises(MapperError, match="JSON scalar"):
        M.ConfigUpdate("x", {"a": 1})
    with pytest.raises(MapperError, match="dotted name"):
        M.ConfigUpdate("a..b", 1)
