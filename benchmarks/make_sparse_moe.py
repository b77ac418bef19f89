"""Frontier MoE checkpoints at full size that cost no disk: real safetensors headers, data as holes.

Four shapes, each with the config.json its hub folder carries (the fields binding reads) and the tensor names,
shapes and dtypes of its safetensors files, one tensor per expert where the hub has it so:

- `deepseek_v3`  DeepSeek-V3 (671B, 61 layers, 256 routed experts + 1 shared, FP8 e4m3 with 128 x 128
                 `weight_scale_inv`): 90,427 tensors in 163 shards,
- `kimi_k2`      Kimi-K2 (the same architecture, 1T: 384 experts, 64 heads, first layer dense): 139,583
                 tensors in 62 shards,
- `qwen3_moe`    Qwen3-MoE-235B-A22B (94 layers, 128 experts, bf16): 36,945 tensors in 118 shards,
- `gpt_oss`      GPT-OSS-120B (36 layers, 128 experts stored stacked as MXFP4 `_blocks`/`_scales`):
                 687 tensors in 15 shards.

`moe_specs(family, config)` lists the tensors for any config of the family, so a scaled-down config (experts of a
few MiB) gives the same names with small shapes; `make_moe(folder, family, config=None, fill=None)` writes either
sparse (no `fill`: headers only) or with real values (`fill(info) -> numpy array`).

Usage:
    python benchmarks/make_sparse_moe.py {deepseek_v3,kimi_k2,qwen3_moe,gpt_oss} DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent))

from make_sparse import STAMP, Spec, _build  # noqa: E402

FP8_BLOCK = 128
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}

_DEEPSEEK = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu", "quantization_config": FP8_CONFIG,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v3": _DEEPSEEK,
    "kimi_k2": {**_DEEPSEEK, "vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
                "n_routed_experts": 384, "routed_scaling_factor": 2.827, "first_k_dense_replace": 1, "n_group": 1,
                "topk_group": 1, "rope_theta": 50000.0, "max_position_embeddings": 131072},
    "qwen3_moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "hidden_act": "silu",
    },
    "gpt_oss": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
        "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128, "swiglu_limit": 7.0,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
        "rope_theta": 150000, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    },
}
SHARDS = {"deepseek_v3": 163, "kimi_k2": 62, "qwen3_moe": 118, "gpt_oss": 15}
FAMILIES = tuple(CONFIGS)


def _fp8(name: str, rows: int, cols: int) -> list[Spec]:
    """An FP8 weight and its 128 x 128 block scales, as the hub's DeepSeek checkpoints store them."""
    return [(name, (rows, cols), "F8_E4M3"),
            (name + "_scale_inv", (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), "F32")]


def _deepseek(c: dict[str, Any]) -> list[Spec]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    q_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    specs: list[Spec] = [("model.embed_tokens.weight", (c["vocab_size"], h), "BF16")]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), "BF16"), (p + "post_attention_layernorm.weight", (h,), "BF16")]
        a = p + "self_attn."
        specs += _fp8(a + "q_a_proj.weight", c["q_lora_rank"], h)
        specs += [(a + "q_a_layernorm.weight", (c["q_lora_rank"],), "BF16")]
        specs += _fp8(a + "q_b_proj.weight", heads * q_head, c["q_lora_rank"])
        specs += _fp8(a + "kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
        specs += [(a + "kv_a_layernorm.weight", (c["kv_lora_rank"],), "BF16")]
        specs += _fp8(a + "kv_b_proj.weight", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        specs += _fp8(a + "o_proj.weight", h, heads * c["v_head_dim"])
        if i < c["first_k_dense_replace"]:
            inter, mlps = c["intermediate_size"], [p + "mlp."]
        else:
            inter, mlps = c["moe_intermediate_size"], [p + f"mlp.experts.{e}." for e in range(c["n_routed_experts"])]
            mlps.append(p + "mlp.shared_experts.")
            specs += [(p + "mlp.gate.weight", (c["n_routed_experts"], h), "BF16"),
                      (p + "mlp.gate.e_score_correction_bias", (c["n_routed_experts"],), "F32")]
        for m in mlps:
            shared = inter * c.get("n_shared_experts", 1) if m.endswith("shared_experts.") else inter
            specs += _fp8(m + "gate_proj.weight", shared, h) + _fp8(m + "up_proj.weight", shared, h)
            specs += _fp8(m + "down_proj.weight", h, shared)
    return specs + [("model.norm.weight", (h,), "BF16"), ("lm_head.weight", (c["vocab_size"], h), "BF16")]


def _qwen3_moe(c: dict[str, Any]) -> list[Spec]:
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["moe_intermediate_size"]
    specs: list[Spec] = [("model.embed_tokens.weight", (c["vocab_size"], h), "BF16")]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), "BF16"), (p + "post_attention_layernorm.weight", (h,), "BF16"),
                  (p + "self_attn.q_proj.weight", (q, h), "BF16"), (p + "self_attn.k_proj.weight", (kv, h), "BF16"),
                  (p + "self_attn.v_proj.weight", (kv, h), "BF16"), (p + "self_attn.o_proj.weight", (h, q), "BF16"),
                  (p + "self_attn.q_norm.weight", (d,), "BF16"), (p + "self_attn.k_norm.weight", (d,), "BF16"),
                  (p + "mlp.gate.weight", (c["num_experts"], h), "BF16")]
        for e in range(c["num_experts"]):
            m = p + f"mlp.experts.{e}."
            specs += [(m + "gate_proj.weight", (inter, h), "BF16"), (m + "up_proj.weight", (inter, h), "BF16"),
                      (m + "down_proj.weight", (h, inter), "BF16")]
    return specs + [("model.norm.weight", (h,), "BF16"), ("lm_head.weight", (c["vocab_size"], h), "BF16")]


def _gpt_oss(c: dict[str, Any]) -> list[Spec]:
    h, d, e, inter = c["hidden_size"], c["head_dim"], c["num_local_experts"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    specs: list[Spec] = [("model.embed_tokens.weight", (c["vocab_size"], h), "BF16")]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a, x = p + "self_attn.", p + "mlp.experts."
        specs += [(p + "input_layernorm.weight", (h,), "BF16"), (p + "post_attention_layernorm.weight", (h,), "BF16")]
        for proj, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            specs += [(a + proj + ".weight", (rows, cols), "BF16"), (a + proj + ".bias", (rows,), "BF16")]
        specs += [(a + "sinks", (c["num_attention_heads"],), "BF16"),
                  (p + "mlp.router.weight", (e, h), "BF16"), (p + "mlp.router.bias", (e,), "BF16")]
        for proj, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            specs += [(x + proj + "_blocks", (e, rows, cols // 32, 16), "U8"), (x + proj + "_scales", (e, rows, cols // 32), "U8"),
                      (x + proj + "_bias", (e, rows), "BF16")]
    return specs + [("model.norm.weight", (h,), "BF16"), ("lm_head.weight", (c["vocab_size"], h), "BF16")]


_SPECS: dict[str, Callable[[dict[str, Any]], list[Spec]]] = {
    "deepseek_v3": _deepseek, "kimi_k2": _deepseek, "qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss}


def moe_specs(family: str, config: dict[str, Any] | None = None) -> list[Spec]:
    """(name, shape, dtype) of every tensor of a `family` checkpoint with `config` (default: the full-size one)."""
    return _SPECS[family](config or CONFIGS[family])


def make_moe(folder: Path, family: str, config: dict[str, Any] | None = None, n_shards: int | None = None,
             fill: Callable[[Any], Any] | None = None) -> dict:
    """Write (or reuse) a `family` checkpoint with its config.json; sparse unless `fill(TensorInfo) -> numpy array`
    gives real values. Returns the stamp (`bytes`, `tensors`)."""
    config = config or CONFIGS[family]
    specs = moe_specs(family, config)
    shards = n_shards or SHARDS[family]
    if fill is None:
        stamp = _build(folder, {"kind": "sparse-moe", "family": family, "config": config, "shards": shards}, specs, shards)
    else:
        from make_llama_like import write_sharded

        folder.mkdir(parents=True, exist_ok=True)
        write_sharded(folder, specs, shards, fill)
        stamp = {"kind": "moe", "family": family, "tensors": len(specs)}
        (folder / STAMP).write_text(json.dumps(stamp))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return stamp


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: write one sparse full-size MoE folder and print its stamp."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(make_moe(args.folder, args.family)))


if __name__ == "__main__":
    main()
