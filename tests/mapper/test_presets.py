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
from workbench.mapper.presets.model_shape import AttentionShape, attention_shape

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
    from workbench.mapper.presets.suggest import build_preset, find_config
    from workbench.widgets.builder import MapperBuilder

    llama = Path(__file__).resolve().parents[2] / "sample_checkpoints" / "tiny-llama"
    catalog = wb.open_checkpoint(llama).catalog
    assert MapperBuilder.presets() == PRESETS
    for name in PRESETS:
        assert callable(getattr(M.presets, name)), name
        # need quantised weights / several sources / Megatron rank shards / Meta model-parallel files / a GGUF file
        if name.startswith(("dequantize", "decompress")) or name in (
            "lora_merge", "average", "megatron_merge", "meta_mp_merge", "gguf_to_hf"
        ):
            with pytest.raises(MapperError, match=r"^Cannot "):  # a clear refusal, not a crash
                build_preset(name, catalog, find_config(llama))
            continue
        assert build_preset(name, catalog, find_config(llama)) is not None, name


# -- biases and q/k norms (Qwen2, Qwen3), and what every preset reports when it meets a tensor it does not know --
def _saved(model, folder) -> str:
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    config = Qwen3Config(**SMALL, head_dim=16, attention_bias=True, mlp_bias=False)
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norms and biases start at 1 and 0: give them values a wrong permutation would show
        for name, tensor in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                tensor.copy_(torch.randn_like(tensor))
    return config, model


def _rope_theta(config) -> float:
    return float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"])


def _meta_attention(meta: dict, layer: int, x: torch.Tensor, config) -> torch.Tensor:
    """Attention as Meta's reference Llama computes it: interleaved rotary pairs as complex numbers."""
    prefix = f"layers.{layer}.attention."
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, 16
    batch, seq, _ = x.shape

    def linear(name: str) -> torch.Tensor:
        out = x @ meta[prefix + name + ".weight"].T
        return out + meta[prefix + name + ".bias"] if prefix + name + ".bias" in meta else out

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    q = linear("wq").view(batch, seq, heads, head_dim)
    k = linear("wk").view(batch, seq, kv_heads, head_dim)
    v = linear("wv").view(batch, seq, kv_heads, head_dim)
    if prefix + "q_norm.weight" in meta:
        q, k = rms(q, meta[prefix + "q_norm.weight"]), rms(k, meta[prefix + "k_norm.weight"])
    freqs = 1.0 / (_rope_theta(config) ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cis = torch.polar(torch.ones(seq, head_dim // 2), torch.outer(torch.arange(seq).float(), freqs))[None, :, None, :]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2)) * cis).flatten(3)

    q, k = rotate(q), rotate(k)
    repeat = heads // kv_heads
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / head_dim**0.5
    scores = scores + torch.full((seq, seq), float("-inf")).triu(1)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
    return out @ meta[prefix + "wo.weight"].T + meta.get(prefix + "wo.bias", 0)


def _hf_attention(model, layer: int, x: torch.Tensor) -> torch.Tensor:
    seq = x.shape[1]
    position_ids = torch.arange(seq)[None].expand(x.shape[0], -1)
    cos_sin = model.model.rotary_emb(x, position_ids)
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None].expand(x.shape[0], 1, seq, seq)
    return model.model.layers[layer].self_attn(x, position_embeddings=cos_sin, attention_mask=mask)[0]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_meta_preset_converts_biases_and_qk_norms_so_attention_is_unchanged(family, request, tmp_path):
    import workbench as wb

    config, model = request.getfixturevalue(family)
    config._attn_implementation = "eager"
    folder = _saved(model, tmp_path / family)
    mapper = presets.hf_to_meta(folder)
    the_plan = wb.plan(folder, mapper)
    assert the_plan.ok, the_plan.errors
    names = list(the_plan.outputs.index)
    assert not [n for n in names if n.startswith(("model.", "lm_head."))]  # nothing left under an HF name
    expected = {"layers.0.attention.wq.bias", "layers.1.attention.wk.bias", "layers.0.attention.wv.bias"}
    if family == "qwen3":
        expected |= {"layers.0.attention.q_norm.weight", "layers.1.attention.k_norm.weight", "layers.0.attention.wo.bias"}
    assert expected <= set(names)
    state = model.state_dict()
    meta = mapper.apply(state)
    torch.manual_seed(5)
    x = torch.randn(2, 7, config.hidden_size)
    with torch.no_grad():
        for layer in range(config.num_hidden_layers):
            torch.testing.assert_close(_meta_attention(meta, layer, x, config), _hf_attention(model, layer, x), atol=2e-5, rtol=1e-4)
    assert_identical(presets.meta_to_hf(folder).apply(meta), state)
    assert wb.plan(folder, M.Sequential(mapper, presets.meta_to_hf(folder))).ok


def test_meta_preset_reports_tensors_its_config_does_not_announce(qwen3, tmp_path):
    import workbench as wb

    config, model = qwen3
    folder = _saved(model, tmp_path / "qwen3")
    as_llama = dict(config.to_dict(), model_type="llama", attention_bias=False)  # a config that hides norms and biases
    the_plan = wb.plan(folder, presets.hf_to_meta(as_llama))
    assert not the_plan.ok
    message = " ".join(p.message for p in the_plan.errors)
    assert "HF Llama (presets.hf_to_meta)" in message and "left unconverted" in message
    assert "'model.layers.0.self_attn.q_norm.weight'" in message or "'model.layers.0.self_attn.q_proj.bias'" in message
    (problem,) = [p for p in the_plan.errors if "left unconverted" in p.message]
    assert "12 source tensor(s)" in problem.message  # 2 layers x (q/k/v/o biases + q/k norms)
    # The reverse direction reports a Meta tensor it does not know, too.
    meta = presets.hf_to_meta(folder).apply(model.state_dict())
    meta["layers.0.attention.rope_scale"] = torch.ones(3)
    problems = presets.meta_to_hf(folder).bind(meta).problems
    assert [p.tensor for p in problems] == ["layers.0.attention.rope_scale"]


def test_every_family_preset_reports_what_it_leaves_unconverted(llama):
    config, model = llama
    state = model.state_dict()
    layer = "model.layers.0."

    def left(mapper, source) -> list[str | None]:
        return [p.tensor for p in mapper.bind(source).problems if "left unconverted" in p.message]

    with_mlp_bias = dict(state, **{layer + "mlp.gate_proj.bias": torch.zeros(96), layer + "mlp.up_proj.bias": torch.zeros(96)})
    assert left(presets.hf_to_fused(config), with_mlp_bias) == [layer + "mlp.gate_proj.bias"]
    fused_config = dict(config.to_dict(), mlp_bias=True)
    all_biases = {**with_mlp_bias, **{n.replace(".0.", ".1."): t for n, t in with_mlp_bias.items() if n.endswith("bias")}}
    fused = presets.hf_to_fused(fused_config).apply(all_biases)
    assert fused[layer + "mlp.gate_up_proj.bias"].shape == (192,)
    assert_identical(presets.fused_to_hf(fused_config).apply(fused), all_biases)
    assert left(presets.fused_to_hf(config), fused) == [layer + "mlp.gate_up_proj.bias"]
    with_q_bias = dict(state, **{layer + "self_attn.q_proj.bias": torch.zeros(64)})
    assert left(presets.hf_to_megatron_qkv(config), with_q_bias) == [layer + "self_attn.q_proj.bias"]
    megatron = presets.hf_to_megatron_qkv(config).apply(state)
    megatron["model.layers.1.self_attention.linear_qkv.layer_norm_weight"] = torch.ones(64)  # Transformer Engine's fused norm
    assert left(presets.megatron_qkv_to_hf(config), megatron) == ["model.layers.1.self_attention.linear_qkv.layer_norm_weight"]
    assert left(presets.hf_to_meta(config), dict(state, **{layer + "self_attn.rotary_emb.inv_freq": torch.ones(8)})) == [
        layer + "self_attn.rotary_emb.inv_freq"]
    # LoRA: a target's bias must follow its weight into (or out of) base_layer, adapters must not stay behind.
    biased = dict(state, **{layer + "self_attn.q_proj.bias": torch.zeros(64)})
    assert left(presets.lora_wrap(["q_proj"]), biased) == [layer + "self_attn.q_proj.bias"]
    wrapped = presets.lora_wrap(["q_proj"], params=("weight", "bias")).apply(biased)
    assert left(presets.lora_unwrap(["q_proj"]), wrapped) == [layer + "self_attn.q_proj.base_layer.bias"]
    assert_identical(presets.lora_unwrap(["q_proj"], params=("weight", "bias")).apply(wrapped), biased)
    adapters = {}
    for index in range(2):
        module = f"model.layers.{index}.self_attn.q_proj."
        adapters |= {module + "lora_A.weight": torch.zeros(2, 64), module + "lora_B.weight": torch.zeros(64, 2)}
    with_adapters = {**wrapped, **adapters}
    assert left(presets.lora_unwrap(["q_proj"], params=("weight", "bias")), with_adapters) == [
        "model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert left(presets.lora_merge(1.0, ["q_proj"]), with_adapters) == [layer + "self_attn.q_proj.base_layer.bias"]
    dora = dict(presets.lora_wrap(["q_proj"]).apply(state), **adapters, **{layer + "self_attn.q_proj.lora_magnitude_vector": torch.ones(64)})
    assert left(presets.lora_merge(1.0, ["q_proj"]), dora) == [layer + "self_attn.q_proj.lora_magnitude_vector"]
    assert presets.lora_merge(1.0, ["q_proj"]).bind(presets.lora_wrap(["q_proj"]).apply(state) | adapters).ok


def test_claims_survive_export_and_apply_checks_them(llama):
    config, model = llama
    mapper = presets.hf_to_meta(config)
    assert M.from_json(mapper.to_json()) == mapper
    namespace: dict = {}
    exec(mapper.to_code(), namespace)  # noqa: S102 - our own generated code
    assert namespace["mapper"] == mapper
    extra = dict(model.state_dict(), **{"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    with pytest.raises(MapperError, match="left unconverted.*q_norm"):
        mapper.apply(extra)
    concrete = M.Sequential(M.Rename("a", "b"), M.Claim("test layout", r"a|c"))
    with pytest.raises(MapperError, match="'c'"):
        concrete.apply({"a": torch.ones(1), "c": torch.ones(1)})
    assert set(concrete.apply({"a": torch.ones(1)})) == {"b"}
    with pytest.raises(MapperError, match="not a regular expression"):
        M.Claim("x", "(")


def test_the_presets_package_names_every_preset_and_imports_a_family_on_first_use() -> None:
    """`M.presets.*` keeps every public name while each family lives in its own module: the package alone imports
    none of them, every name resolves, the registry names only presets, and importing the `averaging` module
    (a Function's path) leaves `presets.average` the preset."""
    import subprocess
    import sys

    code = ("import sys, workbench.mapper.presets as P\n"
            "print(sorted(m for m in sys.modules if m.startswith('workbench.mapper.presets.')))\n"
            "import workbench.mapper.presets.averaging\n"
            "print(callable(P.average) and P.average.__module__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:2] == ["[]", "workbench.mapper.presets.layouts"]
    assert set(presets.PRESETS) <= set(presets.__all__)
    for name in presets.__all__:
        assert getattr(presets, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'hf_to_nothing'"):
        presets.hf_to_nothing  # noqa: B018
