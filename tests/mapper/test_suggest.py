"""`ck.suggest()` offers only presets whose plan binds (issue 29, D5c).

MiniMax's lightning-attention layers hold a fused, per-head interleaved `self_attn.qkv_proj` (with `out_proj`,
`output_gate`) and no `gate_up_proj`: `fused_to_hf` was offered for it, and its plan then failed. Layout presets
are now bound to the checkpoint's tensors (metadata only) before they are offered.

Binding six presets against the whole table made `workbench inspect` 3x slower and 5x hungrier on 10^5
tensors: they are bound to a representative sample (`suggest.representative`) that answers as the whole
table does (the parity cases below), whose size does not grow with the number of layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import workbench as wb
from workbench.catalog import TensorInfo
from workbench.mapper.base import Mapper
from workbench.mapper.presets import suggest as S
from workbench.mapper.presets.suggest import build_preset, suggest_rows

H, KV_ROWS, INTER = 64, 32, 128
LLAMA = {"model_type": "llama", "hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": INTER, "vocab_size": 100, "rms_norm_eps": 1e-5}


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


# -- cost: the presets are bound to a sample whose size does not grow with the layers ------------------------
def _llama_infos(layers: int, *, fused: bool = False, experts_from: int | None = None) -> dict[str, TensorInfo]:
    """A Llama-like catalog (metadata only); `fused`: the layout hf_to_fused writes; `experts_from`: layers from
    that index hold 4 numbered experts instead of a dense MLP (a dense/MoE mixture)."""
    infos: dict[str, TensorInfo] = {}

    def add(name: str, shape: tuple[int, ...]) -> None:
        infos[name] = TensorInfo(name, "BF16", shape, "model.safetensors")

    add("model.embed_tokens.weight", (100, H))
    for i in range(layers):
        p = f"model.layers.{i}."
        if fused:
            add(p + "self_attn.qkv_proj.weight", (H + 2 * KV_ROWS, H))
        else:
            for proj, rows in (("q", H), ("k", KV_ROWS), ("v", KV_ROWS)):
                add(p + f"self_attn.{proj}_proj.weight", (rows, H))
        add(p + "self_attn.o_proj.weight", (H, H))
        for mlp in [f"mlp.experts.{e}." for e in range(4)] if experts_from is not None and i >= experts_from else ["mlp."]:
            if fused:
                add(p + mlp + "gate_up_proj.weight", (2 * INTER, H))
            else:
                add(p + mlp + "gate_proj.weight", (INTER, H))
                add(p + mlp + "up_proj.weight", (INTER, H))
            add(p + mlp + "down_proj.weight", (H, INTER))
        add(p + "input_layernorm.weight", (H,))
        add(p + "post_attention_layernorm.weight", (H,))
    add("model.norm.weight", (H,))
    add("lm_head.weight", (100, H))
    return infos


def _bound_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on every `Mapper.bind`: the number of tensors of the source it binds to."""
    sizes: list[int] = []
    original = Mapper.bind

    def spy(self: Mapper, source, rest="keep"):  # noqa: ANN001, ANN202 - same signature as Mapper.bind
        sizes.append(len(source))
        return original(self, source, rest=rest)

    monkeypatch.setattr(Mapper, "bind", spy)
    return sizes


def test_a_huge_catalog_is_not_bound_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """11,000 identical layers (99,004 tensors): each preset is bound to 3 + 9 tensors, not to the table."""
    infos = _llama_infos(11_000)
    assert len(infos) > 99_000
    sizes = _bound_sizes(monkeypatch)
    _, rows = suggest_rows(infos, LLAMA, registry=False)
    assert [name for name, _ in rows] == ["hf_to_fused", "hf_to_meta"]  # still checked, still offered
    assert sizes and max(sizes) <= 12, sizes  # before: 99,004 per preset (4.5 s and +260 MB on this table)


def test_the_sample_keeps_one_layer_of_each_kind() -> None:
    """First layer, plus the first layer of each distinct signature: dense and MoE both, nothing else."""
    infos = _llama_infos(40, experts_from=3)
    infos["model.layers.17.self_attn.q_proj.bias"] = TensorInfo("model.layers.17.self_attn.q_proj.bias", "BF16", (H,))
    infos["model.layers.29.self_attn.k_proj.weight"] = TensorInfo("model.layers.29.self_attn.k_proj.weight", "F32", (KV_ROWS, H))
    sample = S.representative(infos)
    layers = sorted({int(name.split(".")[2]) for name in sample if name.startswith("model.layers.")})
    assert layers == [0, 3, 17, 29]
    assert {n for n in infos if not n.startswith("model.layers.")} <= set(sample)  # outside the layers: all kept
    assert all(n in sample for n in infos if n.startswith("model.layers.3."))  # a kept layer is kept whole (its experts)
    assert list(sample) == [n for n in infos if n in sample]  # in the catalog's order


def _odd_layer(infos: dict[str, TensorInfo], name: str, shape: tuple[int, ...]) -> dict[str, TensorInfo]:
    infos[name] = TensorInfo(name, "BF16", shape, "model.safetensors")
    return infos


PARITY = {  # catalog, rows offered when bound to the whole table
    "identical layers": (lambda: _llama_infos(30), ["hf_to_fused", "hf_to_meta"]),
    # numbered experts: hf_to_meta does not know them; from_transformers (registry=False) is offered unbound
    "dense then MoE": (lambda: _llama_infos(30, experts_from=2), ["from_transformers", "hf_to_fused"]),
    "fused": (lambda: _llama_infos(30, fused=True), ["fused_to_hf"]),
    # one layer in 30 with a q bias the config does not announce: hf_to_fused would leave it unfused
    "one layer with a bias": (lambda: _odd_layer(_llama_infos(30), "model.layers.23.self_attn.q_proj.bias", (H,)), []),
    # one fused layer whose qkv_proj rows are not q + 2 kv: fused_to_hf cannot split it
    "one fused layer of another size": (lambda: _odd_layer(_llama_infos(30, fused=True),
                                                           "model.layers.21.self_attn.qkv_proj.weight", (H + KV_ROWS, H)), []),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_the_sample_answers_as_the_whole_table(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make, expected = PARITY[case]
    sampled = [name for name, _ in suggest_rows(make(), LLAMA, registry=False)[1]]
    monkeypatch.setattr(S, "representative", dict)  # the reference: bind the whole table
    whole = [name for name, _ in suggest_rows(make(), LLAMA, registry=False)[1]]
    assert sampled == whole == expected
