"""The plan's own problems (destination, layout, ranks, empty output, metadata) carry a known `kind`, as the
binding's do (tests/mapper/test_groups.py), so a front end can group them without reading their wording."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench import mapper as M
from workbench.mapper.groups import PROBLEM_KINDS

TENSORS = {"a": torch.zeros(1024), "b": torch.ones(1024)}  # 4 KiB each


def _busy(folder: Path) -> Path:
    dest = folder / "busy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    return dest


CASES = {
    "destination not empty": (lambda tmp: {"dest": _busy(tmp)}, "destination"),
    "tensors larger than the shard size": (lambda tmp: {"shard_size": 1000}, "layout"),
    "more ranks than tensors": (lambda tmp: {"nproc": 3}, "ranks"),  # 2 tensors: shared by 2 ranks, never 3
    "everything dropped": (lambda tmp: {"mapper": M.Drop("a"), "rest": "drop"}, "empty"),
    "header metadata a DCP output cannot keep": (lambda tmp: {"to": "dcp"}, "metadata"),
    "a binding problem": (lambda tmp: {"mapper": M.Rename("nope", "x")}, "missing"),
}


@pytest.mark.parametrize("case", CASES)
def test_plan_problems_have_known_kinds(case: str, tiny_checkpoint, tmp_path: Path) -> None:
    options, expected = CASES[case]
    source = tiny_checkpoint(TENSORS, metadata={"note": "kept in safetensors only"})
    plan = wb.plan(source, **options(tmp_path))
    kinds = [(p.kind, p.message) for p in plan.problems]
    assert kinds and {kind for kind, _ in kinds} <= set(PROBLEM_KINDS), kinds
    assert expected in {kind for kind, _ in kinds}, kinds
