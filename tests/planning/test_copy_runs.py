"""Copy runs (`planning.runs`): a checkpoint of many small tensors copied unchanged is planned in runs of
neighbours, and gives the same files, the same layout and the same rank assignment as one group per tensor."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import workbench as wb
from tests.conftest import assert_same_outputs, plan_in_runs, plan_per_tensor, planned_files
from workbench import mapper as M
from workbench.conversion import execute
from workbench.planning import runs as copy_runs
from workbench.planning.runs import CopyRun

INDEX = "model.safetensors.index.json"


def _many(count: int = 1100) -> dict:
    """`count` small tensors of two dtypes (so the reference order is not the name order), some empty, some larger
    (runs of them cross 8 KB shards; the larger ones overflow 5 KB shards)."""
    import torch

    tensors = {}
    for i in range(count):
        if i % 97 == 5:
            tensors[f"blocks.{i}.empty"] = torch.zeros((0, 3))
        elif i % 131 == 7:
            tensors[f"blocks.{i}.big"] = torch.full((40, 40), float(i))  # 6.4 KB: alone (runs take tensors < 4 KB)
        elif i % 3 == 0:
            tensors[f"blocks.{i}.half"] = torch.arange(i % 5 + 1, dtype=torch.bfloat16) + i
        else:
            tensors[f"blocks.{i}.weight"] = torch.arange((i % 7 + 1) * 24, dtype=torch.float32).reshape(-1, 3) - i
    return tensors


@pytest.mark.parametrize("shard_size", [None, "8KB", "5KB"])
def test_runs_give_the_layout_ranks_and_bytes_of_one_group_per_tensor(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_size: str | None,
) -> None:
    src = tiny_checkpoint(_many(), shards=3)
    plan_per_tensor(monkeypatch)
    single = wb.plan(src, shard_size=shard_size, nproc=2, dest=tmp_path / "single")
    plan_in_runs(monkeypatch, 37, 4096)
    runs = wb.plan(src, shard_size=shard_size, nproc=2, dest=tmp_path / "runs")
    assert single.ok and runs.ok
    assert len(single.steps) == len(single.source.tensors)
    run_steps = [s for s in runs.steps if type(s.group.recipe) is CopyRun]
    assert run_steps and len(runs.steps) < len(single.steps) // 10
    assert all(len(s.files) == 1 for s in runs.steps)  # a run crossing into the next file was cut there
    assert [s.index for s in runs.steps] == list(range(len(runs.steps)))
    assert planned_files(runs) == planned_files(single)
    if shard_size is not None:
        assert len(runs.output_file_list) >= 3 and {f.rank for f in runs.output_file_list} == {0, 1}
    assert runs.reads() == single.reads()
    plan_per_tensor(monkeypatch)
    wb.convert(src, tmp_path / "reference", shard_size=shard_size, quiet=True)
    plan_in_runs(monkeypatch, 37, 4096)
    report = wb.convert(src, tmp_path / "out", shard_size=shard_size, quiet=True)
    assert report.ok
    assert_same_outputs(tmp_path / "reference", tmp_path / "out")


def test_runs_read_back_as_the_source_tensors(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open

    tensors = _many()
    src = tiny_checkpoint(tensors, shards=2)
    plan_in_runs(monkeypatch, 37, 4096)
    wb.convert(src, tmp_path / "out", shard_size="6KB", quiet=True)
    seen = {}
    for name in sorted(os.listdir(tmp_path / "out")):
        if name.endswith(".safetensors"):
            with safe_open(tmp_path / "out" / name, "pt") as f:
                seen.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 - safe_open is not a dict
    assert seen.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert seen[name].dtype == tensor.dtype and seen[name].shape == tensor.shape and seen[name].equal(tensor), name


def test_two_ranks_write_the_files_of_one(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers plan again in their own processes, with the default run sizes (1100 tensors: runs).
    src = tiny_checkpoint(_many(), shards=2)
    monkeypatch.setattr(copy_runs, "RUN_MIN_TENSORS", 10**9)
    wb.convert(src, tmp_path / "reference", shard_size="8KB", quiet=True)
    monkeypatch.undo()
    plan = wb.plan(src, shard_size="8KB", nproc=2, dest=tmp_path / "out")
    assert any(type(s.group.recipe) is CopyRun for s in plan.steps)
    report = execute(plan, quiet=True)
    assert report.ok and {r.rank for r in report.ranks} == {0, 1}
    assert_same_outputs(tmp_path / "reference", tmp_path / "out")


def test_an_interrupted_run_of_runs_resumes_to_the_same_files(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tiny_checkpoint(_many(), shards=2)
    wb.convert(src, tmp_path / "clean", shard_size="8KB", quiet=True)
    dest = tmp_path / "out"
    monkeypatch.setenv("WORKBENCH_FAIL_RANK", "0")
    with pytest.raises(wb.PlanError, match="failure injected"):
        wb.convert(src, dest, shard_size="8KB", quiet=True)
    assert not (dest / INDEX).exists()
    written = sorted(n for n in os.listdir(dest) if n.endswith(".safetensors"))
    assert written  # the files before the last one were committed
    monkeypatch.delenv("WORKBENCH_FAIL_RANK")
    report = wb.convert(src, dest, shard_size="8KB", quiet=True)
    assert report.kept == written
    assert_same_outputs(tmp_path / "clean", dest)


@pytest.mark.parametrize("how", ["few tensors", "dcp"])
def test_other_formats_and_small_checkpoints_keep_one_step_per_tensor(tiny_checkpoint, how: str) -> None:
    tensors = _many(200 if how == "few tensors" else 1100)
    plan = wb.plan(tiny_checkpoint(tensors), to="dcp" if how == "dcp" else "safetensors")
    assert plan.ok
    assert len(plan.steps) == len(tensors) and not any(type(s.group.recipe) is CopyRun for s in plan.steps)


RENAME = M.presets.strip_prefix("blocks.")


@pytest.mark.parametrize("mapper", [RENAME, "fuse", "bf16"], ids=["rename", "some-fused", "bf16-cast"])
def test_a_mappers_one_tensor_copies_run_in_runs_with_the_same_bytes(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapper,
) -> None:
    import torch

    dtype = None
    if mapper == "bf16":  # the F32 tensors are cast; the ones already in bf16 are copies, in runs
        mapper, dtype = None, "bf16"

    tensors = _many()
    if mapper == "fuse":  # every 10th pair of neighbours concatenated: the copies between them run in runs
        for i in range(0, 1080, 10):
            tensors[f"pair.{i}.a"] = torch.arange(6, dtype=torch.float32) + i
            tensors[f"pair.{i}.b"] = torch.arange(3, dtype=torch.float32) - i
        mapper = M.Concat(["pair.{i}.a", "pair.{i}.b"], "pair.{i}.ab")
    src = tiny_checkpoint(tensors, shards=2)
    plan_per_tensor(monkeypatch)
    single = wb.plan(src, mapper, shard_size="8KB", nproc=2, dtype=dtype)
    wb.convert(src, tmp_path / "reference", mapper, shard_size="8KB", dtype=dtype, quiet=True)
    plan_in_runs(monkeypatch, 37, 4096)
    runs = wb.plan(src, mapper, shard_size="8KB", nproc=2, dtype=dtype)
    assert single.ok and runs.ok
    assert any(type(s.group.recipe) is CopyRun and s.group.outputs is not s.group.inputs for s in runs.steps)
    assert len(runs.steps) < len(single.steps) * 3 // 4 and all(len(s.files) == 1 for s in runs.steps)
    assert planned_files(runs) == planned_files(single)
    for step in runs.steps:
        recipe = step.group.recipe
        if type(recipe) is CopyRun:
            assert [t.name for t in step.group.outputs] == list(recipe)
            renamed = [t.name for t in step.group.outputs] != [t.name for t in step.group.inputs]
            assert renamed == (mapper is RENAME)
    assert runs.outputs["group"].sort_index().equals(single.outputs["group"].sort_index())  # labels kept
    report = wb.convert(src, tmp_path / "out", mapper, shard_size="8KB", dtype=dtype, quiet=True)
    assert report.ok
    assert_same_outputs(tmp_path / "reference", tmp_path / "out")


def test_a_run_step_splits_only_where_the_file_changes(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tiny_checkpoint(_many())
    plan_in_runs(monkeypatch, 37, 4096)
    plan = wb.plan(src, shard_size="8KB")
    for step in plan.steps:
        recipe = step.group.recipe
        if type(recipe) is CopyRun:
            assert step.group.outputs == step.group.inputs and step.bytes_out == recipe.total == sum(recipe.sizes)
            assert len({t.file for t in recipe.inputs}) == 1
            begins = [t.begin for t in recipe.inputs]
            assert begins == sorted(begins)
            assert dict(recipe.input_bytes()) == {t.name: t.nbytes for t in recipe.inputs}
            assert all(recipe[t.name][0].end == t.nbytes for t in recipe.inputs if t.nbytes)
    steps = {s.index: s for s in plan.steps}
    for f in plan.output_file_list:  # every tensor of a file comes from a step of that file
        names = {t.name for i in f.steps for t in steps[i].group.outputs}
        assert names == {t.name for t in f.layout.tensors}


def test_the_output_check_still_checks_a_run_with_a_tensor_retyped(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file, save_file

    from workbench.engine.output_check import check_outputs

    src = tiny_checkpoint(_many())
    plan_in_runs(monkeypatch, 37, 4096)
    plan = wb.plan(src, dest=tmp_path / "out")
    execute(plan, quiet=True)
    run = next(s for s in plan.steps if type(s.group.recipe) is CopyRun and len(s.group.outputs) > 5)
    names = [t.name for t in run.group.outputs if t.nbytes]
    retyped, changed = names[1], names[3]  # one no longer as planned, one with other bytes: both reported
    path = str(tmp_path / "out" / "model.safetensors")
    tensors = load_file(path)
    tensors[retyped] = tensors[retyped].double()
    tensors[changed] = tensors[changed] + 1
    save_file(tensors, path, metadata={"format": "pt"})
    check = check_outputs(plan)
    assert {row[0]: row[2] for row in check.rows if row[2] != "ok"} == {retyped: "mismatch", changed: "mismatch"}
    assert len(check.rows) == len(tensors)


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_a_wrong_rest_is_refused_on_the_run_paths_too(tiny_checkpoint, dtype: str | None) -> None:
    src = tiny_checkpoint(_many())
    with pytest.raises(wb.PlanError, match="rest='bogus'"):
        wb.plan(src, rest="bogus", dtype=dtype)
