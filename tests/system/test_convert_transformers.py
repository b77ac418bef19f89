"""Converted checkpoints reload with transformers' from_pretrained and compute the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench as wb
from workbench.mapper import presets

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def logits_of(folder: Path, dtype=None):
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = transformers.LlamaForCausalLM.from_pretrained(folder, **kwargs).eval()
    tokens = torch.arange(24).reshape(2, 12) % 256
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def reference(llama_sample: Path):
    return logits_of(llama_sample)


def test_reshard_reloads_with_identical_logits(llama_sample: Path, tmp_path: Path, reference) -> None:
    report = wb.convert(llama_sample, tmp_path / "out", shard_size="100KB", quiet=True)
    assert len([f for f in report.files if f.endswith(".safetensors")]) >= 7
    assert torch.equal(logits_of(tmp_path / "out"), reference)


def test_fuse_then_inverse_reloads_with_identical_logits(llama_sample: Path, tmp_path: Path, reference) -> None:
    fuse = presets.hf_to_fused(llama_sample / "config.json")
    wb.convert(llama_sample, tmp_path / "fused", fuse, shard_size="300KB", quiet=True)
    fused = wb.open_checkpoint(tmp_path / "fused")
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused.catalog
    assert "model.layers.0.self_attn.q_proj.weight" not in fused.catalog
    back = fuse.inverse(wb.open_checkpoint(llama_sample))
    wb.convert(fused, tmp_path / "back", back, quiet=True)
    assert torch.equal(logits_of(tmp_path / "back"), reference)


def test_cast_to_bf16_reloads_like_the_cast_model(llama_sample: Path, tmp_path: Path) -> None:
    wb.convert(llama_sample, tmp_path / "bf16", dtype="bf16", quiet=True)
    assert {t.dtype for t in wb.open_checkpoint(tmp_path / "bf16").catalog.values()} == {"BF16"}
    expected = logits_of(llama_sample, torch.bfloat16)  # the same weights, rounded by torch on load
    assert torch.equal(logits_of(tmp_path / "bf16", torch.bfloat16), expected)


def test_cast_updates_the_config_so_auto_dtype_loads_the_cast_weights(tmp_path: Path, capsys) -> None:
    from workbench.cli import main

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "src")
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype="auto").dtype == torch.float32
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert "extra updated: config.json (the weights are stored as bfloat16: dtype: float32 -> bfloat16)" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert model.dtype == torch.bfloat16
    before = json.loads((tmp_path / "src" / "config.json").read_text())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text()) == {**before, "dtype": "bfloat16"}
