"""Ready-made mappers for model families and training stacks. Each returns an ordinary mapper: export it, edit it, compose it.

    from workbench import mapper as M
    mapper = M.presets.hf_to_fused("config.json")        # q/k/v and gate/up fused, sizes from the config

Model facts (heads, kv heads, head size, biases) come from `config`: a config.json path, a
transformers config object or a dict. `layers` is the template of one decoder layer's prefix.

The presets build on the operation algebra of `workbench.mapper` and nothing in the algebra imports
them. Each family lives in its own module (HF, Meta and Megatron-QKV layouts and LoRA routing in
`layouts`, transformers' registry in `transformers_layout`, Megatron in `megatron`, PEFT adapters in
`lora`, quantised weights in `quantized` (packed formats: `packed`, `compressed`, `gptq`, `packed_preset`), averaging in `averaging`, output layouts in `output_presets`
and `gguf_preset`); this package names them all, lists the ones front ends offer (`PRESETS`) and imports a module on first use, so that reading
one preset's kernel (the engine's GGUF rows, say) does not import every family.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Public name -> (submodule, name there).
_LAZY: dict[str, tuple[str, str]] = {
    **{name: ("layouts", name) for name in (
        "LAYERS", "LLAMA_LORA_TARGETS", "MEGATRON_QKV", "add_prefix", "average", "cast_policy", "fold_names",
        "fused_to_hf", "hf_to_fused", "hf_to_megatron_qkv", "hf_to_meta", "lora_merge", "lora_unwrap", "lora_wrap",
        "megatron_qkv_to_hf", "meta_to_hf", "strip_prefix",
    )},
    "dequantize_fp8": ("quantized", "dequantize_fp8"), "dequantize_mxfp4": ("quantized", "dequantize_mxfp4"),
    "quantize_fp8": ("quantized", "quantize_fp8"), "decompress": ("packed_preset", "decompress"), "from_transformers": ("transformers_layout", "from_transformers"),
    "gguf_to_hf": ("gguf_inverse", "gguf_to_hf"),
    "megatron_merge": ("megatron", "megatron_merge"), "merge": ("averaging", "merge"),
    "megatron_to_hf": ("megatron", "megatron_to_hf"),
    "megatron_hf_config": ("megatron", "hf_config"), "meta_mp_merge": ("output_presets", "meta_mp_merge"),
}

__all__ = sorted([*_LAZY, "PRESETS"])

# The presets front ends offer (the builder's list, `workbench convert --preset NAME`, `ck.suggest()`):
# name under `M.presets` -> what it does, in a few words. Each is called with what its first parameter
# asks for (`config`: the model's config.json; `source`/`sources`: the checkpoint; nothing: its defaults;
# `lora_merge`: the folder of the source named 'adapter'), see `suggest.build_preset`.
# Register a new preset here to make it appear everywhere.
PRESETS: dict[str, str] = {
    "from_transformers": "checkpoint → transformers-5 in-memory layout (experts stacked)",
    "hf_to_fused": "HF → fused qkv_proj + gate_up_proj",
    "fused_to_hf": "fused → HF q/k/v + gate/up",
    "hf_to_meta": "HF Llama → Meta original",
    "meta_to_hf": "Meta original → HF Llama",
    "meta_mp_merge": "Meta model-parallel consolidated.NN.pth files → whole tensors (Meta names)",
    "hf_to_megatron_qkv": "HF → Megatron interleaved QKV",
    "megatron_qkv_to_hf": "Megatron interleaved QKV → HF",
    "megatron_merge": "Megatron TP/PP rank shards → whole tensors (Megatron names)",
    "megatron_to_hf": "Megatron GPT (legacy shards or torch_dist) → HF Llama/Qwen2",
    "cast_policy": "cast to bf16 (norms and biases F32)",
    "strip_prefix": "strip the 'model.' prefix",
    "add_prefix": "add a 'model.' prefix",
    "dequantize_fp8": "FP8 block-scaled weights → bf16 (scales from quantization_config)",
    "dequantize_mxfp4": "MXFP4 experts (gpt-oss) → bf16, transformers layout",
    "decompress": "compressed-tensors / GPTQ / AWQ packed weights → bf16 (format from quantization_config)",
    "gguf_to_hf": "llama.cpp GGUF → HF safetensors (de-quantised, q/k un-permuted, config and tokenizer from metadata)",
    "quantize_fp8": "linear weights → FP8 with 128×128 block scales (+ quantization_config)",
    "lora_merge": "merge the PEFT adapter of source 'adapter'",
    "average": "average every source (uniform)",
}


# No public name may also name a submodule: importing the submodule would rebind the package attribute to it
# (hence `averaging.py` for the `average` preset).


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'workbench.mapper.presets' has no attribute {name!r}") from None
    value = getattr(import_module(f".{module}", __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
