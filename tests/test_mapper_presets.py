"""Presets against real (tiny) transformers models: round trips are bit-identical, the Meta layout matches
transformers' own rotary permutation, and a model reloaded after a round trip gives the same logits."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError
from workbench.mapper import presets
from workbench.mapper.model_shape import AttentionShape, attention_shape

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(**SMALL)
    return config, LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def qwen2():
    torch.manual_seed(1)
    config = Qwen2Config(**SMALL)
    return config, Qwen2ForCausalLM(config).eval()


def assert_identical(got: dict, want: dict) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def logits(model, state_dict) -> torch.Tensor:
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(state_dict, strict=True)
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        return fresh(input_ids=ids).logits


ROUND_TRIPS = {
    "fused": (presets.hf_to_fused, presets.fused_to_hf),
    "meta": (presets.hf_to_meta, presets.meta_to_hf),
    "megatron": (presets.hf_to_megatron_qkv, presets.megatron_qkv_to_hf),
}


@pytest.mark.parametrize("layout", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_round_trip_is_bit_identical_and_logits_match(layout, family, request):
    config, model = request.getfixturevalue(family)
    forward, backward = (make(config) for make in ROUND_TRIPS[layout])
    state = model.state_dict()
    converted = forward.apply(state)
    assert converted.keys() != state.keys()
    assert_identical(backward.apply(converted), state)
    assert_identical(forward.inverse(state).apply(converted), state)
    with torch.no_grad():
        expected = model(input_ids=torch.arange(12).reshape(2, 6) % config.vocab_size).logits
    assert torch.equal(logits(model, backward.apply(converted)), expected)


def test_fused_layout_packs_q_k_v_and_gate_up_along_dim0(qwen2):
    config, model = qwen2
    state = model.state_dict()
    fused = presets.hf_to_fused(config).apply(state)
    prefix = "model.layers.1."
    qkv = torch.cat([state[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(fused[prefix + "self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(fused[prefix + "self_attn.qkv_proj.bias"], torch.cat([state[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"]))
    gate_up = torch.cat([state[prefix + "mlp.gate_proj.weight"], state[prefix + "mlp.up_proj.weight"]])
    assert torch.equal(fused[prefix + "mlp.gate_up_proj.weight"], gate_up)
    binding = presets.hf_to_fused(config).bind(state)
    assert all(g.recipe is not None for g in binding.groups)  # pure byte moves


def test_meta_layout_matches_transformers_rotary_permutation(llama):
    config, model = llama
    state = model.state_dict()
    meta = presets.hf_to_meta(config).apply(state)
    assert {"tok_embeddings.weight", "norm.weight", "output.weight", "layers.0.attention.wq.weight",
            "layers.1.feed_forward.w2.weight", "layers.1.ffn_norm.weight"} <= set(meta)
    core = pytest.importorskip("transformers.core_model_loading")
    # transformers turns Meta's interleaved rotary rows into HF's half-split rows with this permutation
    # (q with the query head count, k with the key/value head count, as in its Llama converter).
    to_hf = core.PermuteForRope()
    for layer in range(config.num_hidden_layers):
        for meta_name, hf_name, heads in (("wq", "q_proj", config.num_attention_heads), ("wk", "k_proj", config.num_key_value_heads)):
            ours = meta[f"layers.{layer}.attention.{meta_name}.weight"]
            theirs = to_hf._permute_for_rope(ours, SimpleNamespace(num_attention_heads=heads))
            assert torch.equal(theirs, state[f"model.layers.{layer}.self_attn.{hf_name}.weight"])
            assert not torch.equal(ours, state[f"model.layers.{layer}.self_attn.{hf_name}.weight"])
    # The reverse direction agrees with transformers' inverse permutation too.
    back = core.PermuteForRope(inverse=True)._permute_for_rope(state["model.layers.0.self_attn.q_proj.weight"], config)
    assert torch.equal(back, meta["layers.0.attention.wq.weight"])


def test_megatron_qkv_interleaves_each_kv_group(llama):
    config, model = llama
    state = model.state_dict()
    fused = presets.hf_to_megatron_qkv(config).apply(state)["model.layers.0.self_attention.linear_qkv.weight"]
    head = config.head_dim
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    per_group = config.num_attention_heads // config.num_key_value_heads
    expected = []
    for group in range(config.num_key_value_heads):
        expected += [q[group * per_group * head:(group + 1) * per_group * head], k[group * head:(group + 1) * head], v[group * head:(group + 1) * head]]
    assert torch.equal(fused, torch.cat(expected))
    binding = presets.hf_to_megatron_qkv(config).bind(state)
    qkv_group = next(g for g in binding.groups if g.outputs[0].name.endswith("linear_qkv.weight"))
    assert qkv_group.recipe is not None and len(qkv_group.recipe[qkv_group.outputs[0].name]) == 3 * config.num_key_value_heads


def test_lora_wrap_then_merge_matches_the_formula(llama):
    config, model = llama
    state = model.state_dict()
    torch.manual_seed(3)
    rank, scale = 4, 0.25
    adapters = {}
    for layer in range(config.num_hidden_layers):
        for block, target in (("self_attn", "q_proj"), ("self_attn", "v_proj")):
            weight = state[f"model.layers.{layer}.{block}.{target}.weight"]
            adapters[f"model.layers.{layer}.{block}.{target}.lora_A.weight"] = torch.randn(rank, weight.shape[1])
            adapters[f"model.layers.{layer}.{block}.{target}.lora_B.weight"] = torch.randn(weight.shape[0], rank)
    targets = ["q_proj", "v_proj"]
    wrapped = presets.lora_wrap(targets).apply(state)
    assert "model.layers.1.self_attn.q_proj.base_layer.weight" in wrapped and "model.layers.1.self_attn.k_proj.weight" in wrapped
    assert_identical(presets.lora_unwrap(targets).apply(wrapped), state)
    merged = presets.lora_merge(scale, targets).apply({**wrapped, **adapters})
    assert set(merged) == set(state)
    name = "model.layers.1.self_attn.v_proj"
    expected = state[name + ".weight"] + scale * adapters[name + ".lora_B.weight"] @ adapters[name + ".lora_A.weight"]
    assert torch.allclose(merged[name + ".weight"], expected, atol=1e-6)
    assert torch.equal(merged["model.layers.1.self_attn.k_proj.weight"], state["model.layers.1.self_attn.k_proj.weight"])
    bad = dict(adapters, **{name + ".lora_A.weight": torch.randn(rank, 7)})
    problems = presets.lora_merge(scale, targets).bind({**wrapped, **bad}).problems
    assert len(problems) == 1 and "Cannot merge LoRA into 'model.layers.1.self_attn.v_proj.base_layer.weight'" in problems[0].message
    with pytest.raises(MapperError, match="Function.* is not invertible"):
        presets.lora_merge(scale, targets).inverse({**wrapped, **adapters})


def test_prefix_presets_round_trip(llama):
    _, model = llama
    state = {f"_orig_mod.{name}": tensor for name, tensor in model.state_dict().items()}
    stripped = presets.strip_prefix("_orig_mod.").apply(state)
    assert_identical(stripped, model.state_dict())
    assert_identical(presets.add_prefix("_orig_mod.").apply(stripped), state)
    assert_identical(presets.strip_prefix("_orig_mod.").inverse(state).apply(stripped), state)


def test_config_sources_agree(llama, tmp_path):
    config, _ = llama
    config.save_pretrained(tmp_path)
    expected = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=False, tie_word_embeddings=False)
    assert attention_shape(config) == expected
    assert attention_shape(tmp_path / "config.json") == expected
    assert attention_shape(tmp_path) == expected
    assert attention_shape(config.to_dict()) == expected
    assert attention_shape(Qwen2Config(**SMALL)).qkv_bias
    with pytest.raises(MapperError, match="'num_attention_heads' is missing"):
        attention_shape({"hidden_size": 64})
    with pytest.raises(MapperError, match="does not exist"):
        attention_shape(tmp_path / "nope.json")
    assert presets.fused_to_hf({"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}) == presets.fused_to_hf(config)


def test_presets_are_ordinary_mappers_that_compose():
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    combined = M.Sequential(presets.strip_prefix("_orig_mod."), presets.hf_to_fused(config))
    assert M.from_json(combined.to_json()) == combined


def test_one_preset_registry_serves_the_builder_and_the_cli() -> None:
    from workbench.mapper.presets import PRESETS
    from workbench.mapper.suggest import build_preset, find_config
    from workbench.widgets.builder import MapperBuilder

    llama = Path(__file__).resolve().parent.parent / "sample_checkpoints" / "tiny-llama"
    catalog = wb.open_checkpoint(llama).catalog
    assert MapperBuilder.presets() == PRESETS
    for name in PRESETS:
        assert callable(getattr(M.presets, name)), name
        if name.startswith("dequantize") or name in ("lora_merge", "average"):  # need quantised weights / several sources
            with pytest.raises(MapperError, match=r"^Cannot "):  # a clear refusal, not a crash
                build_preset(name, catalog, find_config(llama))
            continue
        assert build_preset(name, catalog, find_config(llama)) is not None, name
