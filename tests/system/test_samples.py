"""The committed sample checkpoints: what they hold, that transformers reads them, that they regenerate."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from tests.conftest import REPO, SAMPLES


def load_script():
    spec = importlib.util.spec_from_file_location("make_samples", REPO / "scripts" / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_samples_are_small():
    total = sum(p.stat().st_size for p in SAMPLES.rglob("*") if p.is_file())
    assert total <= 10 * 1024 * 1024
    assert (SAMPLES / "README.md").is_file()


def test_llama_sample_layout(llama_sample):
    shards = sorted(llama_sample.glob("*.safetensors"))
    assert 3 <= len(shards) <= 4
    assert {p.name for p in llama_sample.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors.index.json"}
    index = json.loads((llama_sample / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    config = json.loads((llama_sample / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (4, 2, 4)
    assert config["tie_word_embeddings"] is False
    total = 0
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in list(f.keys()):
                assert index["weight_map"][name] == shard.name
                sl = f.get_slice(name)
                assert sl.get_dtype() == "F32"
                total += 4 * torch.Size(sl.get_shape()).numel()
    assert total == index["metadata"]["total_size"]
    with safe_open(shards[0], framework="pt") as f:
        assert "model.layers.0.self_attn.k_proj.weight" in list(f.keys())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [32, 64]


def test_bert_sample_layout(bert_sample):
    assert sorted(p.name for p in bert_sample.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(bert_sample / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    assert "encoder.layer.1.attention.self.query.weight" in names and "pooler.dense.weight" in names


@pytest.mark.slow
def test_transformers_loads_samples_without_missing_keys(llama_sample, bert_sample):
    from transformers import BertModel, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    for cls, folder in ((LlamaForCausalLM, llama_sample), (BertModel, bert_sample)):
        model, info = cls.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (folder.name, info)
        assert next(model.parameters()).dtype == torch.float32


@pytest.mark.slow
def test_regeneration_gives_identical_bytes(tmp_path):
    """Every file regenerates byte for byte, except the transformers version stamped into the JSON configs."""
    script = load_script()
    script.generate(tmp_path)
    for name in ("tiny-llama", "tiny-bert"):
        assert script.differing_files(tmp_path / name, SAMPLES / name) == [], name
    # The comparison sees a changed weight byte and a changed config field, but not the version stamp alone.
    shard = tmp_path / "tiny-llama" / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    config = tmp_path / "tiny-bert" / "config.json"
    config.write_text(config.read_text().replace('"transformers_version": "', '"transformers_version": "0.0.0-'))
    assert script.differing_files(tmp_path / "tiny-bert", SAMPLES / "tiny-bert") == []
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 65'))
    assert script.differing_files(tmp_path / "tiny-bert", SAMPLES / "tiny-bert") == ["config.json"]
    assert script.differing_files(tmp_path / "tiny-llama", SAMPLES / "tiny-llama") == ["model-00001-of-00003.safetensors"]
