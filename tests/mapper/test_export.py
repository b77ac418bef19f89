"""Exact export: `to_code()` and `to_json()` rebuild mappers equal by value, templates stay templates."""

from __future__ import annotations

import json

import pytest

from workbench import mapper as M
from workbench.catalog import Catalog, TensorInfo
from workbench.errors import MapperError
from workbench.mapper import presets

CONFIG = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64, "model_type": "llama"}
QWEN = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "model_type": "qwen2", "tie_word_embeddings": True}
SOURCE = Catalog.from_infos([
    TensorInfo("model.layers.0.mlp.up_proj.weight", "F32", (8, 4)),
    TensorInfo("model.layers.1.mlp.up_proj.weight", "F32", (8, 4)),
    TensorInfo("model.layers.0.input_layernorm.weight", "F32", (4,)),
    TensorInfo("model.layers.0.mlp.up_proj.bias", "BF16", (8,)),
    TensorInfo("step", "I64", ()),
])

OPERATIONS = [
    M.Rename("a.{i}.w", "b.{i}.w"),
    M.Identity("x"),
    M.Drop("model.layers.{i}.rotary_emb.inv_freq"),
    M.Concat(["q.{i}", "k.{i}", "v.{i}"], "qkv.{i}", dim=-1),
    M.Stack(["e.0", "e.1"], "experts", dim=1),
    M.Split("qkv", ["q", "k", "v"], sizes=[8, 2, 2]),
    M.Split("gate_up", ["gate", "up"]),
    M.Unstack("experts.{l}", ["e.{l}.0", "e.{l}.1"], dim=0),
    M.Transpose("w", 0, 1, dst="w_t"),
    M.Reshape("w", [2, -1]),
    M.Cast("w", "bf16", dst="w16"),
    M.Function(fn="workbench.mapper.presets.functions:merge_lora", inputs=["{m}.w", "{m}.a", "{m}.b"], outputs=["{m}.merged"],
               infer="workbench.mapper.presets.functions:infer_merge_lora", params={"scale": 0.5, "tags": ["x", 1, None]}),
    M.Sequential(M.Rename("a", "b"), M.Parallel(M.Cast("b", "F16"), M.Drop("c"))),
    M.PrefixScope(M.Sequential(M.Rename("w", "weight")), source_prefix="_orig_mod.", target_prefix="model."),
    M.Sequential(),
]

PRESETS = {
    "hf_to_fused": presets.hf_to_fused(CONFIG),
    "fused_to_hf": presets.fused_to_hf(QWEN),
    "hf_to_meta": presets.hf_to_meta(CONFIG),
    "meta_to_hf": presets.meta_to_hf(QWEN),
    "hf_to_megatron_qkv": presets.hf_to_megatron_qkv(QWEN),
    "megatron_qkv_to_hf": presets.megatron_qkv_to_hf(CONFIG),
    "lora_wrap": presets.lora_wrap(),
    "lora_unwrap": presets.lora_unwrap(["q_proj", "v_proj"]),
    "lora_merge": presets.lora_merge(2.0, ["q_proj"], adapter="default"),
    "strip_prefix": presets.strip_prefix("_orig_mod."),
    "add_prefix": presets.add_prefix("model."),
    "cast_policy": presets.cast_policy(SOURCE, "bf16"),
}


def rebuild_from_code(code: str) -> M.Mapper:
    namespace: dict = {}
    exec(compile(code, "<mapper>", "exec"), namespace)
    return namespace["mapper"]


@pytest.mark.parametrize("mapper", OPERATIONS + list(PRESETS.values()), ids=[type(m).__name__ for m in OPERATIONS] + list(PRESETS))
def test_code_and_json_round_trips_are_exact(mapper):
    code = mapper.to_code()
    assert code.splitlines()[2] == "from workbench import mapper as M" and "\nmapper = M." in code
    assert rebuild_from_code(code) == mapper
    text = mapper.to_json()
    assert json.loads(text)["format"] == "workbench.mapper"
    assert M.from_json(text) == mapper
    assert M.from_json(mapper.to_json(indent=2)) == mapper
    assert eval(repr(mapper), {"M": M}) == mapper


def test_templates_stay_templates_in_exports():
    mapper = presets.hf_to_meta(CONFIG)
    code = mapper.to_code()
    assert "model.layers.{i}.self_attn.q_proj.weight" in code and "layers.{i}.attention.wq.weight" in code
    assert len(code.splitlines()) < 60
    assert "model.layers.0." not in code and "model.layers.0." not in mapper.to_json()


def test_cast_policy_keeps_norms_and_biases_in_fp32_and_skips_integers():
    mapper = presets.cast_policy(SOURCE, "bf16")
    assert mapper == M.Parallel(
        M.Cast("model.layers.{n0}.mlp.up_proj.weight", "BF16"),
        M.Cast("model.layers.{n0}.mlp.up_proj.bias", "F32"),
    )
    outputs = mapper.bind(SOURCE).outputs
    assert {name: info.dtype for name, info in outputs.items()} == {
        "model.layers.0.mlp.up_proj.weight": "BF16", "model.layers.1.mlp.up_proj.weight": "BF16",
        "model.layers.0.input_layernorm.weight": "F32", "model.layers.0.mlp.up_proj.bias": "F32", "step": "I64",
    }


def test_from_json_rejects_malformed_documents():
    with pytest.raises(MapperError, match="does not parse"):
        M.from_json("{not json")
    with pytest.raises(MapperError, match="unknown operation 'Explode'"):
        M.from_json('{"op": "Explode", "name": "x"}')
    with pytest.raises(MapperError, match="bad fields for Rename"):
        M.from_json('{"op": "Rename", "source": "x"}')
    with pytest.raises(MapperError, match="version 9 is not supported"):
        M.from_json('{"format": "workbench.mapper", "version": 9, "mapper": {"op": "Identity", "name": "x"}}')
