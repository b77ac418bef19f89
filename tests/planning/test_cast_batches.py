"""Small float32 -> bfloat16 casts batched: one read, one conversion and one write for adjacent tensors.

A batch must give the bytes per-tensor casts give (torch's `.to(torch.bfloat16)`), the plan's peak must
count the batch's bytes (and the run must hold exactly that), and a NaN or an overflowing value must
still be handled (and reported) tensor by tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from tests.conftest import load_safetensors_folder
from workbench.engine import bf16
from workbench.errors import CastOverflowWarning, PlanError
from workbench.output.safetensors import SafetensorsWriter
from workbench.planning.runs import BATCH_BYTES


@pytest.fixture(autouse=True)
def _one_step_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches across steps, as plans of fewer than `RUN_MIN_TENSORS` tensors make them (runs of many tensors batch
    inside each run: test_cast_runs). Plans in this process only: nothing here runs workers."""
    from workbench.planning import runs as copy_runs

    monkeypatch.setattr(copy_runs, "RUN_MIN_TENSORS", 10**9)


def small_tensors(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`count` float32 tensors of 1 to 300 elements; every 97th is float16 (a cast numpy does not batch)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 300, (count,), generator=gen).tolist()
    tensors = {}
    for i, size in enumerate(sizes):
        t = torch.randn(size, generator=gen) * 10.0 ** (i % 7 - 3)
        tensors[f"layers.{i}.weight"] = t.to(torch.float16) if i % 97 == 50 else t
    return tensors


def batches_of(plan) -> list[list]:
    """The plan's batches as lists of their steps, in schedule order."""
    found: list[list] = []
    for step in plan.steps:
        if step.batch:
            found.append([step])
        elif step.batch == ():
            found[-1].append(step)
    return found


def test_batched_casts_equal_per_tensor_casts_and_the_peak_counts_the_batch(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = small_tensors(1500)
    source = tmp_path / "src"
    source.mkdir()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    dest = tmp_path / "out"
    plan = wb.plan(source, dest=dest, dtype="bf16", page_align=False)
    batches = batches_of(plan)
    assert len(batches) >= 3
    single_peak = max((s.group.inputs[0].nbytes + s.group.outputs[0].nbytes for s in plan.steps), default=0)
    for steps in batches:
        held = sum(s.group.inputs[0].nbytes + s.group.outputs[0].nbytes for s in steps)
        assert steps[0].batch == tuple(s.group for s in steps)
        assert {s.held_bytes for s in steps} == {held} and single_peak < held <= BATCH_BYTES
        assert all(s.group.inputs[0].dtype == "F32" for s in steps)  # a float16 tensor ends a batch
    assert plan.peak_bytes == max(steps[0].held_bytes for steps in batches)
    calls = []
    convert = bf16.Float32ToBFloat16.convert
    monkeypatch.setattr(bf16.Float32ToBFloat16, "convert", lambda self, *a: calls.append(a[2]) or convert(self, *a))
    report = wb.convert(source, dest, dtype="bf16", page_align=False, quiet=True)
    assert report.peak_tensor_bytes == report.predicted_peak_bytes == plan.peak_bytes
    assert len(calls) < len(tensors) // 50  # one conversion per batch
    expected = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    reference = tmp_path / "reference.safetensors"
    save_file(expected, str(reference), metadata={"format": "pt"})
    assert (dest / "model.safetensors").read_bytes() == reference.read_bytes()


def test_a_batch_holding_nan_or_overflow_is_cast_tensor_by_tensor(tmp_path: Path) -> None:
    tensors = small_tensors(400, seed=1)
    names = list(tensors)
    tensors[names[10]][3] = float("nan")
    tensors[names[11]][0] = -3.4e38  # beyond bfloat16's largest: becomes -inf, and is counted
    tensors[names[12]][1] = float("inf")  # already infinite: not an overflow
    source = tmp_path / "src"
    source.mkdir()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    plan = wb.plan(source, dtype="bf16")
    batched = {s.group.outputs[0].name for steps in batches_of(plan) for s in steps}
    assert {names[10], names[11], names[12]} <= batched
    with pytest.warns(CastOverflowWarning, match=names[11]):
        report = wb.convert(source, tmp_path / "out", dtype="bf16", quiet=True)
    got = load_safetensors_folder(tmp_path / "out")
    for name, tensor in tensors.items():
        assert torch.equal(got[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name
    assert set(report.overflow) == {names[11]} and report.overflow[names[11]][0] == 1


def test_batches_never_span_ranks_or_files(tmp_path: Path) -> None:
    tensors = small_tensors(1200, seed=2)
    source = tmp_path / "src"
    source.mkdir()
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    plan = wb.plan(source, dtype="bf16", nproc=2, shard_size="100KB")
    batches = batches_of(plan)
    assert len(plan.output_file_list) > 2 and len({s.rank for s in plan.steps}) == 2 and batches
    for steps in batches:
        assert len({s.rank for s in steps}) == 1 and len({s.files for s in steps}) == 1
        ends = [(s.group.inputs[0].begin, s.group.inputs[0].end) for s in steps]
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))  # adjacent in the source
        slots = [plan.placement[s.group.outputs[0].name][1] for s in steps]
        sizes = [s.group.outputs[0].nbytes for s in steps]
        assert all(slots[i] + sizes[i] == slots[i + 1] for i in range(len(steps) - 1))  # adjacent in the output


def test_write_span_refuses_pieces_that_do_not_tile_its_bytes(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    save_file({"a": torch.zeros(4), "b": torch.zeros(2)}, str(source / "model.safetensors"))
    plan = wb.plan(source, dest=tmp_path / "out", dtype="bf16", page_align=False)
    (layout,) = [f.layout for f in plan.output_file_list]
    (tmp_path / "out").mkdir()
    a, b = layout.by_name()["a"], layout.by_name()["b"]
    first, second = sorted([a, b], key=lambda t: t.begin)
    with SafetensorsWriter(tmp_path / "out", layout) as writer:
        with pytest.raises(PlanError, match="not contiguous"):
            writer.write_span(first.begin, bytes(12), [(first.name, 0, first.nbytes), (second.name, 1, second.nbytes - 1)])
        with pytest.raises(PlanError, match="do not add up"):
            writer.write_span(first.begin, bytes(5), [(first.name, 0, first.nbytes), (second.name, 0, second.nbytes)])
        writer.write_span(first.begin, np.arange(6, dtype=np.uint16).tobytes(), [(first.name, 0, first.nbytes), (second.name, 0, second.nbytes)])
        assert writer.missing() == {}
        writer.abort()
