"""`plan.rss_bytes` held to ±15 % (or 8 MiB) of a real run's peak RSS (VmHWM) for the packed formats issue 33 adds:
compressed-tensors stacked experts (3-D int4 groups, asymmetric) and 2:4 sparse int8 weights, AWQ GEMV and GPTQ
3-bit, each dequantised to bf16 with numpy (headers and zeros, sparse on disk; a 2:4 bitmask of 0x33 bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench as wb
from tests.system.test_rss_cases import assert_within, measured_min, write_headers_only
from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.planning.rss import rss_parts

pytestmark = [pytest.mark.serial,  # measures peak RSS: run alone (see conftest.SERIAL_MARKERS)
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to read a process's peak RSS")]

MIB = 1 << 20
CT_GROUP = {"format": "pack-quantized", "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}


def _experts(folder: Path) -> dict:
    infos = []
    for layer, (experts, rows, cols) in enumerate([(8, 1536, 2048), (8, 2048, 1536)]):
        name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        infos += [TensorInfo(f"{name}.weight_packed", "I32", (experts, rows, cols // 8)),
                  TensorInfo(f"{name}.weight_scale", "BF16", (experts, rows, cols // 128)),
                  TensorInfo(f"{name}.weight_zero_point", "I32", (experts, rows // 8, cols // 128))]
    write_headers_only(folder, infos)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": CT_GROUP}}


def _sparse(folder: Path) -> dict:
    infos = []
    for layer, (rows, cols) in enumerate([(4096, 2048), (2048, 4096)]):
        name = f"model.layers.{layer}.mlp.down_proj"
        infos += [TensorInfo(f"{name}.compressed", "I8", (rows, cols // 2)), TensorInfo(f"{name}.bitmask", "U8", (rows, cols // 8)),
                  TensorInfo(f"{name}.weight_scale", "BF16", (rows, 1))]
    write_headers_only(folder, infos)
    catalog = wb.open_checkpoint(folder).catalog
    with open(folder / "model.safetensors", "r+b") as fh:  # two of every four values kept
        for info in catalog.tensors.values():
            if info.name.endswith(".bitmask"):
                fh.seek(info.begin)
                fh.write(b"\x33" * (info.end - info.begin))
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"format": "int-quantized", "targets": ["Linear"], "weights": weights}},
            "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}}


def _gemv(folder: Path) -> dict:
    infos = []
    for layer, (out, inp) in enumerate([(4096, 2048), (2048, 4096)]):
        name = f"model.layers.{layer}.mlp.up_proj"
        width = -(-inp // 128 // 8)
        infos += [TensorInfo(f"{name}.qweight", "I32", (out, inp // 8)), TensorInfo(f"{name}.qzeros", "I32", (out, width)),
                  TensorInfo(f"{name}.scales", "F16", (out, width * 8))]
    write_headers_only(folder, infos)
    return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}


def _gptq3(folder: Path) -> dict:
    infos = []
    for layer, (out, inp) in enumerate([(4096, 2048), (2048, 4096)]):
        name = f"model.layers.{layer}.mlp.up_proj"
        infos += [TensorInfo(f"{name}.qweight", "I32", (inp * 3 // 32, out)),
                  TensorInfo(f"{name}.qzeros", "I32", (inp // 128, out * 3 // 32)),
                  TensorInfo(f"{name}.scales", "F16", (inp // 128, out)), TensorInfo(f"{name}.g_idx", "I32", (inp,))]
    write_headers_only(folder, infos)
    return {"quant_method": "gptq", "bits": 3, "group_size": 128, "sym": False, "desc_act": False}


CASES = {"ct-experts-int4": _experts, "ct-sparse24-int8": _sparse, "awq-gemv": _gemv, "gptq-3bit": _gptq3}


@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_dequantisation_peaks_within_15_percent_of_the_prediction(tmp_path: Path, case: str) -> None:
    source = tmp_path / case
    quant = CASES[case](source)
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16",
                                                    "quantization_config": quant}))
    mapper = M.presets.decompress(source)
    (tmp_path / "mapper.py").write_text(mapper.to_code())
    plan = wb.plan(source, mapper)
    assert plan.ok, plan.problems
    assert {s.kind for s in plan.steps} == {"rows"}  # numpy row jobs, no torch
    assert {p.part: p.bytes for p in rss_parts(plan, 0)}["intermediates"] == 0
    out = tmp_path / "out"
    args = ["convert", str(source), str(out), "--mapper", str(tmp_path / "mapper.py")]
    assert_within(plan.rss_bytes, measured_min(args, out, plan.rss_bytes), plan)
