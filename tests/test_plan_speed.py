"""What keeps planning and running 100k-tensor checkpoints fast: no garbage collection passes over the
plan's million objects, and a schedule built with one sort, in the order the rules say."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

import workbench as wb
from workbench.catalog import Catalog, TensorInfo
from workbench.engine import rank as rank_module
from workbench.mapper.groups import Binding, ByteSlice, Group
from workbench.planning.schedule import COPY, SourceAccess, build_steps
from workbench.planning.sources import passthrough_binding


class RecordingMapper:
    """Binds like 'copy everything' and notes whether the garbage collector was running meanwhile."""

    def __init__(self) -> None:
        self.collector_running: list[bool] = []

    def bind(self, catalog: Catalog, rest: str = "keep") -> Binding:
        self.collector_running.append(gc.isenabled())
        return passthrough_binding(catalog)


def catalog_of(n: int) -> Catalog:
    infos = []
    for k in range(n):
        file = f"model-{k % 2 + 1:05d}-of-00002.safetensors"
        infos.append(TensorInfo(f"layers.{k}.weight", "F32", (4,), file, 64 + 16 * (k // 2), 64 + 16 * (k // 2) + 16))
    return Catalog.from_infos(infos)


@pytest.mark.parametrize("enabled_before", [True, False])
def test_planning_pauses_the_collector_and_restores_it(enabled_before: bool) -> None:
    mapper = RecordingMapper()
    if not enabled_before:
        gc.disable()
    try:
        plan = wb.plan(catalog_of(2000), mapper)
        assert gc.isenabled() is enabled_before
    finally:
        gc.enable()
    assert mapper.collector_running == [False] and plan.ok and len(plan.steps) == 2000


def test_a_rank_runs_with_the_collector_paused(llama_sample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    original = rank_module.run_step

    def recording(ctx, step):
        seen.append(gc.isenabled())
        return original(ctx, step)

    monkeypatch.setattr(rank_module, "run_step", recording)
    wb.convert(llama_sample, tmp_path / "out", quiet=True)
    assert seen and not any(seen) and gc.isenabled()


def test_schedule_follows_the_earliest_input_then_binding_order() -> None:
    catalog = catalog_of(8)  # even k in file 1, odd k in file 2, in offset order
    t = catalog.tensors
    a, b = t["layers.6.weight"], t["layers.1.weight"]  # a late in file 1, b early in file 2

    def copy_group(*inputs: TensorInfo, out: str) -> Group:
        recipe = {out: tuple(ByteSlice(i.name, 0, i.nbytes) for i in inputs)}
        return Group(inputs, (TensorInfo(out, "F32", (4 * len(inputs),)),), None, recipe, None, out)

    groups = [
        copy_group(b, a, out="spans"),  # placed at its earliest input, a (file 1), whatever the input order
        copy_group(t["layers.0.weight"], out="first"),
        copy_group(t["layers.3.weight"], out="file2"),
        Group((), (), None, None, None, "produces nothing"),
        copy_group(t["layers.6.weight"], out="tie"),  # same position as "spans": binding order breaks the tie
    ]
    steps = build_steps(groups, SourceAccess(None), 1 << 20)
    assert [s.group.label for s in steps] == ["first", "spans", "tie", "file2"]
    assert [s.index for s in steps] == [0, 1, 2, 3] and {s.kind for s in steps} == {COPY}
    spans = steps[1]
    assert spans.reads == {a.file: 16, b.file: 16} and spans.held_bytes == 0 and spans.bytes_out == 32
