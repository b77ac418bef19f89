"""Stacked experts packed by compressed-tensors (a 3-D `weight_packed` / int8 / float8 `weight` [experts, rows, cols],
each expert packed as a 2-D weight, as the library's compressors do for MoE weights) are dequantised by
`M.presets.decompress` bit for bit as the library's own `decompress()` does, read by rows across the experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme, QuantizationStrategy, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

SCHEMES = {  # name -> (preset, changes to its weight args, format)
    "w4-group-asym": ("W4A16_ASYM", {"group_size": 32}, "pack-quantized"),
    "w4-channel-asym": ("W4A16_ASYM", {"strategy": "channel", "group_size": None}, "pack-quantized"),
    "w3-group-sym": ("W3A16", {"group_size": 32}, "pack-quantized"),
    "w8-group-sym": ("W8A16", {"group_size": 32}, "pack-quantized"),
    "fp8-channel": ("FP8", {"strategy": "channel"}, "float-quantized"),
    "int8-channel": ("INT8", {}, "int-quantized"),
}
EXPERTS = {"gate_up_proj": (4, 128, 64), "down_proj": (4, 64, 64)}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def make_experts(folder: Path, name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two MoE layers of stacked experts compressed by the library's own compressor; returns its `decompress()` of
    each (module.weight -> bf16 [experts, rows, cols])."""
    preset, changes, fmt = SCHEMES[name]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=changes)
    args = scheme.weights
    compressor = BaseCompressor.get_value_from_registry(fmt)
    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    expected = {}
    for layer in range(2):
        for proj, shape in EXPERTS.items():
            module = f"model.layers.{layer}.mlp.experts.{proj}"
            weight = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
            if args.strategy == QuantizationStrategy.GROUP:
                grouped = weight.unflatten(-1, (-1, args.group_size))
                low, high = grouped.amin(-1), grouped.amax(-1)
            else:
                low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
            scale, zero = calculate_qparams(low, high, args)
            state = {"weight": weight, "weight_scale": scale} | ({} if args.symmetric else {"weight_zero_point": zero})
            compressed = compressor.compress(state, scheme)
            expected[f"{module}.weight"] = compressor.decompress(dict(compressed), scheme)["weight"]
            tensors |= {f"{module}.{key}": value.contiguous() for key, value in compressed.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    group = QuantizationScheme.model_validate(scheme.model_dump()).model_dump(mode="json") | {"format": fmt}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "torch_dtype": "bfloat16",
                                                    "quantization_config": {"quant_method": "compressed-tensors",
                                                                            "format": fmt, "config_groups": {"group_0": group}}}))
    return expected


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_stacked_experts_equal_the_library_bit_for_bit(tmp_path, name):
    folder = tmp_path / "src"
    expected = make_experts(folder, name)
    plan = wb.plan(folder, M.presets.decompress(folder), chunk_size=2048)
    steps = [s for s in plan.steps if s.group.outputs[0].name.endswith("_proj.weight")]
    assert len(steps) == 4 and {s.kind for s in steps} == {"rows"}
    wb.convert(folder, tmp_path / "out", M.presets.decompress(folder), chunk_size=2048, quiet=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted([*expected, "model.norm.weight"])
    for tensor, weight in expected.items():
        assert _same_bits(got[tensor], weight), tensor


def test_rows_run_across_the_experts_and_the_columns_say_so(tmp_path):
    from workbench.mapper.row_jobs import row_job

    folder = tmp_path / "src"
    make_experts(folder, "w4-group-asym")
    plan = wb.plan(folder, M.presets.decompress(folder), chunk_size=2048)
    step = next(s for s in plan.steps if s.group.outputs[0].name == "model.layers.0.mlp.experts.gate_up_proj.weight")
    job = row_job(step.group)
    assert job.rows == 4 * 128 and job.in_row == 8 * 4 and job.out_row == 64 * 2
    assert job.chunk_rows(job.budget(2048)) == 2048 // (32 + 128)  # a chunk may end inside an expert
    row = wb.open_checkpoint(folder).tensors.loc["model.layers.1.mlp.experts.down_proj.weight_packed"]
    assert (row["quant_format"], row["quant_role"], row["quant_bits"], row["quant_group"]) == ("pack-quantized", "packed", 4, "32")
    assert plan.outputs.loc["model.layers.1.mlp.experts.down_proj.weight", "shape"] == (4, 64, 64)


def test_stacked_experts_with_block_scales_are_refused(tmp_path):
    folder = tmp_path / "src"
    make_experts(folder, "fp8-channel")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MapperError, match="stacked experts .* group and channel scales"):
        M.presets.decompress(folder)
