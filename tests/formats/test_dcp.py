"""DCP folders (any world size, pipeline stages, Lightning sharded): reads equal torch.distributed.checkpoint's."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tests.conftest import SAMPLES, load_checked
from workbench.dtypes import to_torch
from workbench.errors import CheckpointError
from workbench.formats import open_catalog
from workbench.formats.dcp import dcp_chunks, dcp_objects, read_object
from workbench.iostats import IO

TRAINING = SAMPLES / "training"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
# torch.distributed.checkpoint is imported by the tests that save or load with it: the pytest worker running none of
# them does not pay its import when collecting this module.


def reference(folder, catalog, names) -> dict[str, torch.Tensor]:
    """What DCP itself loads, without a process group, into a template built from our metadata."""
    import torch.distributed.checkpoint as dcp

    template = {n: torch.empty(catalog[n].shape, dtype=to_torch(catalog[n].dtype)) for n in names}
    dcp.load(template, checkpoint_id=str(folder), no_dist=True)
    return template


def test_two_rank_dtensor_checkpoint_matches_dcp_load():
    folder = TRAINING / "dcp_2ranks"
    catalog = open_catalog(folder)
    assert catalog.format == "dcp" and catalog.metadata["writer_ranks"] == "2"
    expected = reference(folder, catalog, list(catalog.tensors))
    for name, ref in expected.items():
        assert torch.equal(load_checked(catalog, name), ref), name
    chunks = dcp_chunks(catalog)
    embed = chunks[chunks.tensor == "model.embed.weight"]
    assert list(embed.offsets) == [(0, 0), (5, 0)] and list(embed.sizes) == [(5, 6), (5, 6)]
    head = chunks[chunks.tensor == "model.head.weight"]  # Shard(1): column blocks
    assert list(head.offsets) == [(0, 0), (0, 5)] and list(head.sizes) == [(4, 5), (4, 4)]
    assert set(embed.file) == {"__0_0.distcp", "__1_0.distcp"}
    assert catalog.columns["chunks"]["model.embed.weight"] == 2
    assert catalog.locate("model.embed.weight") is None and catalog.locate("model.layers.0.bias") is not None


def test_non_tensor_entries_are_listed_apart_and_readable():
    catalog = open_catalog(TRAINING / "dcp_2ranks")
    objects = dcp_objects(catalog)
    assert "train_state.step" in objects.index and "train_state.step" not in catalog
    assert read_object(catalog, "train_state.step") == 3
    assert read_object(catalog, "train_state.tokens_seen") == 3 * 4096
    with pytest.raises(CheckpointError, match="no such non-tensor entry"):
        read_object(catalog, "nope")


def test_reading_one_tensor_touches_only_its_chunks():
    catalog = open_catalog(TRAINING / "dcp_2ranks")
    chunks = dcp_chunks(catalog)
    mine = chunks[chunks.tensor == "model.layers.0.bias"]
    catalog.reader.close()
    IO.reset()
    catalog.read_bytes("model.layers.0.bias")
    snap = IO.snapshot()
    assert snap["files_opened"] == [str((TRAINING / "dcp_2ranks" / mine.file.iloc[0]).resolve())]
    assert snap["bytes_read"] <= int(mine.length.sum())


def test_pipeline_stages_merge_into_one_catalog():
    folder = TRAINING / "dcp_pp"
    catalog = open_catalog(folder)
    assert catalog.format == "dcp" and catalog.metadata["stages"] == "2"
    assert catalog.columns["stage"] == {
        "model.embed.weight": 0, "model.layers.0.weight": 0, "model.layers.0.bias": 0, "model.norm.weight": 1, "model.head.weight": 1,
    }
    assert catalog["model.head.weight"].file == "pp1/__0_0.distcp"
    for stage in (0, 1):
        names = [n for n, s in catalog.columns["stage"].items() if s == stage]
        for name, ref in reference(folder / f"pp{stage}", catalog, names).items():
            assert torch.equal(load_checked(catalog, name), ref), name
    objects = dcp_objects(catalog)
    assert set(objects.stage) == {0, 1}


def test_duplicate_tensor_across_stages_warns(tmp_path):
    import torch.distributed.checkpoint as dcp

    for stage in (0, 1):
        dcp.save({"shared.weight": torch.full((2,), float(stage)), f"only{stage}": torch.ones(1)}, checkpoint_id=str(tmp_path / f"pp{stage}"), no_dist=True)
    catalog = open_catalog(tmp_path)
    assert catalog.columns["stage"]["shared.weight"] == 0
    assert torch.equal(load_checked(catalog, "shared.weight"), torch.zeros(2))
    assert any("shared.weight" in w for w in catalog.warnings)


def test_single_process_checkpoint_with_many_dtypes(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {
        "bf16": torch.randn(4, 3).bfloat16(),
        "i64": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "strided": torch.randn(6, 4).t(),
        "scalar": torch.tensor(1.5),
        "nested": {"list": [torch.ones(2), torch.zeros(3)]},
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    catalog = open_catalog(tmp_path)
    assert set(catalog.tensors) == {"bf16", "i64", "mask", "strided", "scalar", "nested.list.0", "nested.list.1"}
    for name, ref in reference(tmp_path, catalog, list(catalog.tensors)).items():
        assert torch.equal(load_checked(catalog, name), ref), name


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_metadata_with_foreign_globals_is_refused_never_run(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Marker(marker)}))
    with pytest.raises(CheckpointError, match="system") as err:
        open_catalog(tmp_path)
    assert str(tmp_path / ".metadata") in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["missing_file", "truncated_file", "garbage_metadata", "not_metadata", "bad_chunk"])
def test_damaged_checkpoints_raise_checkpoint_error_naming_the_file(tmp_path, damage):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.randn(64), "b": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    data = tmp_path / "__0_0.distcp"
    if damage == "missing_file":
        data.unlink()
    elif damage == "truncated_file":
        data.write_bytes(data.read_bytes()[:-200])
    elif damage == "garbage_metadata":
        (tmp_path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    elif damage == "not_metadata":
        (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    else:
        raw = bytearray(data.read_bytes())
        raw[-22:-18] = b"XXXX"  # break the end record of the last chunk's zip stream
        data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as err:
        catalog = open_catalog(tmp_path)
        for name in catalog.tensors:
            catalog.read_bytes(name)
    assert str(tmp_path) in str(err.value)


def test_open_catalog_detects_dcp_layouts():
    assert open_catalog(TRAINING / "dcp_2ranks").format == "dcp"
    assert open_catalog(TRAINING / "dcp_pp").format == "dcp"
    assert open_catalog(TRAINING / "lightning_fsdp.ckpt").format == "dcp"
    assert open_catalog(TRAINING / "dcp_2ranks" / ".metadata").format == "dcp"
