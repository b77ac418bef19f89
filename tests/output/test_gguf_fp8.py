"""GGUF from FP8 block-quantised folders (DeepSeek-V3 / Qwen3-FP8 style): de-quantised first, as llama.cpp's converter
does, by rows with numpy. Byte identity with the converter for each dtype is in test_gguf_output's CASES
("deepseek_v3-fp8", "llama-fp8"); here: the plan's steps, row chunks that cut scale tiles, torch left out, the
converter's default type, --verify, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf_support.fp8 import BLOCKS
from gguf_support.reference import model_folder, reference_gguf

import workbench as wb
from tests.conftest import run_cli_measured
from workbench.errors import WorkbenchError
from workbench.formats import open_catalog
from workbench.mapper.presets.gguf_rows import row_budget, row_job

gguf = pytest.importorskip("gguf")
DEQUANTIZE = "workbench.mapper.presets.quantized:dequantize_fp8_tensor"


def test_the_plan_dequantises_fp8_weights_first_and_converts_by_rows_without_torch(tmp_path: Path) -> None:
    src = model_folder("llama-fp8")
    plan = wb.plan(src, to="gguf", dtype="q8_0", dest=tmp_path / "planned")
    scaled = {name for name, info in open_catalog(src).tensors.items() if info.dtype == "F8_E4M3"}
    steps = {step.group.outputs[0].name: step for step in plan.steps}
    q = steps["blk.0.attn_q.weight"]  # each FP8 weight: de-quantised to F32 by its scales, then permuted and quantised
    assert q.group.label == "dequantize_fp8_tensor+to_gguf" and plan.groups.label.value_counts()[q.group.label] == len(scaled) == 14
    first, convert = list(q.group.op.leaves())
    assert (first.fn, first.inputs, first.kwargs) == (DEQUANTIZE, ("model.layers.0.self_attn.q_proj.weight",
                                                                   "model.layers.0.self_attn.q_proj.weight_scale_inv"),
                                                      {"block": list(BLOCKS["llama"]), "dtype": "F32"})
    assert convert.kwargs == {"heads": 4, "kind": "Q8_0"}
    jobs = [row_job(step.group) for step in plan.steps]
    assert {step.kind for step in plan.steps} == {"rows"} and not plan.needs_torch and "no torch" in plan.summary()
    assert sum(1 for job in jobs if job.scales) == 14
    out = tmp_path / "out"
    imported, _ = run_cli_measured(["convert", str(src), str(out), "--to", "gguf", "--dtype", "q8_0", "--quiet"])
    assert not imported & {"torch", "transformers"}
    assert (out / "model.gguf").read_bytes() == reference_gguf("llama-fp8", "q8_0").read_bytes()


def test_row_chunks_that_cut_scale_tiles_give_the_same_bytes(tmp_path: Path) -> None:
    """A chunk size that makes row chunks end inside 32-row scale tiles and span two (and q/k heads permuted per chunk)."""
    src = model_folder("llama-fp8")
    chunk = "60KB"  # 14 rows of ffn_gate per chunk: chunks 28-41 and 56-69 span two tiles
    plan = wb.plan(src, to="gguf", dtype="q8_0", chunk_size=chunk, dest=tmp_path / "planned")
    per = {job.output.name: job.chunk_rows(row_budget(plan.options.chunk_bytes))
           for job in (row_job(step.group) for step in plan.steps) if job.scales}
    assert per["blk.0.ffn_gate.weight"] < 32 and BLOCKS["llama"][0] % per["blk.0.ffn_gate.weight"]
    wb.convert(src, tmp_path / "out", to="gguf", dtype="q8_0", chunk_size=chunk, quiet=True)
    assert (tmp_path / "out" / "model.gguf").read_bytes() == reference_gguf("llama-fp8", "q8_0").read_bytes()


def test_the_converters_default_type_is_bf16_here_and_equals_dtype_bf16(tmp_path: Path) -> None:
    """The converter's `--outtype auto` takes the type of the first bf16/f16 matrix it reads (the embeddings; FP8
    weights and their F32 scales are passed over): BF16. The workbench's default stays F16; dtype='bf16' is that file."""
    auto = reference_gguf("deepseek_v3-fp8", "auto")
    assert auto.read_bytes() == reference_gguf("deepseek_v3-fp8", "bf16").read_bytes()
    wb.convert(model_folder("deepseek_v3-fp8"), tmp_path / "out", to="gguf", dtype="bf16", quiet=True)
    assert (tmp_path / "out" / "model.gguf").read_bytes() == auto.read_bytes()


def test_verify_compares_against_the_dequantised_source(tmp_path: Path) -> None:
    src = model_folder("deepseek_v3-fp8")
    report = wb.convert(src, tmp_path / "out", to="gguf", dtype="q8_0", quiet=True, verify=True)
    frame = report.verification
    q8 = frame[frame.check == "compute+dequantised"]
    assert report.verified and (q8.max_abs_diff > 0).all()
    # Q8_0's error is at most half a step (block max / 127) of the de-quantised values, not of the raw float8 ones
    # (up to 448: an error against those would be hundreds).
    import torch

    from workbench.mapper.presets.quantized import dequantize_fp8_tensor

    catalog = wb.open_checkpoint(src)
    name = "model.layers.0.self_attn.q_b_proj.weight"  # 192 rows: a whole 128-row tile and a partial one
    values = dequantize_fp8_tensor(catalog.load(name), catalog.load(name + "_scale_inv"), block=BLOCKS["deepseek_v3"], dtype="F32")
    assert values.dtype == torch.float32 and tuple(values.shape) == (192, 32)
    assert 0 < q8.loc["blk.0.attn_q_b.weight", "max_abs_diff"] <= float(values.abs().max()) / 127 / 2 * 1.01
    for part in ("blk.1.attn_k_b.weight", "blk.1.ffn_up_exps.weight"):  # the MLA split and a stack of experts
        assert 0 < q8.loc[part, "max_abs_diff"] < 0.05, part


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_float8_weights_without_their_scales_or_another_method_are_refused(tmp_path: Path) -> None:
    bare = _copy(model_folder("llama-fp8"), tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    quant = config.pop("quantization_config")
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(WorkbenchError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' \(F8_E4M3\).*no quantization_config"):
        wb.plan(bare, to="gguf", dtype="q8_0")
    (bare / "config.json").write_text(json.dumps({**config, "quantization_config": {**quant, "quant_method": "compressed-tensors"}}))
    with pytest.raises(WorkbenchError, match="quant_method 'compressed-tensors'.*convert_hf_to_gguf.py"):
        wb.plan(bare, to="gguf")
    (bare / "config.json").write_text(json.dumps({**config, "quantization_config": {**quant, "weight_block_size": None}}))
    with pytest.raises(WorkbenchError, match="weight_block_size is None.*per-tensor or per-channel"):
        wb.plan(bare, to="gguf")


def test_a_dequantising_mapper_ahead_of_the_preset_is_refused() -> None:
    from workbench.mapper.presets.quantized import dequantize_fp8

    src = model_folder("llama-fp8")
    with pytest.raises(WorkbenchError, match="de-quantises FP8 checkpoints itself.*without that mapper"):
        wb.plan(src, dequantize_fp8(src), to="gguf", dtype="q8_0")


def test_a_float8_weight_missing_its_scale_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy(model_folder("llama-fp8"), tmp_path / "gap")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight_scale_inv"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WorkbenchError, match=r"'model\.layers\.1\.self_attn\.v_proj\.weight' \(F8_E4M3\) to GGUF: no "
                                             r"'model\.layers\.1\.self_attn\.v_proj\.weight_scale_inv' lies beside it"):
        wb.plan(folder, to="gguf", dtype="q8_0")


def test_the_dequantised_values_are_the_converters_float32(tmp_path: Path) -> None:
    """F32 output holds the de-quantised weights themselves: the float8 value times its tile's scale, in float32."""
    src = model_folder("llama-fp8")
    wb.convert(src, tmp_path / "out", to="gguf", dtype="f32", quiet=True)
    written = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "out" / "model.gguf").tensors}
    from safetensors.torch import load_file

    raw = load_file(src / "model.safetensors")
    weight = raw["model.layers.0.mlp.down_proj.weight"].float().numpy()  # float8 (64, 96), exactly in float32
    scales = raw["model.layers.0.mlp.down_proj.weight_scale_inv"].numpy()  # (2, 2): tiles of 32 x 48
    assert scales.shape == (2, 2) and len(np.unique(scales)) == 4
    expected = weight * np.repeat(np.repeat(scales, 32, axis=0), 48, axis=1)[:64, :96]
    assert np.array_equal(written["blk.0.ffn_down.weight"], expected)


def test_an_fp8_row_chunk_allocates_no_more_than_the_plan_counts() -> None:
    """The held bytes of an FP8 chunk add the de-quantised float32 rows, the scale grid and one row of scales to what
    a chunk holds; tracemalloc sees numpy's buffers."""
    import tracemalloc

    import ml_dtypes

    from workbench.catalog import TensorInfo
    from workbench.mapper.presets.gguf_fp8 import dequantize_rows
    from workbench.mapper.presets.gguf_rows import ROW_BUDGET, RowJob, convert_rows

    weight, scales = TensorInfo("q", "F8_E4M3", (4096, 2048)), TensorInfo("q_scale_inv", "F32", (32, 16))
    job = RowJob((weight,), TensorInfo("attn_q.weight", "U8", (1,)), "Q8_0", heads=32, scales=(scales,), block=(128, 128))
    rows = job.chunk_rows(ROW_BUDGET)
    assert rows % job.unit == 0 and 0 < job.held(rows) <= ROW_BUDGET
    data = (np.arange(rows * job.cols, dtype=np.float32) % 97 - 48).astype(ml_dtypes.float8_e4m3fn).reshape(rows, job.cols)
    tracemalloc.start()
    try:
        grid = np.full(scales.shape, 0.01, np.float32)
        buffer = np.empty(rows * job.cols, np.float32)
        values = dequantize_rows(data, grid, 100, job.block, buffer)  # rows 100.. cross the tile boundary at 128
        out, _, _ = convert_rows(values, "Q8_0", rows // job.unit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.nbytes == rows * 2048 // 32 * 34 and float(values[0, 1]) == float(data[0, 1].astype(np.float32)) * np.float32(0.01)
    assert peak + data.nbytes <= job.held(rows), (peak, job.held(rows))
