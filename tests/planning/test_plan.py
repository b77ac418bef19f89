"""The dry-run planner: metadata only, deterministic layout, files read, ranks, memory, problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench import mapper as M
from workbench.catalog import Catalog, TensorInfo
from workbench.errors import PlanError
from workbench.formats import open_catalog
from workbench.iostats import IO
from workbench.mapper.groups import Binding, ByteSlice, Group
from workbench.output.safetensors import layout_file
from workbench.planning import parse_size
from workbench.planning.destination import MANIFEST_NAME
from workbench.planning.ranks import balanced_runs

REPO = Path(__file__).resolve().parents[2]


def write_headers_only(folder: Path, files: dict[str, list[TensorInfo]]) -> Path:
    """A checkpoint folder whose shards have real headers and zero data (planning never reads data)."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for name, infos in files.items():
        layout = layout_file(name, infos)
        with open(folder / name, "wb") as fh:
            fh.write(layout.header)
            fh.truncate(layout.size)
        weight_map.update({t.name: name for t in infos})
    if len(files) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def f32(name: str, *shape: int) -> TensorInfo:
    return TensorInfo(name, "F32", tuple(shape))


@pytest.fixture
def four_files(tmp_path: Path) -> Path:
    """Four source shards of four 4 KiB tensors each (t00..t15)."""
    files = {f"model-{k + 1:05d}-of-00004.safetensors": [f32(f"t{4 * k + i:02d}", 1024) for i in range(4)] for k in range(4)}
    return write_headers_only(tmp_path / "src", files)


def test_parse_size_accepts_hf_and_binary_units() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5KB") == 1500
    assert parse_size(123) == 123
    for bad in ("5 parsecs", "GB", 0, -3, True, 1.5):
        with pytest.raises(PlanError, match="Cannot use shard size"):
            parse_size(bad)


def test_plan_reads_headers_only_and_describes_the_run(llama_sample: Path) -> None:
    catalog = open_catalog(llama_sample)
    IO.reset()
    plan = wb.plan(catalog, shard_size="300KB")
    assert IO.snapshot()["bytes_read"] == 0 and IO.snapshot()["files_opened"] == []
    assert plan.ok and plan.problems == []
    assert len(plan.outputs) == len(catalog) == 39
    assert {"dtype", "shape", "nbytes", "file", "offset", "rank"} <= set(plan.outputs.columns)
    assert plan.outputs.loc["lm_head.weight", "shape"] == (256, 64)
    assert plan.files_read["bytes_read"].sum() == catalog.total_bytes == plan.bytes_read
    assert sorted(plan.files_read["file"]) == sorted(catalog.files)
    assert plan.peak_bytes == 0  # byte copies hold no tensors
    sizes = [f.tensor_bytes for f in plan.output_file_list]
    assert len(sizes) == 3 and all(s <= 300_000 for s in sizes)
    index = plan.index
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == catalog.total_bytes
    assert set(index["weight_map"].values()) == {f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)}
    text = str(plan)
    assert "status: OK" in text and "model-00003-of-00003.safetensors" in text
    assert "<table>" in plan._repr_html_()
    assert len(plan.groups) == 39 and len(plan.memory) == 39 and list(plan.ranks["rank"]) == [0]


def test_plan_without_torch_or_pandas(llama_sample: Path) -> None:
    code = (
        "import sys, workbench as wb\n"
        f"p = wb.plan({str(llama_sample)!r}, shard_size='300KB', dtype='bf16')\n"
        "s = p.summary(); assert p.ok and p.peak_bytes > 0\n"
        "print('torch' in sys.modules, 'pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_wb_plan_stays_the_function_after_planning_modules_are_imported(llama_sample: Path) -> None:
    from importlib import import_module

    planning = import_module("workbench.planning")
    import_module("workbench.planning.build")
    import_module("workbench.planning.model")
    assert callable(wb.plan) and wb.plan is planning.plan
    assert wb.plan(llama_sample).ok


def test_shards_filled_greedily_in_source_order(four_files: Path) -> None:
    plan = wb.plan(four_files, shard_size=3 * 4096)
    layout = {f.name: [t.name for t in f.layout.tensors] for f in plan.output_file_list}
    assert layout == {
        "model-00001-of-00006.safetensors": ["t00", "t01", "t02"],
        "model-00002-of-00006.safetensors": ["t03", "t04", "t05"],
        "model-00003-of-00006.safetensors": ["t06", "t07", "t08"],
        "model-00004-of-00006.safetensors": ["t09", "t10", "t11"],
        "model-00005-of-00006.safetensors": ["t12", "t13", "t14"],
        "model-00006-of-00006.safetensors": ["t15"],
    }
    again = wb.plan(four_files, shard_size=3 * 4096)
    assert again.fingerprint == plan.fingerprint
    assert [f.layout.header for f in again.output_file_list] == [f.layout.header for f in plan.output_file_list]
    single = wb.plan(four_files)
    assert [f.name for f in single.output_file_list] == ["model.safetensors"] and single.index is None


def test_oversized_tensor_gets_its_own_shard(tmp_path: Path) -> None:
    src = write_headers_only(tmp_path / "src", {"model.safetensors": [f32("a", 10), f32("big", 1000), f32("c", 10)]})
    plan = wb.plan(src, shard_size=1000)
    assert [[t.name for t in f.layout.tensors] for f in plan.output_file_list] == [["a"], ["big"], ["c"]]
    assert plan.ok
    (warning,) = plan.warnings
    assert "'big'" in warning.message and "shard of its own" in warning.message


def _concat_group(names: list[str], catalog, out: str) -> Group:
    inputs = tuple(catalog[n] for n in names)
    rows = sum(t.shape[0] for t in inputs)
    recipe = {out: tuple(ByteSlice(t.name, 0, t.nbytes) for t in inputs)}
    return Group(inputs, (TensorInfo(out, "F32", (rows,)),), M.Concat(names, out), recipe=recipe, label="concat")


def test_group_outputs_stay_in_one_shard_and_files_span_when_needed(four_files: Path) -> None:
    catalog = open_catalog(four_files)
    pair = Group(
        (catalog["t01"], catalog["t02"]),
        (f32("x", 1024), f32("y", 1024)),
        M.Parallel(M.Rename("t01", "x"), M.Rename("t02", "y")),
        recipe={"x": (ByteSlice("t01", 0, 4096),), "y": (ByteSlice("t02", 0, 4096),)},
    )
    first = Group((catalog["t00"],), (f32("t00", 1024),), M.Identity("t00"), recipe={"t00": (ByteSlice("t00", 0, 4096),)})
    plan = wb.plan(catalog, Binding([first, pair]), shard_size=2 * 4096)
    assert [[t.name for t in f.layout.tensors] for f in plan.output_file_list] == [["t00"], ["x", "y"]]
    # a group larger than a shard is split over consecutive shards, which then share a rank
    wide = Group(
        tuple(catalog[f"t0{i}"] for i in range(4)),
        tuple(f32(f"o{i}", 1024) for i in range(4)),
        None,
        recipe={f"o{i}": (ByteSlice(f"t0{i}", 0, 4096),) for i in range(4)},
    )
    rest = [Group((catalog[n],), (catalog[n].meta(),), None, recipe={n: (ByteSlice(n, 0, 4096),)}) for n in ("t04", "t05")]
    plan = wb.plan(catalog, Binding([wide, *rest]), shard_size=2 * 4096, nproc=2)
    ranks = {f.name: f.rank for f in plan.output_file_list}
    assert len(ranks) == 3
    assert ranks["model-00001-of-00003.safetensors"] == ranks["model-00002-of-00003.safetensors"] == 0
    assert ranks["model-00003-of-00003.safetensors"] == 1


def test_files_holding_nothing_needed_are_never_opened(four_files: Path) -> None:
    plan = wb.plan(four_files, M.Rename("t09", "only"), rest="drop")
    assert plan.ok
    assert list(plan.files_read["file"]) == ["model-00003-of-00004.safetensors"]
    assert plan.source_paths() == [str(four_files / "model-00003-of-00004.safetensors")]
    assert list(plan.outputs.index) == ["only"]


def test_ranks_own_contiguous_balanced_runs_of_files(four_files: Path) -> None:
    plan = wb.plan(four_files, shard_size=2 * 4096, nproc=3)
    owners = [f.rank for f in plan.output_file_list]
    assert owners == sorted(owners) and sorted(set(owners)) == [0, 1, 2]
    assert max(owners.count(r) for r in range(3)) == 3  # 8 files over 3 ranks: 3, 3, 2 (contiguous)
    for rank in range(3):
        files = set(plan.reads(rank))
        assert files and all(f.rank == rank for f in plan.output_file_list if f.name in plan.ranks.loc[rank, "files"])
    # rank 0 reads the first source files only: source-file affinity
    assert set(plan.reads(0)) <= {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"}
    shared = wb.plan(four_files, shard_size="1GB", nproc=2)  # one file: both ranks write half its tensors (planning.ranks)
    (file,) = shared.output_file_list
    assert shared.ok and file.ranks == (0, 1) and not shared.warnings
    assert [sum(s.bytes_out for s in shared.rank_steps(r)) for r in (0, 1)] == [file.tensor_bytes // 2] * 2
    idle = wb.plan(four_files, M.Rename("t09", "only"), rest="drop", nproc=2)  # one small tensor cannot be cut
    assert idle.ok and any("Only 1 of 2 ranks" in p.message for p in idle.warnings)


def test_balanced_runs_minimise_the_largest_load() -> None:
    assert balanced_runs([5, 5, 2], 2) == [[0], [1, 2]]
    assert balanced_runs([1, 1, 1, 1], 3) in ([[0, 1], [2], [3]], [[0], [1], [2, 3]], [[0], [1, 2], [3]])
    assert len(balanced_runs([1, 1, 1, 1], 3)) == 3
    assert balanced_runs([7], 4) == [[0]]
    assert balanced_runs([], 2) == []


def test_destination_checks(four_files: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    assert wb.plan(four_files, dest=dest).ok  # does not exist yet: fine
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    busy = wb.plan(four_files, dest=dest)
    assert not busy.ok and "destination not empty" in busy.errors[0].message and "notes.txt" in busy.errors[0].message
    assert wb.plan(four_files, dest=dest, overwrite=True).ok
    same = wb.plan(four_files, dest=four_files)
    assert not same.ok and "source checkpoint" in same.errors[0].message


def test_resumable_destination_keeps_complete_shards(four_files: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    plan = wb.plan(four_files, dest=dest, shard_size=2 * 4096)
    first, second = plan.output_file_list[:2]
    (dest / MANIFEST_NAME).write_text(json.dumps({"fingerprint": plan.layout_fingerprint}))
    with open(dest / first.name, "wb") as fh:  # complete: planned header and size
        fh.write(first.layout.header)
        fh.truncate(first.size)
    (dest / second.name).write_bytes(b"not the planned header")
    resumed = wb.plan(four_files, dest=dest, shard_size=2 * 4096)
    assert resumed.ok and resumed.kept == {first.name}
    assert resumed.bytes_written == plan.bytes_written - first.size
    assert resumed.reads()["model-00001-of-00004.safetensors"] == 2 * 4096  # t00, t01 are kept: only t02, t03 read
    other = wb.plan(four_files, dest=dest, shard_size=4 * 4096)
    assert not other.ok and "different plan" in other.errors[0].message


def test_not_enough_free_disk(four_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from workbench.planning import destination

    monkeypatch.setattr(destination.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6, 100))
    plan = wb.plan(four_files, dest=tmp_path / "out")
    assert not plan.ok and "not enough free disk" in plan.errors[0].message


def test_predicted_memory_of_casts_and_compute(four_files: Path) -> None:
    cast = wb.plan(four_files, dtype="bf16", chunk_size=1000)
    step = cast.steps[0]
    assert step.kind == "cast" and step.group.chunk_cast == "BF16"
    assert step.held_bytes == 250 * 4 + 250 * 2  # 250 F32 elements in, 250 BF16 out per chunk
    assert cast.peak_bytes == 1500 and not cast.needs_torch  # F32 -> BF16 is numpy's
    assert "casts by numpy" in cast.summary()
    to_f16 = wb.plan(four_files, dtype="f16", chunk_size=1000)
    assert to_f16.needs_torch and "torch needed" in to_f16.summary()
    fused = wb.plan(four_files, M.Sequential(M.Concat(["t03", "t04"], "cat"), M.Cast("cat", "bf16")), rest="drop")
    (step,) = fused.steps
    assert step.kind == "pieces" and step.held_bytes == 4096 + 2048  # each input cast and written alone (mapper.pieces)
    assert fused.peak_bytes == 6144


def test_problems_from_binding_duplicates_and_empty_output(four_files: Path) -> None:
    catalog = open_catalog(four_files)
    twice = Binding([
        Group((catalog["t00"],), (f32("same", 1024),), None, recipe={"same": (ByteSlice("t00", 0, 4096),)}),
        Group((catalog["t01"],), (f32("same", 1024),), None, recipe={"same": (ByteSlice("t01", 0, 4096),)}),
    ])
    plan = wb.plan(catalog, twice)
    assert not plan.ok and any("two groups produce it" in p.message for p in plan.errors)
    empty = wb.plan(catalog, M.Drop("t00"), rest="drop")
    assert not empty.ok and "produces no tensors" in empty.errors[0].message
    missing = wb.plan(catalog, M.Rename("nope", "x"))
    assert not missing.ok and "nope" in missing.errors[0].message
    assert len(missing.problems_frame()) == len(missing.problems)
    with pytest.raises(PlanError, match="nproc"):
        wb.plan(catalog, nproc=0)


def test_fingerprint_ignores_hash_seed(llama_sample: Path) -> None:
    code = (
        "from workbench import plan\nfrom workbench.mapper import presets\n"
        f"m = presets.hf_to_fused({str(llama_sample / 'config.json')!r})\n"
        f"print(plan({str(llama_sample)!r}, m, shard_size='200KB', nproc=2).fingerprint)\n"
    )
    prints = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(prints) == 1


class _AssemblingReader:
    """A reader whose tensors are assembled from pieces in two files (like flat shards of two ranks)."""

    def locate(self, info):
        return None

    def sources_of(self, info):
        return [(info.file, info.nbytes // 2), ("model-00004-of-00004.safetensors", info.nbytes - info.nbytes // 2)]

    def read_bytes(self, info):  # pragma: no cover - planning never reads
        raise AssertionError("the planner read tensor data")


def test_tensors_assembled_from_several_files_count_every_file(four_files: Path) -> None:
    from workbench.catalog import Catalog

    base = open_catalog(four_files)
    catalog = Catalog(root=base.root, format="flat", tensors=base.tensors, files=base.files, reader=_AssemblingReader())
    plan = wb.plan(catalog, M.Rename("t00", "x"), rest="drop")
    assert plan.reads() == {"model-00001-of-00004.safetensors": 2048, "model-00004-of-00004.safetensors": 2048}
    assert plan.peak_bytes == 4096  # an unlocated input is read whole and held while its pieces are copied


def test_headline_is_the_top_of_the_summary(four_files: Path) -> None:
    plan = wb.plan(four_files, dtype="bf16")
    head = plan.headline()
    assert head[1] == "status: OK" and plan.summary().startswith("\n".join(head))
    ck = wb.open_checkpoint(four_files)
    assert ck.headline().startswith("16 tensors in 4 file(s)")


def test_config_dtype_follows_a_cast_and_a_layout_change_is_said(tiny_checkpoint, tmp_path: Path) -> None:
    folder = tiny_checkpoint()
    config = {
        "architectures": ["LlavaForConditionalGeneration"], "torch_dtype": "float32", "image_token_index": 3,
        "text_config": {"dtype": "float32", "rope_theta": 10000.0}, "vision_config": {"torch_dtype": "float32"},
        "audio_config": {"dtype": "auto"},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    cast = wb.plan(folder, dtype="bf16", dest=tmp_path / "out")
    updated = cast.extras_table.set_index("path").loc["config.json"]
    assert updated["action"] == "update" and "text_config.dtype: float32 -> bfloat16" in updated["reason"]
    assert "extra updated: config.json (the weights are stored as bfloat16: " in cast.summary()
    assert "copied unchanged" not in cast.summary()  # no mapper: the layout is unchanged
    wb.convert(folder, tmp_path / "out", dtype="bf16", quiet=True)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {**config, "torch_dtype": "bfloat16", "text_config": {"dtype": "bfloat16", "rope_theta": 10000.0},
                       "vision_config": {"torch_dtype": "bfloat16"}}
    assert list(written) == sorted(config)  # the source's key order is kept
    # Without a cast the config is copied byte for byte.
    same = wb.plan(folder, dest=tmp_path / "same")
    assert same.extras_table.set_index("path").loc["config.json", "action"] == "copy"
    # A mapper that renames tensors: the config is copied unchanged, and the plan says so.
    renamed = wb.plan(folder, M.Rename("lm_head.weight", "output.weight"), dest=tmp_path / "renamed")
    assert "extra copied unchanged: config.json (the mapper renames 'lm_head.weight' to 'output.weight', so the config may not " \
           "describe the output's layout" in renamed.summary()
    assert renamed.extras_table.set_index("path").loc["config.json", "action"] == "copy"
    assert "copied unchanged" not in wb.plan(folder, M.Rename("lm_head.weight", "lm_head.weight")).summary()
    # fp8 weights: transformers does not compute in fp8, so the config is left alone, with a note.
    fp8 = wb.plan(folder, dtype="F8_E4M3", dest=tmp_path / "fp8")
    assert fp8.extras_table.set_index("path").loc["config.json", "action"] == "copy"
    assert "extra copied unchanged: config.json (it says dtype float32 but the weights are stored as F8_E4M3" in fp8.summary()


def test_source_metadata_beyond_format_is_reported(tiny_checkpoint, tmp_path: Path) -> None:
    folder = tiny_checkpoint(metadata={"format": "pt", "ss_network_dim": "4"})
    plan = wb.plan(folder, dest=tmp_path / "out")
    assert "source header metadata kept: ss_network_dim" in plan.summary()
    assert plan.output_metadata == {"model.safetensors": {"format": "pt", "ss_network_dim": "4"}}
    dcp = wb.plan(folder, dest=tmp_path / "dcp", to="dcp")
    assert any("ss_network_dim" in p.message and "DCP" in p.message for p in dcp.warnings)
    plain = wb.plan(tiny_checkpoint(name="plain"), dest=tmp_path / "plain")
    assert "header metadata" not in plain.summary()


def test_a_catalog_built_in_memory_never_picks_up_the_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    plan = wb.plan(Catalog.from_infos([TensorInfo("w", "F32", (4,))]))
    assert plan.extras == [] and plan.extra_files == []


def test_shared_recipes_are_read_as_their_byte_slices(llama_sample: Path) -> None:
    # Planning reads fused groups' shared recipes (LazyRecipe.spans) without making ByteSlices: the step reads,
    # page-alignment weights and fingerprint must equal those of the same recipes as plain dicts.
    import dataclasses

    from workbench.mapper.recipes import LazyRecipe
    from workbench.planning.fingerprint import layout_fingerprint
    from workbench.planning.page_align import congruent_bytes
    from workbench.planning.schedule import SourceAccess, step_cost, step_kind

    catalog = open_catalog(llama_sample)
    plan = wb.plan(catalog, M.presets.hf_to_fused(llama_sample / "config.json"))
    shared = [s for s in plan.steps if isinstance(s.group.recipe, LazyRecipe) and len(s.group.inputs) > 1]
    assert shared
    access = SourceAccess(catalog.reader)
    for step in shared:
        kind = step_kind(step.group, access)
        plain = dataclasses.replace(step.group, recipe=dict(step.group.recipe))
        assert (step.kind, step.held_bytes, step.reads) == (kind, *step_cost(plain, kind, step.bytes_out, access, plan.options.chunk_bytes))
    flat = [dataclasses.replace(s, group=dataclasses.replace(s.group, recipe=dict(s.group.recipe))) if s.group.recipe else s for s in plan.steps]
    assert layout_fingerprint(catalog, plan.steps, plan.output_file_list, None) == layout_fingerprint(catalog, flat, plan.output_file_list, None)
    placed = {t.name: t.begin - plan.output_file_list[0].layout.tensors[0].begin for t in plan.output_file_list[0].layout.tensors}
    locate = catalog.reader.locate

    def offset(info):
        where = locate(info)
        return None if where is None else where[1]

    weights = congruent_bytes(plan.steps, placed, offset)
    assert weights and weights == congruent_bytes(flat, placed, offset)
