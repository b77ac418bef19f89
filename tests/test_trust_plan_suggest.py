"""`ck.suggest()` offers only presets whose plan binds (issue 29, D5c).

MiniMax's lightning-attention layers hold a fused, per-head interleaved `self_attn.qkv_proj` (with `out_proj`,
`output_gate`) and no `gate_up_proj`: `fused_to_hf` was offered for it, and its plan then failed. Layout presets
are now bound to the checkpoint's tensors (metadata only) before they are offered.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import workbench as wb
from workbench.mapper.suggest import build_preset


def _minimax(folder: Path, kv_heads: int) -> Path:
    """A MiniMax-Text-01-shaped checkpoint (hub names): layer 0 lightning attention, layer 1 softmax attention,
    block-sparse MoE experts."""
    folder.mkdir(parents=True)
    config = {"model_type": "minimax", "architectures": ["MiniMaxText01ForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": kv_heads, "head_dim": 16, "num_hidden_layers": 2,
              "intermediate_size": 64, "num_local_experts": 2, "num_experts_per_tok": 1, "vocab_size": 100,
              "attn_type_list": [0, 1], "layer_types": ["linear_attention", "full_attention"]}
    shapes = {"model.embed_tokens.weight": (100, 64), "model.norm.weight": (64,), "lm_head.weight": (100, 64),
              "model.layers.0.self_attn.qkv_proj.weight": (3 * 4 * 16, 64), "model.layers.0.self_attn.out_proj.weight": (64, 64),
              "model.layers.0.self_attn.output_gate.weight": (64, 64), "model.layers.0.self_attn.norm.weight": (64,)}
    for proj, rows in (("q", 64), ("k", 16 * kv_heads), ("v", 16 * kv_heads), ("o", 64)):
        shapes[f"model.layers.1.self_attn.{proj}_proj.weight"] = (rows, 64)
    for i in range(2):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (64,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (64,)
        shapes[f"model.layers.{i}.block_sparse_moe.gate.weight"] = (2, 64)
        for e in range(2):
            for w in ("w1", "w2", "w3"):
                shapes[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] = (64, 64)
    save_file({n: np.zeros(s, np.float32) for n, s in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _offered_presets_all_plan(ck, folder: Path) -> list[str]:
    offered = list(ck.suggest()["preset"])
    for name in offered:
        plan = wb.plan(ck, build_preset(name, ck, folder / "config.json"))
        assert plan.ok, (name, [p.message for p in plan.errors][:2])
    return offered


@pytest.mark.parametrize("kv_heads", [2, 4])  # 4: q + 2 kv rows happen to equal the lightning qkv_proj's rows
def test_minimax_is_not_offered_fused_to_hf(tmp_path: Path, kv_heads: int) -> None:
    folder = _minimax(tmp_path / "minimax", kv_heads)
    ck = wb.open_checkpoint(folder)
    offered = _offered_presets_all_plan(ck, folder)
    assert "fused_to_hf" not in offered
    assert "from_transformers" in offered  # transformers' own MiniMax rules (experts stacked) do bind


def test_a_fused_checkpoint_is_still_offered_fused_to_hf(llama_sample: Path, tmp_path: Path) -> None:
    from workbench.mapper import presets

    fused = tmp_path / "fused"
    wb.convert(llama_sample, fused, presets.hf_to_fused(llama_sample / "config.json"), quiet=True)
    ck = wb.open_checkpoint(fused)
    assert "fused_to_hf" in _offered_presets_all_plan(ck, fused)


def test_without_a_config_the_rule_holds_and_a_layout_preset_says_what_it_needs(tmp_path: Path) -> None:
    folder = _minimax(tmp_path / "minimax", 2)
    (folder / "config.json").unlink()
    frame = wb.open_checkpoint(folder).suggest()
    assert "fused_to_hf" not in list(frame["preset"])  # qkv_proj without gate_up_proj is not the layout hf_to_fused writes
    meta = tmp_path / "meta"
    meta.mkdir()
    save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)}, str(meta / "model.safetensors"))
    why = wb.open_checkpoint(meta).suggest().set_index("preset").loc["meta_to_hf", "why"]
    assert "needs the model's config.json" in why  # it cannot be built (let alone bound) without one
