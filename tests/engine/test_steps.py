"""Copy steps run in stretches (`engine.steps.run_copies`): same bytes whatever the stretch length, files
committed at their last step, an unexpected failure reported against its own step."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest

import workbench as wb
from workbench import mapper as M
from workbench.conversion import execute
from workbench.engine import steps as engine_steps
from workbench.errors import PlanError

INDEX = "model.safetensors.index.json"


def _tensors(layers: int = 60) -> dict:
    import torch

    tensors = {}
    for i in range(layers):
        for part, rows in (("k", 2), ("o", 3), ("q", 4), ("v", 2)):
            tensors[f"layers.{i}.{part}_proj.weight"] = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 100 * i
    return tensors


FUSE = M.Concat([f"layers.{{i}}.{p}_proj.weight" for p in "qkv"], "layers.{i}.qkv_proj.weight")


def _same_folders(a: Path, b: Path) -> None:
    names = sorted(n for n in os.listdir(a) if n.endswith((".safetensors", ".json")))
    assert names == sorted(n for n in os.listdir(b) if n.endswith((".safetensors", ".json")))
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.mark.parametrize("mapper", [None, FUSE], ids=["copies", "fused"])
@pytest.mark.parametrize("stretch", [0, 1, 3, 50])  # 0: still one step per call
def test_any_stretch_length_writes_the_same_files(tiny_checkpoint, tmp_path: Path, monkeypatch, mapper, stretch) -> None:
    # Several shards, so stretches end at files' last steps as well as at their length; the default stretch
    # (longer than this whole checkpoint) is the reference.
    src = tiny_checkpoint(_tensors(), shards=2)
    reference = tmp_path / "reference"
    wb.convert(src, reference, mapper, shard_size="4KB", quiet=True)
    assert len([n for n in os.listdir(reference) if n.endswith(".safetensors")]) >= 3
    monkeypatch.setattr(engine_steps, "STRETCH_STEPS", stretch)
    out = tmp_path / f"out-{stretch}"
    report = wb.convert(src, out, mapper, shard_size="4KB", quiet=True)
    assert report.ok
    _same_folders(reference, out)


def test_an_unexpected_failure_names_its_own_step(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    # The failing step sits in the middle of a stretch of copies: the error must name its output, not the
    # stretch's first step, and the run must leave no index behind. Its recipe has two pieces, so the stretch
    # hands it to the general copy (`run_copy`), where the failure is injected.
    from workbench.formats import open_catalog
    from workbench.mapper.groups import Binding, ByteSlice, Group
    from workbench.planning.sources import passthrough_binding

    catalog = open_catalog(tiny_checkpoint(_tensors(8), shards=1))
    groups = list(passthrough_binding(catalog).groups)
    middle = len(groups) // 2
    name = groups[middle].outputs[0].name
    half = groups[middle].inputs[0].nbytes // 2
    groups[middle] = Group(groups[middle].inputs, groups[middle].outputs, groups[middle].op,
                           {name: (ByteSlice(name, 0, half), ByteSlice(name, half, 2 * half))}, None, "copy")
    plan = wb.plan(catalog, Binding(groups), dest=tmp_path / "out")
    general = engine_steps.run_copy

    def failing(ctx, step):
        if step.group.outputs[0].name == name:
            raise RuntimeError("disk gremlin")
        return general(ctx, step)

    monkeypatch.setattr(engine_steps, "run_copy", failing)
    with pytest.raises(PlanError, match=rf"Cannot compute {name.replace('.', '[.]')} \(step {middle}, .*RuntimeError: disk gremlin"):
        execute(plan, quiet=True)
    assert not (tmp_path / "out" / INDEX).exists()
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
