"""Tiny random models of today's families, saved with transformers' own `save_pretrained`.

Tests and notebook 05 build them at run time into a temporary folder (nothing is downloaded, nothing
committed): each is 2 layers, hidden 16-32, 4 experts, float32, seeded.

Usage: python scripts/make_families.py OUT [FAMILY ...]   (default: every family)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SEED = 20261123
COMMON: dict[str, Any] = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=64, tie_word_embeddings=False)

# family -> (model_type, the causal LM class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "LlamaForCausalLM", dict(intermediate_size=32)),
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                                                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                                                         num_experts_per_tok=2, head_dim=8, decoder_sparse_step=1)),
    "olmoe": ("olmoe", "OlmoeForCausalLM", dict(intermediate_size=8, num_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM", dict(
        hidden_size=32, intermediate_size=32, moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, num_key_value_heads=4)),
}


def build(family: str) -> Any:
    """The tiny model of `family`, randomly initialised from a fixed seed (float32)."""
    import torch
    import transformers

    model_type, class_name, overrides = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    torch.manual_seed(SEED)
    model = getattr(transformers, class_name)(config).to(torch.float32)
    with torch.no_grad():  # some families initialise biases/norms to constants: make every tensor distinct
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.1)
    return model.eval()


def save(family: str, out: str | Path) -> Path:
    """Save the tiny `family` model into `out` (created) with `save_pretrained`; return the folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    build(family).save_pretrained(out)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out, families = Path(argv[0]), argv[1:] or list(FAMILIES)
    for family in families:
        print(save(family, out / family))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
