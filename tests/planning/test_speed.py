"""What keeps planning and running 100k-tensor checkpoints fast: no garbage collection passes over the
plan's million objects (nor right after it), a schedule built with one sort, in the order the rules say,
headers spelled out without a dict per tensor (still the reference writer's bytes), one op shared by
every group of a rename. Timings themselves live in benchmarks/bench_plan.py."""

from __future__ import annotations

import gc
import pickle
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

import workbench as wb
from workbench.catalog import Catalog, TensorInfo
from workbench.engine import rank as rank_module
from workbench.mapper import presets
from workbench.mapper.groups import Binding, ByteSlice, Group
from workbench.output.safetensors import layout_file
from workbench.planning.gc_pause import gc_paused
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
    original, original_copies = rank_module.run_step, rank_module.run_copies

    def recording(ctx, step):
        seen.append(gc.isenabled())
        return original(ctx, step)

    def recording_copies(ctx, steps, start, commit_at):  # copy steps run in stretches
        seen.append(gc.isenabled())
        return original_copies(ctx, steps, start, commit_at)

    monkeypatch.setattr(rank_module, "run_step", recording)
    monkeypatch.setattr(rank_module, "run_copies", recording_copies)
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


def test_objects_made_while_paused_go_to_the_oldest_generation() -> None:
    class Made:
        pass

    with gc_paused():
        made = [Made() for _ in range(1000)]
    assert gc.isenabled()
    young = {id(o) for o in gc.get_objects(generation=0)} | {id(o) for o in gc.get_objects(generation=1)}
    assert not any(id(o) in young for o in made)  # the next collections do not walk them
    assert any(o is made[0] for o in gc.get_objects(generation=2))


def test_paused_collection_leaves_an_applications_frozen_objects_frozen() -> None:
    class Frozen:
        pass

    kept = Frozen()
    gc.freeze()
    try:
        with gc_paused():
            pass
        # Still in the permanent generation: in none of the three the collector walks. (The frozen count itself
        # is not compared: other threads of a long test session may free frozen objects meanwhile.)
        assert not any(o is kept for g in range(3) for o in gc.get_objects(generation=g))
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects(generation=2))  # the check above can fail: unfreeze puts it back


NAMES = ['q"uote', "back\\slash", "ctl\x01\x1f", "tab\tnl\n", "ünï.日本.😀", "line\u2028sep", "z", "A.10", "A.9", "/slash"]


@pytest.mark.parametrize("metadata", [None, {"format": 'ü"\\\x02 😀'}])  # one key: the reference's key order is a hash map's
def test_headers_are_the_reference_writers_bytes_for_awkward_names(metadata: dict | None) -> None:
    dtypes = [np.float32, np.float16, np.int8, np.float64, np.uint8, np.int64, np.int32, np.bool_, np.int16]
    arrays = {name: np.zeros((k % 3, 2) if k % 4 else (), dtype=dtypes[k % len(dtypes)]) for k, name in enumerate(NAMES)}
    reference = save(arrays, metadata={"format": "pt"} if metadata is None else metadata)
    n = int.from_bytes(reference[:8], "little")
    codes = {"float32": "F32", "float16": "F16", "int8": "I8", "float64": "F64", "uint8": "U8", "int64": "I64",
             "int32": "I32", "bool": "BOOL", "int16": "I16"}
    infos = [TensorInfo(name, codes[a.dtype.name], a.shape) for name, a in arrays.items()]
    layout = layout_file("model.safetensors", infos, metadata)
    assert layout.header == reference[: 8 + n]
    assert layout.size == len(reference)


def test_tensor_infos_stay_frozen_values() -> None:
    info = TensorInfo("w", "F32", (2, 3), "a.safetensors", 8, 32)
    assert info == TensorInfo(name="w", dtype="F32", shape=(2, 3), file="a.safetensors", begin=8, end=32)
    assert hash(info) == hash(replace(info)) and pickle.loads(pickle.dumps(info)) == info
    assert replace(info, name="v").name == "v" and TensorInfo("w", "F32", (2,)).file == "" and info.nbytes == 24
    with pytest.raises(FrozenInstanceError):
        info.name = "v"  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        ByteSlice("w", 0, 4).end = 8  # type: ignore[misc]


def test_a_rename_shares_one_op_across_its_groups() -> None:
    catalog = Catalog.from_infos([TensorInfo(f"model.layers.{k}.weight", "F32", (4,), "m.safetensors", 16 * k, 16 * k + 16)
                                  for k in range(50)])
    binding = presets.strip_prefix("model.").bind(catalog)
    assert binding.ok and len(binding.groups) == 50
    assert len({id(g.op) for g in binding.groups}) == 1
    assert [t.name for g in binding.groups for t in g.outputs] == [f"layers.{k}.weight" for k in range(50)]
    assert binding.groups[7].recipe == {"layers.7.weight": (ByteSlice("model.layers.7.weight", 0, 16),)}


def test_a_dtype_policy_without_a_mapper_builds_the_cast_groups_apply_dtype_would() -> None:
    from workbench.planning.dtype_policy import apply_dtype

    infos, at = [], 64
    for name, dtype, shape in [("a", "F32", (3, 4)), ("b", "BF16", (4,)), ("c", "F16", (2, 2)), ("d", "I64", (3,)),
                               ("e", "F4", (8,)), ("f", "F32", (0,)), ("g", "F64", (2,)), ("h", "F4", (4,))]:
        info = TensorInfo(name, dtype, shape)
        infos.append(TensorInfo(name, dtype, shape, "model.safetensors", at, at + info.nbytes))
        at += info.nbytes
    catalog = Catalog.from_infos(infos)
    direct, applied = passthrough_binding(catalog, "BF16"), apply_dtype(passthrough_binding(catalog), "BF16")

    def described(binding: Binding) -> list[tuple]:
        return [(g.inputs, g.outputs, dict(g.recipe) if g.recipe is not None else None, g.chunk_cast, g.label, repr(g.op),
                 getattr(g.op, "names", None)) for g in binding.groups]

    assert described(direct) == described(applied)
    assert direct.problems == applied.problems and len(direct.problems) == 1 and "2 F4 tensors" in direct.problems[0].message
    assert [g.chunk_cast for g in direct.groups] == ["BF16", None, "BF16", None, None, "BF16", "BF16", None]
