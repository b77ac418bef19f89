"""compressed-tensors' 2:4 sparse checkpoints (`sparse-24-bitmask`, alone or over int8 / FP8 channel quantisation) are
dequantised by `M.presets.decompress` bit for bit as the library's own `ModelCompressor.decompress` does.

compressed-tensors 0.20.0 (the venv's) dropped the sparse compressors, so the fixtures in tests/fixtures/
compressed_tensors/ were made by 0.14.0, the last release that holds them: `scripts/make_sparse24_fixtures.py`
compresses tiny 2:4-pruned Llama models with it and saves its own decompression of each (`expected/<case>.safetensors`).
Over int8 / FP8 the library holds the scale as float16 and returns float16 weights: fp16 output equals them, bit for
bit, and the default bf16 output equals them cast to bf16. `marlin-24`, which the library never decompressed, is refused."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError, WorkbenchError

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "compressed_tensors"
CASES = ("sparse24-bf16", "sparse24-fp8-channel", "sparse24-int8-channel")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_the_committed_fixtures_are_what_their_manifest_says():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from fixture_manifest import digests, read_manifest
    finally:
        sys.path.remove(str(REPO / "scripts"))
    manifest = read_manifest(FIXTURES)
    assert manifest["tools"]["compressed-tensors"] == "0.14.0" and tuple(manifest["runs"]) == (*CASES, "expected")
    assert digests(FIXTURES, manifest["runs"]) == manifest["files"]


@pytest.mark.parametrize("case", CASES)
def test_decompress_equals_the_library_bit_for_bit(tmp_path, case):
    folder = FIXTURES / case
    expected = load_file(FIXTURES / "expected" / f"{case}.safetensors")
    assert len(expected) == 14
    library_dtype = next(iter(expected.values())).dtype
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = tmp_path / f"out-{dtype}"
        wb.convert(folder, out, M.presets.decompress(folder, dtype=dtype), quiet=True)
        got = load_file(out / "model.safetensors")
        for name, weight in expected.items():
            want = weight if torch_dtype == library_dtype else weight.to(torch_dtype)
            assert _same_bits(got[name], want), (case, dtype, name)
        assert not [n for n in got if n.rsplit(".", 1)[-1] in ("compressed", "bitmask", "shape", "weight_scale")]
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
    original = load_file(folder / "model.safetensors")
    assert _same_bits(got["model.norm.weight"], original["model.norm.weight"])  # copied as it is


def test_catalog_columns_and_suggest():
    ck = wb.open_checkpoint(FIXTURES / "sparse24-fp8-channel")
    table = ck.tensors
    row = table.loc["model.layers.1.mlp.up_proj.compressed"]
    assert (row["quant_format"], row["quant_role"], row["quant_bits"], row["quant_group"]) == (
        "sparse-24-bitmask + float-quantized", "packed", 8, "channel")
    assert set(row["quant_parts"]) == {f"model.layers.1.mlp.up_proj.{s}" for s in ("bitmask", "shape", "weight_scale")}
    assert table.loc["model.layers.1.mlp.up_proj.bitmask", "quant_role"] == "bitmask"
    assert wb.open_checkpoint(FIXTURES / "sparse24-bf16").tensors.loc[
        "model.layers.0.self_attn.o_proj.compressed", "quant_format"] == "sparse-24-bitmask"
    suggested = ck.suggest()
    assert list(suggested["preset"])[0] == "decompress" and "sparse-24-bitmask" in list(suggested["why"])[0]


def test_plan_streams_rows_with_the_bitmask_read_whole():
    folder = FIXTURES / "sparse24-int8-channel"
    plan = wb.plan(folder, M.presets.decompress(folder), chunk_size=1024)
    groups = plan.groups
    sparse = groups[groups["label"] == "decompress_tensor"]
    assert len(sparse) == 14 and set(sparse["kind"]) == {"rows"}
    from workbench.mapper.row_jobs import row_job

    step = next(s for s in plan.steps if s.group.outputs[0].name == "model.layers.0.mlp.gate_proj.weight")
    job = row_job(step.group)
    assert job.rows == 64 and job.chunk_rows(job.budget(1024)) == 1024 // (16 + 64)
    assert {t.name.rsplit(".", 1)[1] for t in job.whole(0)} == {"bitmask", "shape", "weight_scale"}


def test_a_bitmask_that_does_not_fit_stops_the_run(tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(FIXTURES / "sparse24-bf16", folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.bitmask"
    save_file({**tensors, name: torch.full_like(tensors[name], 0xFF)}, folder / "model.safetensors")
    with pytest.raises(WorkbenchError, match="row 0 of its bitmask sets 32 bits for 16 stored values"):
        wb.convert(folder, tmp_path / "out", M.presets.decompress(folder), quiet=True)
    save_file({**tensors, name: tensors[name][:, :2].contiguous()}, folder / "model.safetensors")
    with pytest.raises(MapperError, match="up_proj.bitmask.*expected a U8 bitmask"):
        M.presets.decompress(folder)


def test_marlin_24_is_listed_and_refused_with_the_reason(tmp_path):
    folder = tmp_path / "marlin24"
    folder.mkdir()
    tensors = {"model.layers.0.mlp.up_proj.weight_packed": torch.zeros(2, 512, dtype=torch.int32),
               "model.layers.0.mlp.up_proj.scale_packed": torch.zeros(1, 64, dtype=torch.float16),
               "model.layers.0.mlp.up_proj.meta": torch.zeros(64, 2, dtype=torch.int16),
               "model.layers.0.mlp.up_proj.weight_scale": torch.zeros(64, 1, dtype=torch.float16)}
    save_file(tensors, folder / "model.safetensors")
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "marlin-24",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "marlin-24"}}}}))
    assert wb.open_checkpoint(folder).tensors.loc["model.layers.0.mlp.up_proj.weight_packed", "quant_format"] == "marlin-24"
    with pytest.raises(MapperError, match="marlin-24.*never decompressed"):
        M.presets.decompress(folder)
    assert "decompress" not in list(wb.open_checkpoint(folder).suggest()["preset"])
