"""Tied embeddings and Meta's layout both ways (issue 29 D3): `presets.hf_to_meta` used by hand writes Meta's
`output.weight` for a tied Llama (as the `.pth` default does), and `presets.meta_to_hf` leaves it out for a tied
config after checking it is the embedding's copy, so transformers ties the head back to the same values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import MapperError

IDS = torch.tensor([[1, 5, 9, 33, 70, 2]])


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Path, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tied") / "llama32"
    model.save_pretrained(folder)
    return folder, model


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("call", ["wb.convert", "cli"])
def test_hf_to_meta_by_hand_writes_the_output_layer(tied, tmp_path: Path, call: str) -> None:
    folder, model = tied
    if call == "cli":
        from workbench.cli import main

        assert main(["convert", str(folder), str(tmp_path / "out"), "--to", "pth", "--preset", "hf_to_meta", "--quiet"]) == 0
    else:
        wb.convert(folder, tmp_path / "out", M.presets.hf_to_meta(_config(folder)), to="pth", quiet=True)
    meta = torch.load(tmp_path / "out" / "consolidated.00.pth", weights_only=True)
    assert torch.equal(meta["output.weight"], model.lm_head.weight.detach())
    assert torch.equal(meta["tok_embeddings.weight"], model.model.embed_tokens.weight.detach())


def test_meta_to_hf_of_a_tied_config_ties_back(tied, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder, model = tied
    config = _config(folder)
    wb.convert(folder, tmp_path / "meta", to="pth", quiet=True)
    source = tmp_path / "meta"  # the Meta folder: params.json beside the .pth
    plan = wb.plan(source, M.presets.meta_to_hf(config))
    assert plan.ok, plan.problems
    wb.convert(source, tmp_path / "hf", M.presets.meta_to_hf(config), quiet=True)
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in out and set(out) == set(load_file(folder / "model.safetensors"))
    assert _config(tmp_path / "hf")["tie_word_embeddings"] is True  # generated from params.json: the head is tied back
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(IDS).logits, model(IDS).logits)


def test_meta_to_hf_refuses_a_head_that_is_not_the_embedding(tied) -> None:
    folder, _ = tied
    config = _config(folder)
    meta = M.presets.hf_to_meta(config).apply(load_file(folder / "model.safetensors"))
    meta["output.weight"] = meta["output.weight"] + 1
    with pytest.raises(MapperError, match="it differs from tok_embeddings.weight"):
        M.presets.meta_to_hf(config).apply(meta)
    meta["output.weight"] = torch.zeros(3, 64)
    problems = M.presets.meta_to_hf(config).bind(meta).problems
    assert any("cannot be one tensor" in p.message for p in problems)


def test_verify_of_a_pth_without_config_says_it_was_not_checked(tied, tmp_path: Path) -> None:
    """A `.pth` written from a folder without config.json has no Meta layout to be checked against: the report says
    so instead of passing as checked."""
    import shutil

    folder, _ = tied
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "model.safetensors", bare / "model.safetensors")
    mapper = M.presets.hf_to_meta(_config(folder))
    report = wb.convert(bare, tmp_path / "out", mapper, to="pth", quiet=True, verify=True)
    assert report.verified
    assert "not checked against Meta's layout: " in report.output_check.summary()
    assert "has no config.json" in report.output_check.summary()
