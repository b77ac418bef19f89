"""FP8 block-quantised copies of the tiny GGUF test models, stored as DeepSeek-V3 / Qwen3-FP8 checkpoints are.

Every linear projection weight (attention, MLP, shared and routed experts; not the embeddings, `lm_head`, norms
or MoE routers) becomes float8_e4m3fn beside a float32 `weight_scale_inv` grid, one scale per block of
`block` (rows, cols); config.json gains the `quantization_config` those checkpoints carry. The tiny models'
dims are below 128, so DeepSeek-V3's real [128, 128] blocks give partial tiles (one per dim, two along
q_b_proj's 192 rows); the Llama copy uses a non-square [32, 48] block, so a swapped rows/cols would show and
most tensors have several tiles, the last partial along 64-wide dims.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# family -> the block it is quantised with (DeepSeek-V3's own, and a non-square one)
BLOCKS = {"deepseek_v3": (128, 128), "llama": (32, 48), "qwen3": (128, 128)}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
          "kv_a_proj_with_mqa", "kv_b_proj")


def quantised(name: str, ndim: int) -> bool:
    """Whether a real FP8 checkpoint stores `name` in FP8: the 2-D weights of linear projections."""
    parts = name.split(".")
    return ndim == 2 and parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in LINEAR


def build_fp8(base: Path, folder: Path, block: tuple[int, int]) -> Path:
    """Write an FP8 copy of the HF model in `base` into `folder` (tokenizer files copied, config extended)."""
    from safetensors.torch import load_file, save_file

    from workbench.mapper.presets.quantized import quantize_fp8_tensor

    folder.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            shutil.copyfile(item, folder / item.name)
    tensors = load_file(base / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if quantised(name, tensor.dim()):
            out[name], out[name + "_scale_inv"] = quantize_fp8_tensor(tensor, block=block)
        else:
            out[name] = tensor
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
