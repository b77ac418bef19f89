"""The Checkpoint view: tables against safetensors' own reader, loads, I/O accounting, display, scale."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import workbench as wb
from workbench.catalog import Catalog, TensorInfo
from workbench.iostats import IO
from workbench.output.safetensors import layout_file

ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64", torch.int8: "I8"}


def shard_files(folder):
    return sorted(folder.glob("*.safetensors"))


@pytest.mark.parametrize("sample", ["llama_sample", "bert_sample"])
def test_tensors_table_matches_safe_open(sample, request):
    folder = request.getfixturevalue(sample)
    ck = wb.open_checkpoint(folder)
    table = ck.tensors
    seen = set()
    for path in shard_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in list(f.keys()):
                sl = f.get_slice(name)
                row = table.loc[name]
                assert row["dtype"] == sl.get_dtype()
                assert row["shape"] == tuple(sl.get_shape())
                assert row["file"] == path.name
                tensor = f.get_tensor(name)
                assert row["numel"] == tensor.numel()
                assert row["nbytes"] == tensor.numel() * tensor.element_size()
                assert row["end"] - row["begin"] == row["nbytes"]
                seen.add(name)
    assert set(table.index) == seen
    assert list(table.columns) == ["dtype", "shape", "numel", "nbytes", "file", "begin", "end"]
    assert table.index.name == "name"


@pytest.mark.parametrize("sample", ["llama_sample", "bert_sample"])
def test_load_equals_reference_loader_for_every_tensor(sample, request):
    folder = request.getfixturevalue(sample)
    ck = wb.open_checkpoint(folder)
    expected = {}
    for path in shard_files(folder):
        expected.update(load_file(path))
    assert set(expected) == set(ck.tensors.index)
    for name, ref in expected.items():
        got = ck.load(name)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got, ref), name
    got.add_(1)  # loaded tensors own writable memory


def test_format_and_files_of_samples(llama_sample, bert_sample):
    llama = wb.open_checkpoint(llama_sample)
    assert llama.format == "hf-sharded"
    assert llama.path == llama_sample
    files = llama.files
    assert list(files.index) == [p.name for p in shard_files(llama_sample)]
    assert list(files.columns) == ["size", "header_bytes", "n_tensors", "tensor_bytes"]
    for name, row in files.iterrows():
        assert row["size"] == (llama_sample / name).stat().st_size
        assert row["size"] == row["header_bytes"] + row["tensor_bytes"]
    assert files["n_tensors"].sum() == len(llama) == 39
    index = json.loads((llama_sample / "model.safetensors.index.json").read_text())
    assert llama.tensors["nbytes"].sum() == index["metadata"]["total_size"]

    bert = wb.open_checkpoint(bert_sample / "model.safetensors")
    assert bert.format == "safetensors"
    assert list(bert.files.index) == ["model.safetensors"]


def test_opening_reads_only_headers(llama_sample):
    IO.reset()
    ck = wb.open_checkpoint(llama_sample)
    _ = ck.tensors, ck.files, ck.layers, ck.summary(), repr(ck), ck._repr_html_()
    read = IO.snapshot()["bytes_read"]
    headers = sum(f.header_bytes for f in ck.catalog.files.values())
    assert read == headers
    assert len(ck.catalog.files) == 3


def test_load_reads_only_that_tensor(llama_sample):
    ck = wb.open_checkpoint(llama_sample)
    IO.reset()
    ck.load("model.layers.2.self_attn.k_proj.weight")
    assert IO.snapshot()["bytes_read"] == ck.tensors.loc["model.layers.2.self_attn.k_proj.weight", "nbytes"] == 32 * 64 * 4


def test_unknown_tensor_suggests_close_names(llama_sample):
    ck = wb.open_checkpoint(llama_sample)
    with pytest.raises(wb.CheckpointError) as err:
        ck.load("model.layers.1.mlp.up_proj.weigth")
    message = str(err.value)
    assert "'model.layers.1.mlp.up_proj.weight'" in message
    assert "tiny-llama" in message
    with pytest.raises(wb.CheckpointError, match="See .tensors"):
        ck.load("zzzz")


def test_missing_path_is_a_checkpoint_error(tmp_path):
    with pytest.raises(wb.CheckpointError, match="no such file"):
        wb.open_checkpoint(tmp_path / "nope")


def test_load_dtypes_and_empty_tensor(tiny_checkpoint):
    tensors = {
        "bf": torch.randn(3, 5).to(torch.bfloat16),
        "half": torch.randn(7).to(torch.float16),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "q": torch.tensor([-3, 4, 127], dtype=torch.int8),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    ck = wb.open_checkpoint(tiny_checkpoint(tensors, single_file=True))
    for name, ref in tensors.items():
        got = ck.load(name)
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref), name
    assert ck.tensors.loc["scalar", "shape"] == ()
    assert ck.tensors.loc["scalar", "numel"] == 1
    assert ck.tensors.loc["bf", "dtype"] == "BF16"


def test_summary(llama_sample):
    summary = wb.open_checkpoint(llama_sample).summary(largest=3)
    assert summary.parameters == 180_800
    assert summary.total_bytes == 723_200
    assert summary.by_dtype.loc["F32", "tensors"] == 39
    assert summary.by_dtype.loc["F32", "parameters"] == 180_800
    assert summary.by_dtype.loc["F32", "share"] == 1.0
    assert list(summary.largest["nbytes"]) == [65536, 65536, 32768]
    assert set(summary.largest.index[:2]) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert "180,800 parameters" in repr(summary)
    assert "<table" in summary._repr_html_()


def test_repr_and_html(llama_sample):
    ck = wb.open_checkpoint(llama_sample)
    text = repr(ck)
    assert text.startswith("<Checkpoint hf-sharded ")
    assert "39 tensors in 3 file(s), 706.2 KiB" in text
    assert "model.layers.{i}.mlp.up_proj.weight  ×4  F32 [128, 64]" in text
    page = ck._repr_html_()
    assert "hf-sharded" in page and "706.2 KiB" in page
    assert "<td>×4</td>\n      <td>0-3</td>" in page
    assert "<th>model.layers.{i}.self_attn.k_proj.weight</th>" in page
    assert page.count("<tr>") == 12  # one row per pattern (the header row has a style attribute)
    assert "odd_layers" not in page  # shown only when some layer differs


def test_html_escapes_names(tiny_checkpoint):
    ck = wb.open_checkpoint(tiny_checkpoint({"<b>x</b>": torch.zeros(2)}, single_file=True))
    assert "<b>x</b>" not in ck._repr_html_()
    assert "&lt;b&gt;x&lt;/b&gt;" in ck._repr_html_()


def test_import_view_does_not_import_torch():
    code = (
        "import sys, workbench.explore.checkpoint as v, workbench as wb; "
        "ck = wb.open_checkpoint(sys.argv[1]); ck.tensors; ck.layers; repr(ck); ck.summary(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    from tests.conftest import SAMPLES

    subprocess.run([sys.executable, "-c", code, str(SAMPLES / "tiny-llama")], check=True)


def test_tensors_table_and_folding_of_100k_tensors(tmp_path):
    # Their speed is measured by benchmarks/bench_open.py (100k-tensor rows).
    infos = [TensorInfo(f"model.layers.{i // 50}.experts.{i % 50}.w{j}", "BF16", (2, 3)) for i in range(33_334) for j in range(3)]
    layout = layout_file("big.safetensors", infos)
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as fh:
        fh.write(layout.header)
        fh.truncate(layout.size)
    ck = wb.open_checkpoint(path)
    table = ck.tensors
    assert len(table) == 100_002
    assert table["nbytes"].sum() == 100_002 * 12
    layers = ck.layers
    assert list(layers["count"]) == [33_334] * 3
    assert layers["range"].iloc[0] == "i=0-666; j=0-49"


TRAINING = Path(__file__).resolve().parents[2] / "sample_checkpoints" / "training"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pipeline_dcp_tensors_carry_the_stage_column():
    ck = wb.open_checkpoint(TRAINING / "dcp_pp")
    table = ck.tensors
    assert list(table.columns) == ["dtype", "shape", "numel", "nbytes", "file", "begin", "end", "chunks", "stage"]
    assert ck.format_columns == ["chunks", "stage"]
    # Each stage's tensors live in that stage's folder: the column agrees with the file each row names.
    assert table["stage"].to_dict() == {name: int(file.split("/")[0].removeprefix("pp")) for name, file in table["file"].items()}
    assert set(table["stage"]) == {0, 1} and table["stage"].dtype == "int64"
    assert table.loc["model.head.weight", "stage"] == 1 and table.loc["model.embed.weight", "stage"] == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_format_columns_missing_values_are_na():
    ck = wb.open_checkpoint(TRAINING / "lightning_fsdp.ckpt")  # meta.pt tensors are not DCP chunks
    chunks = ck.tensors["chunks"]
    meta = [n for n in chunks.index if n.startswith("meta.")]
    assert meta and chunks[meta].isna().all() and (chunks.drop(meta) == 1).all()


def test_torch_file_tensors_show_tied_weights():
    path = TRAINING / "torch" / "pytorch_model.bin"
    ck = wb.open_checkpoint(path)
    table = ck.tensors
    assert list(table.columns[-2:]) == ["storage", "shared_with"]
    shared = table["shared_with"].to_dict()
    assert shared["embed.weight"] == "lm_head.weight" and shared["lm_head.weight"] == "embed.weight"
    assert shared["proj.weight"] == "proj_t.weight" and shared["norm.weight"] == ""
    state = torch.load(path, weights_only=True)  # torch agrees: the tied names share one storage
    assert state["embed.weight"].untyped_storage().data_ptr() == state["lm_head.weight"].untyped_storage().data_ptr()
    assert table.loc["embed.weight", "storage"] == table.loc["lm_head.weight", "storage"] != table.loc["norm.weight", "storage"]


def test_format_column_that_clashes_with_a_standard_one_is_prefixed():
    catalog = Catalog.from_infos([TensorInfo("a", "F32", (2,)), TensorInfo("b", "F32", (3,))])
    catalog.columns = {"file": {"a": "elsewhere"}, "rank": {"a": 0}}
    table = wb.open_checkpoint(catalog).tensors
    assert table.loc["a", "file"] == "" and table.loc["a", "format_file"] == "elsewhere"
    assert table["format_file"].isna().tolist() == [False, True]
    assert str(table["rank"].dtype) == "Int64" and table.loc["a", "rank"] == 0
