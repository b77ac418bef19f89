"""Build compressed-tensors' 2:4 sparse checkpoints (`sparse-24-bitmask`) and the library's own decompression of them.

compressed-tensors 0.20.0 (the project's venv) no longer holds the sparse compressors ("legacy format", removed after
0.14.0), but checkpoints made by them are on the Hub. This script imports compressed-tensors 0.14.0, the last release
that holds `Sparse24BitMaskCompressor`, from its wheel unpacked under .cache/fixtures/ (pure Python: it runs on the
project's torch and transformers), makes tiny Llama models whose linears are 2:4 pruned (random bf16 weights, the
smallest two of every four along a row set to zero), quantises them with a scheme (or not), compresses them with the
library's `ModelCompressor` (quantisation then sparsity, as llm-compressor saves them) and writes for each case:

    <case>/config.json, <case>/model.safetensors   the checkpoint as the library saves it
    expected/<case>.safetensors                     `ModelCompressor.decompress` of it: every module's dense weight

MANIFEST.json records the tool versions and the digests (scripts/fixture_manifest.py). Usage:

    python scripts/make_sparse24_fixtures.py            # build in .cache/fixtures/sparse24-<ct>/ (no-op when done)
    python scripts/make_sparse24_fixtures.py --commit   # build, then replace tests/fixtures/compressed_tensors/
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CT_VERSION = "0.14.0"
REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "fixtures"
COMMITTED = REPO / "tests" / "fixtures" / "compressed_tensors"
# case -> (compressed-tensors preset scheme or None (sparsity alone), quantisation format or None)
CASES = {
    "sparse24-bf16": (None, None),
    "sparse24-fp8-channel": ("FP8_DYNAMIC", "float-quantized"),
    "sparse24-int8-channel": ("W8A8", "int-quantized"),
}
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 64, 2, 4, 2, 64


def library_root() -> Path:
    """compressed-tensors 0.14.0's wheel unpacked (downloaded with pip once)."""
    root = CACHE / f"compressed-tensors-{CT_VERSION}"
    if not (root / "compressed_tensors" / "__init__.py").exists():
        wheels = CACHE / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"compressed-tensors=={CT_VERSION}", "--no-deps", "-q",
                        "-d", str(wheels)], check=True)
        wheel = next(wheels.glob(f"compressed_tensors-{CT_VERSION}-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(root)
    return root


def prune_24(weight):
    """The two largest magnitudes of every four consecutive values of a row kept, the others zero."""
    import torch

    groups = weight.reshape(-1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.abs().float().topk(2, dim=1).indices, True)
    return (groups * keep).reshape(weight.shape)


def calibrate(model) -> None:
    """Per-channel scales from each weight's min / max, through the library's `calculate_qparams`."""
    from compressed_tensors.quantization.utils import calculate_qparams

    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        weight = module.weight.data
        scale, zero = calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def build_case(folder: Path, expected_file: Path, scheme: str | None, quant_format: str | None, seed: int) -> None:
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                      tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(prune_24(torch.randn_like(module.weight) * 0.05))
    if scheme is not None:
        apply_quantization_config(model, QuantizationConfig(
            config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"]))
        calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model, sparsity_config_or_format="sparse-24-bitmask",
                                                       quantization_format=quant_format)
    compressor.sparsity_config.targets = ["Linear"]
    compressor.sparsity_config.ignore = ["lm_head"]
    compressor.compress_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = torch.bfloat16
    model.config.save_pretrained(folder)
    compressor.update_config(str(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    # the library's own decompression into a fresh model of the same config
    fresh = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    loaded = ModelCompressor.from_pretrained(str(folder))
    loaded.decompress(str(folder), fresh)
    expected = {f"{name}.weight": module.weight.data.contiguous() for name, module in fresh.named_modules()
                if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    expected_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(expected, expected_file)


def build(root: Path) -> Path:
    import importlib.metadata as metadata

    import torch
    import transformers

    sys.path.insert(0, str(library_root()))
    import compressed_tensors

    assert compressed_tensors.__version__.startswith(CT_VERSION), compressed_tensors.__version__
    if root.exists():
        shutil.rmtree(root)
    for seed, (case, (scheme, quant_format)) in enumerate(sorted(CASES.items())):
        build_case(root / case, root / "expected" / f"{case}.safetensors", scheme, quant_format, seed)
    sys.path.insert(0, str(REPO / "scripts"))
    from fixture_manifest import digests

    tools = {"compressed-tensors": compressed_tensors.__version__, "torch": torch.__version__,
             "transformers": transformers.__version__, "safetensors": metadata.version("safetensors")}
    runs = [*sorted(CASES), "expected"]
    manifest = {"made_by": "scripts/make_sparse24_fixtures.py", "tools": tools, "runs": runs, "files": digests(root, runs),
                "format": "case/{config.json, model.safetensors}: the checkpoint compressed-tensors saved; "
                          "expected/case.safetensors: its ModelCompressor.decompress, module.weight -> dense weight"}
    (root / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return root


if __name__ == "__main__":
    built = build(CACHE / f"sparse24-{CT_VERSION}")
    if "--commit" in sys.argv:
        if COMMITTED.exists():
            shutil.rmtree(COMMITTED)
        shutil.copytree(built, COMMITTED)
        print(f"committed {COMMITTED}")
    else:
        print(built)
