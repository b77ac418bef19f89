"""`--verify` of an HF output against transformers (issue 29, verify statements): the model of the output's
config.json, built on the meta device, states every tensor the folder must hold, so a mapper that drops one cannot
re-read "all match"; where transformers cannot say (no such model type, a config that does not describe the source,
a mapper that changes the layout), the report says "not checked against transformers: why"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench import mapper as M

pytest.importorskip("transformers")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama") / "llama"
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(folder)
    return folder


def test_a_plain_conversion_is_checked_against_transformers(llama: Path, tmp_path: Path) -> None:
    report = wb.convert(llama, tmp_path / "out", dtype="bf16", quiet=True, verify=True)
    summary = report.output_check.summary()
    assert report.verified and "and with the transformers LlamaForCausalLM (llama) statement (21 tensors)" in summary


def test_a_mapper_that_drops_a_tensor_fails_verify(llama: Path, tmp_path: Path) -> None:
    mapper = M.Drop("model.layers.1.mlp.up_proj.weight")
    plan = wb.plan(llama, mapper, dest=tmp_path / "out")
    assert plan.ok
    report = wb.convert(llama, tmp_path / "out", mapper, quiet=True, verify=True)
    check = report.output_check
    assert not check.ok and check.mismatches == ["model.layers.1.mlp.up_proj.weight"]
    assert "the transformers LlamaForCausalLM (llama) statement has it" in check.frame().loc["model.layers.1.mlp.up_proj.weight", "detail"]


def test_a_tensor_of_the_wrong_shape_is_never_passed_silently(llama: Path, tmp_path: Path) -> None:
    """A reshape changes the layout config.json describes: the report names it instead of "all match" alone."""
    mapper = M.Reshape("model.norm.weight", [4, 8])
    summary = wb.convert(llama, tmp_path / "out", mapper, quiet=True, verify=True).output_check.summary()
    assert "not checked against transformers LlamaForCausalLM (llama): the mapper reshapes 'model.norm.weight'" in summary


def test_a_layout_the_config_does_not_describe_is_said_unchecked(llama: Path, tmp_path: Path) -> None:
    report = wb.convert(llama, tmp_path / "out", M.presets.hf_to_fused(llama), quiet=True, verify=True)
    summary = report.output_check.summary()
    assert report.verified and "not checked against transformers LlamaForCausalLM (llama): the mapper" in summary


def test_a_config_that_does_not_describe_the_source_is_said_unchecked(llama: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    report = wb.convert(src, tmp_path / "out", quiet=True, verify=True)
    assert report.verified and "config.json does not describe the source either" in report.output_check.summary()
    (src / "config.json").write_text(json.dumps({"model_type": "no-such-model", "architectures": ["NoSuch"]}))
    report = wb.convert(src, tmp_path / "out2", quiet=True, verify=True)
    assert report.verified and "not checked against transformers: " in report.output_check.summary()


def test_a_lora_merge_is_checked_against_transformers(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from peft_fixtures import make_case

    base, adapter, _ = make_case(tmp_path, "llama", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    report = wb.convert({"base": base, "adapter": adapter}, tmp_path / "out", M.presets.lora_merge(adapter), quiet=True, verify=True)
    assert report.verified and "and with the transformers LlamaForCausalLM (llama) statement" in report.output_check.summary()


def test_standalone_verify_checks_a_folder_against_transformers(llama: Path, tmp_path: Path, capsys) -> None:
    """`workbench verify PATH --model`: a folder whose safetensors lack a tensor config.json's model declares (and hold
    one it does not) fails, naming both; the intact folder passes, checked."""
    from safetensors.torch import load_file, save_file

    from workbench.cli import main
    from workbench.explore.verify import verify

    good = verify(llama, model=True)
    assert good.ok and "checked against the transformers LlamaForCausalLM (llama) statement (21 tensors): all present" in good.summary()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((llama / "config.json").read_text())
    tensors = load_file(llama / "model.safetensors")
    tensors["extra.weight"] = tensors.pop("model.layers.0.self_attn.k_proj.weight")
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert verify(bad).ok  # structurally sound: only the model check sees it
    report = verify(bad, model=True)
    assert not report.ok and {f.tensor for f in report.errors} == {"model.layers.0.self_attn.k_proj.weight", "extra.weight"}
    assert main(["verify", str(bad), "--model"]) == 2
    out = capsys.readouterr().out
    assert "'model.layers.0.self_attn.k_proj.weight' missing" in out and "'extra.weight' mismatch" in out
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file(tensors, str(bare / "model.safetensors"))
    assert "not checked against transformers: no config.json beside the weights" in verify(bare, model=True).summary()


def test_a_tensor_the_source_holds_beyond_the_model_is_not_the_conversions_fault(llama: Path, tmp_path: Path) -> None:
    """An old checkpoint's extra buffer (a persistent `position_ids` transformers no longer declares), copied as it is,
    does not fail the check, which still holds for every tensor transformers declares."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(llama, src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.position_ids"] = torch.arange(8)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    report = wb.convert(src, tmp_path / "out", quiet=True, verify=True)
    assert report.verified and "and with the transformers LlamaForCausalLM (llama) statement" in report.output_check.summary()
    report = wb.convert(src, tmp_path / "out2", M.Drop("model.norm.weight"), quiet=True, verify=True)
    assert report.output_check.mismatches == ["model.norm.weight"]
