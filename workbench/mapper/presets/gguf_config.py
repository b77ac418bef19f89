"""An HF config.json and generation_config.json from a GGUF file's key/values, for the folder `gguf_to_hf` writes.

The keys are the ones llama.cpp's converter writes from config.json (`<arch>.block_count`, `.embedding_length`,
`.attention.head_count` ...), read back under transformers 5's names (`rope_parameters`, `dtype`). Floats GGUF stores
as float32 (norm epsilon, RoPE base) are written as the shortest decimal that is the same float32 (1e-05, not
9.999999747378752e-06), which is what config.json held before conversion in the usual case.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import MapperError

CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _f32(value: Any) -> float:
    """The shortest decimal of a float32 value (GGUF stores config floats as float32)."""
    import numpy as np

    return float(np.format_float_positional(np.float32(value), unique=True, trim="-")) if value is not None else value


def hf_config(values: Mapping[str, Any], family: str, shapes: Mapping[str, tuple[int, ...]], dtype: str) -> dict[str, Any]:
    """config.json for HF `family` (a model_type) from the GGUF key/values `values`; `shapes`: the HF output tensors'
    shapes (vocabulary size, tied embeddings, biases); `dtype`: the weights' dtype code (F32, F16, BF16)."""
    arch = str(values.get("general.architecture", ""))

    def get(key: str, default: Any = None) -> Any:
        return values.get(f"{arch}.{key}", default)

    if get("block_count") is None or get("embedding_length") is None or get("attention.head_count") is None:
        raise MapperError(f"Cannot build config.json: the GGUF file lacks {arch}.block_count, .embedding_length or "
                          ".attention.head_count. Write config.json by hand.")
    heads = int(get("attention.head_count"))
    embed = shapes.get("model.embed_tokens.weight")
    config: dict[str, Any] = {
        "architectures": [CLASSES[family]], "model_type": family,
        "vocab_size": int(embed[0]) if embed else int(get("vocab_size") or 0),
        "hidden_size": int(get("embedding_length")), "intermediate_size": int(get("feed_forward_length") or 0),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "max_position_embeddings": int(get("context_length") or 2048),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)), "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in shapes, "dtype": DTYPE_NAMES.get(dtype, "float32"),
    }
    key_length = get("attention.key_length")
    if key_length is not None:
        config["head_dim"] = int(key_length)
    rope: dict[str, Any] = {"rope_theta": _f32(get("rope.freq_base", 10000.0)), "rope_type": "default"}
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=_f32(get("rope.scaling.factor", 1.0)))
        if get("rope.scaling.original_context_length") is not None:
            rope["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    config["rope_parameters"] = rope
    if family in ("llama", "mistral", "qwen3", "mixtral"):
        config["attention_bias"] = any(n.endswith("self_attn.q_proj.bias") for n in shapes)
    if family == "llama":
        config["mlp_bias"] = any(n.endswith("mlp.up_proj.bias") for n in shapes)
    experts, used = get("expert_count"), get("expert_used_count")
    if family == "mixtral":
        config.update(num_local_experts=int(experts or 0), num_experts_per_tok=int(used or 0))
    elif family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        config.update(num_experts=int(experts or 0), num_experts_per_tok=int(used or 0))
        if get("expert_feed_forward_length") is not None:
            config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
        if family == "olmoe" and get("expert_feed_forward_length") is not None:
            config["intermediate_size"] = int(get("expert_feed_forward_length"))
        if get("expert_shared_feed_forward_length") is not None:
            config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    if family == "deepseek_v3":
        config.update(_deepseek_v3(get, heads))
        config["rope_parameters"].update(_yarn(get) if scaling == "yarn" else {})
    config.update(_token_ids(values))
    return config


def adjust_transformers_config(config: dict[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """transformers' own config of a GGUF file (families without a table here), corrected where it reads the file
    otherwise than the weights say: GPT-2's n_positions (transformers maps the context length to n_ctx only and keeps
    the default 1024) from the position table, and float32 epsilons written as their shortest decimal."""
    wpe = shapes.get("transformer.wpe.weight")
    if config.get("model_type") == "gpt2" and wpe:
        config["n_positions"] = int(wpe[0])
    for key in ("layer_norm_epsilon", "rms_norm_eps"):
        if isinstance(config.get(key), float):
            config[key] = _f32(config[key])
    config.pop("_model_name_or_path", None)
    return config


def _deepseek_v3(get: Any, heads: int) -> dict[str, Any]:
    """DeepSeek-V3's MLA and MoE keys: llama.cpp writes MLA as one KV head of kv_lora_rank + rope width (key_length),
    the per-head widths as key_length_mla / value_length_mla."""
    rope = int(get("rope.dimension_count"))
    found = {"num_key_value_heads": heads, "head_dim": rope, "qk_rope_head_dim": rope,
             "qk_nope_head_dim": int(get("attention.key_length_mla")) - rope, "v_head_dim": int(get("attention.value_length_mla")),
             "kv_lora_rank": int(get("attention.kv_lora_rank")), "q_lora_rank": get("attention.q_lora_rank"),
             "first_k_dense_replace": int(get("leading_dense_block_count") or 0), "n_routed_experts": int(get("expert_count") or 0),
             "num_experts_per_tok": int(get("expert_used_count") or 0), "n_shared_experts": int(get("expert_shared_count") or 0),
             "moe_intermediate_size": int(get("expert_feed_forward_length") or 0), "n_group": int(get("expert_group_count") or 1),
             "topk_group": int(get("expert_group_used_count") or 1), "norm_topk_prob": bool(get("expert_weights_norm", False)),
             "routed_scaling_factor": _f32(get("expert_weights_scale", 1.0)), "scoring_func": "sigmoid", "rope_interleave": True,
             "attention_bias": False}
    found["qk_head_dim"] = found["qk_nope_head_dim"] + rope
    if found["q_lora_rank"] is not None:
        found["q_lora_rank"] = int(found["q_lora_rank"])
    return found


def _yarn(get: Any) -> dict[str, Any]:
    """YaRN's betas and mscale_all_dim (llama.cpp stores 0.1 x mscale_all_dim as the log multiplier of deepseek2)."""
    found = {}
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if get(key) is not None:
            found[name] = _f32(get(key))
    if get("rope.scaling.yarn_log_multiplier") is not None:
        # mscale itself is not in the file: DeepSeek-V3's value (1.0), which transformers assumes without it as well
        found.update(mscale=1.0, mscale_all_dim=_f32(float(get("rope.scaling.yarn_log_multiplier")) / 0.1))
    return found


def _token_ids(values: Mapping[str, Any]) -> dict[str, int]:
    found = {}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = values.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            found[name] = int(value)
    return found


def generation_config(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """generation_config.json: the special token ids the GGUF file records (None when it records none)."""
    ids = _token_ids(values)
    return dict(ids) if ids else None


__all__ = ["CLASSES", "adjust_transformers_config", "generation_config", "hf_config"]
