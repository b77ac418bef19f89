"""FP8 quantisation with a block that does not divide a shape plans a warning naming the tensors (issue 29, D5a).

The workbench scales a partial edge tile by its own scale, but transformers' dequantisation on load (CPU,
GPUs below compute capability 8.9, dequantize=True) takes the tile size from the scale grid, so it reads
such an output wrongly: the plan must not say a plain "OK".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M


def _source(tmp_path: Path, shapes: dict[str, tuple[int, int]]) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    gen = torch.Generator().manual_seed(1)
    tensors = {name: (torch.randn(*shape, generator=gen) * torch.linspace(0.1, 10, shape[0])[:, None]).to(torch.bfloat16)
               for name, shape in shapes.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    return folder


PARTIAL = {
    "model.layers.0.self_attn.q_proj.weight": (200, 256),  # rows: a partial tile of 72
    "model.layers.0.self_attn.o_proj.weight": (256, 256),  # whole tiles
    "model.layers.0.mlp.down_proj.weight": (256, 129),  # cols: a partial tile of 1
}


def test_partial_fp8_tiles_are_a_plan_warning_naming_the_tensors(tmp_path: Path) -> None:
    source = _source(tmp_path, PARTIAL)
    plan = wb.plan(source, M.presets.quantize_fp8(block=(128, 128), source=source))
    assert plan.ok  # a warning, not an error: the output itself is right
    warnings = [p for p in plan.problems if p.severity == "warning" and "FP8 block" in p.message]
    assert len(warnings) == 1, plan.problems
    message = warnings[0].message
    assert "'model.layers.0.self_attn.q_proj.weight' [200, 256]" in message
    assert "'model.layers.0.mlp.down_proj.weight' [256, 129]" in message
    assert "o_proj" not in message and "2 quantised tensor(s)" in message and "transformers" in message
    assert warnings[0].tensor == "model.layers.0.mlp.down_proj.weight"


def test_whole_tiles_plan_without_the_warning(tmp_path: Path) -> None:
    source = _source(tmp_path, {"model.layers.0.self_attn.q_proj.weight": (256, 128)})
    plan = wb.plan(source, M.presets.quantize_fp8(block=(128, 128), source=source))
    assert plan.ok and not [p for p in plan.problems if "FP8 block" in p.message]


def test_what_the_warning_is_about_transformers_reads_the_partial_tiles_wrongly(tmp_path: Path) -> None:
    """The reason, checked against transformers itself: its load-time dequantisation of our q_proj (200 rows, a
    [2, 2] grid: it assumes 100-row tiles) is far from the weight, ours is within FP8 rounding."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    source = _source(tmp_path, PARTIAL)
    wb.convert(source, tmp_path / "fp8", M.presets.quantize_fp8(block=(128, 128), source=source), quiet=True)
    fp8 = load_file(tmp_path / "fp8" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    original = load_file(source / "model.safetensors")[name].float()
    theirs = Fp8Dequantize(None)._dequantize_one(fp8[name], fp8[name + "_scale_inv"], torch.float32)
    wb.convert(tmp_path / "fp8", tmp_path / "back", M.presets.dequantize_fp8(tmp_path / "fp8", dtype="fp32"), quiet=True)
    ours = load_file(tmp_path / "back" / "model.safetensors")[name]
    tolerance = original.abs().max().item() / 8  # e4m3 keeps 3 mantissa bits
    assert (ours - original).abs().max().item() < tolerance
    assert (theirs - ours).abs().max().item() > 2 * tolerance  # 100-row tiles: rows 100..127 get tile 1's scale
