"""Cast runs (`planning.runs`): with `dtype=` and no mapper, a checkpoint of many small float32 tensors is
planned in runs of neighbours; the files, layout, ranks and overflow reports are what one group per tensor gives,
and the held memory is predicted exactly, within the bound of per-tensor batches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.conftest import assert_same_outputs, plan_in_runs, plan_per_tensor, planned_files
from workbench.conversion import execute
from workbench.engine.output_check import check_outputs
from workbench.planning import runs as copy_runs
from workbench.planning.runs import BATCH_BYTES, CastRun
from workbench.planning.schedule import cast_chunk


def _mixed(count: int = 1100) -> dict[str, torch.Tensor]:
    """Float32 tensors of 1 to 300 elements, a few too large to batch, bf16 ones (copies), empty ones, and a NaN and
    an overflowing value (batches holding them are cast tensor by tensor)."""
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for i in range(count):
        if i % 97 == 5:
            tensors[f"t.{i}.empty"] = torch.zeros((0, 4))
        elif i % 113 == 9:
            tensors[f"t.{i}.wide"] = torch.randn(30000, generator=gen)  # 120 KB: converted alone, inside a run
        elif i % 7 == 3:
            tensors[f"t.{i}.half"] = torch.randn(i % 9 + 1, generator=gen).to(torch.bfloat16)
        else:
            tensors[f"t.{i}.w"] = torch.randn(i % 300 + 1, generator=gen) * 10.0 ** (i % 5 - 2)
    tensors["t.200.w"][0] = float("nan")
    tensors["t.400.w"][0] = -3.4e38  # beyond bfloat16's largest: -inf, counted
    return tensors


@pytest.mark.parametrize("shard_size", [None, "60KB"])
def test_cast_runs_give_the_files_reports_and_peak_of_one_group_per_tensor(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_size: str | None,
) -> None:
    src = tiny_checkpoint(_mixed(), shards=2)
    plan_per_tensor(monkeypatch)
    single = wb.plan(src, dtype="bf16", shard_size=shard_size, nproc=2)
    reference = wb.convert(src, tmp_path / "reference", dtype="bf16", shard_size=shard_size, quiet=True)
    plan_in_runs(monkeypatch, 41)
    runs = wb.plan(src, dtype="bf16", shard_size=shard_size, nproc=2)
    assert single.ok and runs.ok
    cast_steps = [s for s in runs.steps if type(s.group.op) is CastRun]
    assert cast_steps and len(runs.steps) < len(single.steps) // 5
    assert all(len(s.files) == 1 for s in runs.steps)
    if shard_size is not None:
        assert len(runs.output_file_list) >= 3 and {f.rank for f in runs.output_file_list} == {0, 1}
    assert planned_files(runs) == planned_files(single)
    assert runs.reads() == single.reads()
    for step in cast_steps:
        spans = step.spans
        assert spans[0][0] == 0 and spans[-1][1] == len(step.group.inputs)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # the spans tile the run
        assert {t.dtype for t in step.group.inputs} == {"F32"} and {t.dtype for t in step.group.outputs} == {"BF16"}
    assert any(end - start > 1 for s in cast_steps for start, end in s.spans)  # neighbours batched
    assert any(end - start == 1 for s in cast_steps for start, end in s.spans)
    plan = wb.plan(src, dtype="bf16", shard_size=shard_size, dest=tmp_path / "out")
    report = execute(plan, quiet=True)
    assert report.ok
    assert_same_outputs(tmp_path / "reference", tmp_path / "out")
    assert report.overflow == reference.overflow and report.overflow  # the -3.4e38, counted for its own tensor
    assert report.peak_tensor_bytes == report.predicted_peak_bytes == plan.peak_bytes
    widest = max(cast_chunk(t.numel, "F32", "BF16", plan.options.chunk_bytes)[1] for t in plan.source.tensors.values() if t.dtype == "F32")
    assert plan.peak_bytes <= max(BATCH_BYTES, widest) and single.peak_bytes <= max(BATCH_BYTES, widest)
    check = check_outputs(plan)
    assert check.ok and len(check.frame()) == len(plan.source.tensors)


def test_two_ranks_cast_in_runs_to_the_same_files(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers plan again in their own processes, with the default run sizes (1100 tensors: runs).
    src = tiny_checkpoint(_mixed(), shards=2)
    monkeypatch.setattr(copy_runs, "RUN_MIN_TENSORS", 10**9)
    wb.convert(src, tmp_path / "reference", dtype="bf16", shard_size="60KB", quiet=True)
    monkeypatch.undo()
    plan = wb.plan(src, dtype="bf16", shard_size="60KB", nproc=2, dest=tmp_path / "out")
    assert any(type(s.group.op) is CastRun for s in plan.steps)
    report = execute(plan, quiet=True)
    assert report.ok and {r.rank for r in report.ranks} == {0, 1}
    assert_same_outputs(tmp_path / "reference", tmp_path / "out")


def test_an_unexpected_failure_inside_a_cast_run_names_its_tensor(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.engine import steps as engine_steps

    # every 10th tensor too large to batch: converted alone, in the middle of its run
    src = tiny_checkpoint({f"t.{i:04d}": torch.full((50_000 if i % 10 == 5 else 3 + i % 5,), float(i)) for i in range(1100)})
    plan = wb.plan(src, dtype="bf16", dest=tmp_path / "out")
    run = next(s for s in plan.steps if type(s.group.op) is CastRun and len(s.group.outputs) > 100)
    victim = run.group.outputs[next(start for start, end in run.spans if end - start == 1 and start > 0)].name
    original = engine_steps.cast_one

    def failing(ctx, src, out):
        if out.name == victim:
            raise RuntimeError("bad sector")
        return original(ctx, src, out)

    monkeypatch.setattr(engine_steps, "cast_one", failing)
    monkeypatch.setattr(engine_steps, "run_cast_batch", lambda ctx, pairs, cast: [cast(ctx, s, o) for s, o in pairs])
    with pytest.raises(wb.PlanError, match=rf"Cannot compute {victim} \(step {run.index}, .*in a run of .*bad sector") as failed:
        execute(plan, quiet=True)
    assert failed.value.tensor == victim
    assert not [n for n in os.listdir(tmp_path / "out") if not n.startswith(".")]  # no index, no shard
