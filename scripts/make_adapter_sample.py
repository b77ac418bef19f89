"""Regenerate `sample_checkpoints/tiny-llama-lora/`: a PEFT LoRA adapter for the tiny Llama sample.

Written by the real peft library (`get_peft_model(...).save_pretrained`), so the folder holds exactly
what PEFT writes: `adapter_config.json` and `adapter_model.safetensors`. PEFT initialises lora_B to
zero (a merge would then change nothing), so every lora_B is replaced by seeded random values.

Usage: python scripts/make_adapter_sample.py [--out sample_checkpoints] [--check]
  --check  regenerate into a temp folder and fail if the tensors or the config differ from the committed ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "sample_checkpoints"
SEED = 20240608
# Config fields that record the writer's environment rather than the adapter.
VOLATILE = ("peft_version",)


def make_adapter(out: Path) -> Path:
    """LoRA r=4, alpha=8 on q/v/down projections, r=2 and alpha=4 for down_proj (rank/alpha patterns)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(out / "tiny-llama", dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                        rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 4})
    torch.manual_seed(SEED)  # lora_A is initialised randomly by PEFT
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.peft_config["default"].base_model_name_or_path = "tiny-llama"  # relative: no machine path in the sample
    folder = out / "tiny-llama-lora"
    model.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)  # PEFT's model card template, not part of the adapter
    (folder / "adapter_model.safetensors").chmod(0o644)
    return folder


def _same(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    ta, tb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    ca, cb = (json.loads((p / "adapter_config.json").read_text()) for p in (a, b))
    for key in VOLATILE:
        ca.pop(key, None)
        cb.pop(key, None)
    return ca == cb and ta.keys() == tb.keys() and all(bool((ta[k] == tb[k]).all()) for k in ta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if not args.check:
        print(make_adapter(args.out))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tiny-llama").symlink_to(args.out.resolve() / "tiny-llama")
        fresh = make_adapter(Path(tmp))
        if not _same(fresh, args.out / "tiny-llama-lora"):
            print("tiny-llama-lora differs from a fresh regeneration", file=sys.stderr)
            return 1
    print("tiny-llama-lora matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
