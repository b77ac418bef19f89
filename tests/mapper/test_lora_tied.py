"""PEFT `modules_to_save=["embed_tokens"]` on a model whose output head is tied to the embedding (issue 29, D6).

PEFT replaces the embedding with the trained copy and leaves the head on the base embedding: merge_and_unload
unties them and save_pretrained writes `lm_head.weight`. The merged folder must load with transformers'
`from_pretrained` to PEFT's logits; without the base's config the merge is refused, never written tied."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from peft_fixtures import LLAMA, randomise
from safetensors.torch import load_file

import workbench as wb
from workbench import mapper as M

# peft (seconds to import) only where a test makes an adapter: the collection of both workers skips it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")

QWEN2 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
TOKENS = torch.tensor([[1, 5, 9, 2, 33, 60, 7]])


def _case(root, kind, **lora):
    """base/, adapter/ and PEFT's reference: the logits of the adapter loaded onto the base, and the state
    dict of its merge_and_unload."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.save_pretrained(root / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **lora))
    randomise(peft_model)
    peft_model.save_pretrained(root / "adapter")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), root / "adapter")
    with torch.no_grad():
        logits = loaded(TOKENS).logits
    merged = loaded.merge_and_unload()
    merged.save_pretrained(root / "peft-merged")
    return root / "base", root / "adapter", logits, load_file(root / "peft-merged" / "model.safetensors")


def _logits(folder):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder)(TOKENS).logits


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _case(tmp_path_factory.mktemp("tied"), "qwen2", modules_to_save=["embed_tokens"])


def test_tied_embedding_replaced_is_untied_as_peft_does(tied, tmp_path):
    base, adapter, logits, peft_saved = tied
    assert "lm_head.weight" in peft_saved and "lm_head.weight" not in load_file(base / "model.safetensors")
    wb.convert({"base": base, "adapter": adapter}, tmp_path / "out", M.presets.lora_merge(adapter, base=base), quiet=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert set(out) == set(peft_saved)
    for name, tensor in out.items():
        assert torch.equal(tensor, peft_saved[name]), name
    assert not torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])
    torch.testing.assert_close(_logits(tmp_path / "out"), logits, rtol=0, atol=1e-5)


def test_tied_from_a_config_mapping_or_an_opened_checkpoint(tied, tmp_path):
    base, adapter, logits, _ = tied
    config = json.loads((base / "config.json").read_text())
    source = wb.open_checkpoint({"base": base, "adapter": adapter})
    for i, known in enumerate((config, wb.open_checkpoint(base), source)):
        wb.convert(source, tmp_path / f"out{i}", M.presets.lora_merge(adapter, base=known), quiet=True)
        torch.testing.assert_close(_logits(tmp_path / f"out{i}"), logits, rtol=0, atol=1e-5)


def test_unknown_tying_is_refused_not_written_tied(tied):
    base, adapter, _, _ = tied
    plan = wb.plan({"base": base, "adapter": adapter}, M.presets.lora_merge(adapter))
    assert not plan.ok
    message = " ".join(p.message for p in plan.errors)
    assert "'lm_head.weight' is not in the source" in message and "'tied? pass base= to lora_merge'" in message


def test_cli_adapter_knows_its_base_and_unties_as_peft(tied, tmp_path):
    """`convert BASE OUT --adapter A` passes BASE as the merge's base, so a tied embedding the adapter replaces is
    untied as PEFT does instead of refused."""
    from workbench.cli import main

    base, adapter, logits, peft_saved = tied
    assert main(["convert", str(base), str(tmp_path / "out"), "--adapter", str(adapter), "--quiet"]) == 0
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["lm_head.weight"], peft_saved["lm_head.weight"])
    torch.testing.assert_close(_logits(tmp_path / "out"), logits, rtol=0, atol=1e-5)


def test_untied_base_keeps_its_head(tmp_path):
    base, adapter, logits, peft_saved = _case(tmp_path, "llama", modules_to_save=["embed_tokens"])
    for mapper in (M.presets.lora_merge(adapter), M.presets.lora_merge(adapter, base=base)):
        out_dir = tmp_path / f"out{id(mapper)}"
        wb.convert({"base": base, "adapter": adapter}, out_dir, mapper, quiet=True)
        out = load_file(out_dir / "model.safetensors")
        assert set(out) == set(peft_saved) and all(torch.equal(t, peft_saved[n]) for n, t in out.items())
        torch.testing.assert_close(_logits(out_dir), logits, rtol=0, atol=1e-5)


def test_ensure_weight_tying_keeps_the_head_tied(tmp_path):
    base, adapter, logits, _ = _case(tmp_path, "qwen2", modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    wb.convert({"base": base, "adapter": adapter}, tmp_path / "out", M.presets.lora_merge(adapter, base=base), quiet=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])
    torch.testing.assert_close(_logits(tmp_path / "out"), logits, rtol=0, atol=1e-5)


def test_untied_merge_says_so_in_config_json(tied, tmp_path):
    """The merge unties the head, and the output's config.json says so as PEFT's saved merge does: loaders that tie
    by the config (older transformers, other runtimes) would otherwise put the new embedding in the head."""
    base, adapter, logits, _ = tied
    mapper = M.presets.lora_merge(adapter, base=base)
    plan = wb.plan({"base": base, "adapter": adapter}, mapper, dest=tmp_path / "out")
    assert "config.json: tie_word_embeddings true -> false" in plan.summary()
    wb.convert({"base": base, "adapter": adapter}, tmp_path / "out", mapper, quiet=True)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((base / "config.json").read_text())
    peft = json.loads((base.parent / "peft-merged" / "config.json").read_text())
    assert written["tie_word_embeddings"] is False and written["tie_word_embeddings"] == peft["tie_word_embeddings"]
    assert {k: v for k, v in written.items() if k != "tie_word_embeddings"} == {k: v for k, v in source.items() if k != "tie_word_embeddings"}
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "out").tie_word_embeddings is False
    torch.testing.assert_close(_logits(tmp_path / "out"), logits, rtol=0, atol=1e-5)
