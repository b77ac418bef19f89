"""`M.presets.decompress` at a size where the tensors matter: a real `workbench convert --preset decompress` peaks
(VmHWM, measured in the child) within 15 % of `plan.rss_bytes`, for packed rows streamed from disk (compressed-tensors)
and for whole GPTQ linears."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import workbench as wb
from tests.conftest import run_cli_measured
from workbench import mapper as M

MIB = 1 << 20
pytestmark = pytest.mark.serial  # measures peak RSS: run alone (see conftest.SERIAL_MARKERS)


def make_packed(folder: Path, method: str, layers: int = 4, rows: int = 4096, cols: int = 4096) -> Path:
    """`layers` int4 group-128 linears of [rows, cols] (random packed words, bf16 / fp16 scales) and a norm; bit
    exactness is tested on the library's own fixtures (test_compressed, test_gptq), here only memory."""
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {"model.norm.weight": np.ones(cols, np.float32)}
    for i in range(layers):
        name = f"model.layers.{i}.mlp.down_proj"
        if method == "compressed-tensors":
            tensors[f"{name}.weight_packed"] = rng.integers(-2**31, 2**31, (rows, cols // 8), dtype=np.int64).astype(np.int32)
            tensors[f"{name}.weight_scale"] = rng.random((rows, cols // 128), np.float32) * 0.01 + 1e-3
            tensors[f"{name}.weight_shape"] = np.array([rows, cols], np.int64)
        else:
            tensors[f"{name}.qweight"] = rng.integers(-2**31, 2**31, (cols // 8, rows), dtype=np.int64).astype(np.int32)
            tensors[f"{name}.qzeros"] = np.full((cols // 128, rows // 8), 0x77777777, np.int32)
            tensors[f"{name}.scales"] = (rng.random((cols // 128, rows), np.float32) * 0.01).astype(np.float16)
            tensors[f"{name}.g_idx"] = (np.arange(cols) // 128).astype(np.int32)
    as_torch = {k: torch.from_numpy(v) for k, v in tensors.items()}
    for name in [k for k in as_torch if k.endswith(".weight_scale")]:
        as_torch[name] = as_torch[name].to(torch.bfloat16)
    save_file(as_torch, str(folder / "model.safetensors"))
    if method == "compressed-tensors":
        quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "pack-quantized",
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group"}}}}
    else:
        quant = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    config = {"model_type": "llama", "torch_dtype": "bfloat16", "quantization_config": quant}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to read a process's peak RSS")
@pytest.mark.parametrize("method", ["compressed-tensors", "gptq"])
def test_a_real_decompression_peaks_within_15_percent_of_the_prediction(tmp_path, method):
    source = make_packed(tmp_path / "src", method)
    plan = wb.plan(source, M.presets.decompress(source))
    assert plan.ok, plan.problems
    assert plan.peak_bytes > 20 * MIB  # the tensor part matters: not only start-up is compared
    out = tmp_path / "out"
    measured = None
    for _ in range(3):  # noise only adds to RSS: the smallest run is what the process needs
        _, run = run_cli_measured(["convert", str(source), str(out), "--preset", "decompress"])
        measured = run if measured is None else min(measured, run)
        if abs(plan.rss_bytes - measured) <= 0.15 * measured:
            break
        shutil.rmtree(out, ignore_errors=True)
    parts = plan.rss_breakdown.to_dict("records") if hasattr(plan.rss_breakdown, "to_dict") else plan.rss_breakdown
    assert abs(plan.rss_bytes - measured) <= 0.15 * measured, json.dumps(
        {"predicted": plan.rss_bytes, "measured": measured, "parts": parts}, default=str)
