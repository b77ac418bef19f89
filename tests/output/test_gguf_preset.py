"""GGUF output of models with tensors the usual fixtures lack (issue 29, D1): a Llama with `attention_bias` and
`mlp_bias` is byte-identical to llama.cpp's converter (every bias kept, the q/k biases permuted like their weights);
a tensor the preset has no GGUF name for is a plan problem, never dropped; and `--verify` compares the file with the
preset's statement of every tensor, so a tensor the conversion dropped does not pass."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from pathlib import Path

import pytest
from gguf_support.reference import (
    CACHE,
    ROOT,
    _run_converter,
    building,
    cached_folder,
    converter,
    model_folder,
)

import workbench as wb
from workbench.engine.output_check import check_outputs

gguf = pytest.importorskip("gguf")
SEED = 29


def _biased_llama(folder: Path, family: str = "llama") -> Path:
    """A tiny random Llama (attention and MLP biases) or Qwen3 (attention biases), every parameter random, with the
    tokenizer of the cached test model of that family."""
    import torch
    import transformers

    tokenizer = model_folder(family)
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    vocab = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, attention_bias=True)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, mlp_bias=True))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    torch.manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def _cached(family: str) -> Path:
    """`_biased_llama(family)`, built once per recipe (this builder's code and the tokenizer's model folder) into the
    fixture cache, as `gguf_support.reference` caches its models."""
    recipe = hashlib.sha256((inspect.getsource(_biased_llama) + model_folder(family).name).encode()).hexdigest()[:8]
    folder = CACHE / "gguf-models" / f"{family}-biases-{SEED}-{recipe}"
    return cached_folder(folder, lambda aside: _biased_llama(aside, family))


@pytest.fixture(scope="module")
def biased() -> Path:
    return _cached("llama")


def _reference(folder: Path, outtype: str) -> Path:
    """What llama.cpp's converter writes for `folder` with `--outtype outtype` (cached beside the suite's references)."""
    script = converter()
    out = ROOT / "references" / f"{folder.name}-{outtype}.gguf"
    if not out.is_file():
        with building(out):
            if not out.is_file():
                _run_converter(script, folder, outtype, out)
    return out


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_a_llama_with_biases_equals_llama_cpp_converter(biased: Path, outtype: str, tmp_path: Path) -> None:
    report = wb.convert(biased, tmp_path / "out", to="gguf", dtype=outtype, quiet=True, verify=True)
    assert report.verified
    assert "all match, and with the llama.cpp GGUF (llama) statement (35 tensors;" in report.output_check.summary()
    ours = tmp_path / "out" / "model.gguf"
    reference = _reference(biased, outtype)
    mine = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(reference).tensors}
    assert list(mine) == list(theirs)
    for name in ("blk.0.attn_output.bias", "blk.1.ffn_gate.bias", "blk.1.ffn_up.bias", "blk.0.ffn_down.bias",
                 "blk.0.attn_q.bias", "blk.1.attn_k.bias", "blk.0.attn_v.bias"):
        assert name in mine and mine[name].tensor_type.name == "F32", name
    for name, tensor in theirs.items():
        assert mine[name].tensor_type == tensor.tensor_type, name
        assert bytes(mine[name].data.view("u1")) == bytes(tensor.data.view("u1")), name
    assert ours.read_bytes() == reference.read_bytes()


def test_qwen3_with_attention_biases_equals_llama_cpp_converter(tmp_path: Path) -> None:
    folder = _cached("qwen3")
    wb.convert(folder, tmp_path / "out", to="gguf", dtype="bf16", quiet=True)
    assert (tmp_path / "out" / "model.gguf").read_bytes() == _reference(folder, "bf16").read_bytes()


def test_a_tensor_the_preset_cannot_name_is_a_plan_problem(biased: Path, tmp_path: Path) -> None:
    """A tensor llama.cpp's converter would stop at ("Can not map tensor") is reported, not dropped; the buffers the
    converter leaves out on purpose are dropped, and the plan says so."""
    from safetensors.torch import load_file, save_file

    odd = tmp_path / "odd"
    shutil.copytree(biased, odd)
    tensors = load_file(odd / "model.safetensors")
    import torch

    tensors["model.layers.0.self_attn.rope_scale"] = torch.ones(4)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, odd / "model.safetensors", metadata={"format": "pt"})
    plan = wb.plan(odd, to="gguf")
    assert not plan.ok
    (problem,) = plan.errors
    assert "'model.layers.0.self_attn.rope_scale'" in problem.message and "left unconverted" in problem.message
    assert "inv_freq" not in problem.message and "the GGUF file would be written without them" in problem.message
    # Dropped by a mapper ahead of the preset: the conversion goes through, without it.
    from workbench import mapper as M

    plan = wb.plan(odd, M.Drop("model.layers.0.self_attn.rope_scale"), to="gguf")
    assert plan.ok, plan.errors
    assert "blk.0.attn_output.bias" in set(plan.outputs.index)


def test_verify_fails_when_the_conversion_dropped_a_tensor_of_the_source(biased: Path, tmp_path: Path, monkeypatch) -> None:
    """The old fault, put back: a preset whose ops forget o_proj.bias (and that claims nothing). The plan is OK, but
    the output check compares the file with the preset's statement and the source, and names what is missing."""
    from workbench.mapper.presets import gguf_preset

    real_name = gguf_preset.gguf_name
    monkeypatch.setattr(gguf_preset, "gguf_name", lambda hf: None if hf.endswith("o_proj.bias") else real_name(hf))
    monkeypatch.setattr(gguf_preset, "Claim", lambda *args: gguf_preset.Parallel(), raising=False)  # no claim either
    plan = wb.plan(biased, to="gguf", dest=tmp_path / "out")
    assert plan.ok
    wb.convert(biased, tmp_path / "out", to="gguf", quiet=True)
    check = check_outputs(plan)
    assert not check.ok
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.1.self_attn.o_proj.bias"} <= set(check.mismatches)
    assert "dropped" in dict((r[0], r[5]) for r in check.rows)["model.layers.0.self_attn.o_proj.bias"]


def test_verify_fails_when_a_stated_tensor_is_not_written(biased: Path, tmp_path: Path, monkeypatch) -> None:
    """The statement and the ops disagree (a stated tensor no op makes): verify names it."""
    from workbench.mapper.presets import gguf_preset

    real = gguf_preset.hf_to_gguf

    def forgetful(*args, **kwargs):
        mapper, planned, arch = real(*args, **kwargs)
        planned["blk.0.ffn_up.extra.weight"] = planned["blk.0.ffn_up.weight"]
        return mapper, planned, arch

    monkeypatch.setattr(gguf_preset, "hf_to_gguf", forgetful)
    plan = wb.plan(biased, to="gguf", dest=tmp_path / "out")
    wb.convert(biased, tmp_path / "out", to="gguf", quiet=True)
    check = check_outputs(plan)
    assert not check.ok and check.mismatches == ["blk.0.ffn_up.extra.weight"]


@pytest.mark.parametrize("family", ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_every_gguf_family_claims_every_source_tensor(family: str, tmp_path: Path) -> None:
    """Each family the GGUF output accepts: its test model plans OK with nothing dropped by the rest rule, and one
    tensor more that llama.cpp has no name for makes the plan fail, naming it."""
    import torch
    from safetensors.torch import load_file, save_file

    src = model_folder(family)
    plan = wb.plan(src, to="gguf")
    assert plan.ok, plan.errors
    assert plan.binding.dropped == []  # every source tensor made into a GGUF tensor
    if family not in ("llama", "mixtral", "deepseek_v3"):  # the claim is the same for all: dense, MoE and MLA show it
        return
    odd = tmp_path / family
    odd.mkdir()
    for path in src.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, odd / path.name)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.mystery.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(tensors, odd / "model.safetensors", metadata={"format": "pt"})
    problems = [p.message for p in wb.plan(odd, to="gguf").errors]
    assert len(problems) == 1 and "'model.layers.1.mlp.mystery.weight'" in problems[0] and "left unconverted" in problems[0]
