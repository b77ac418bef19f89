"""`--to pth` from a tied-embedding Llama (Llama 3.2 1B / 3B style, issue 29 D3): Meta's checkpoint holds its own
`output.weight`, which the workbench writes as the embedding's copy, so Meta's forward gives transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.mapper.test_presets import _meta_attention


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> tuple[Path, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
                         rms_norm_eps=1e-5)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("tied") / "llama32"
    model.save_pretrained(folder)
    return folder, model


def _meta_logits(meta: dict, config, ids: torch.Tensor) -> torch.Tensor:
    """Meta's Llama forward (llama/model.py: Transformer.forward) on its own checkpoint's names: the output layer is
    `output.weight`, whatever the embedding holds."""

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    h = meta["tok_embeddings.weight"][ids]
    for layer in range(config.num_hidden_layers):
        prefix = f"layers.{layer}."
        h = h + _meta_attention(meta, layer, rms(h, meta[prefix + "attention_norm.weight"]), config)
        x = rms(h, meta[prefix + "ffn_norm.weight"])
        ff = prefix + "feed_forward."
        h = h + (torch.nn.functional.silu(x @ meta[ff + "w1.weight"].T) * (x @ meta[ff + "w3.weight"].T)) @ meta[ff + "w2.weight"].T
    return rms(h, meta["norm.weight"]) @ meta["output.weight"].T


def test_a_tied_llama_writes_output_weight_and_metas_forward_matches_transformers(tied, tmp_path: Path) -> None:
    folder, model = tied
    report = wb.convert(folder, tmp_path / "out", to="pth", quiet=True, verify=True)
    assert report.verified
    meta = torch.load(tmp_path / "out" / "consolidated.00.pth", weights_only=True)
    assert torch.equal(meta["output.weight"], meta["tok_embeddings.weight"])
    assert torch.equal(meta["output.weight"], model.lm_head.weight.detach())
    ids = torch.tensor([[1, 5, 9, 33, 70, 2], [4, 4, 8, 15, 16, 23]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = _meta_logits(meta, model.config, ids)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    # Meta's own loading is strict about it: every key its model has is in the checkpoint.
    assert {f"layers.{i}.attention.wq.weight" for i in range(2)} | {"output.weight", "norm.weight"} <= set(meta)


def test_a_tied_llama_split_two_ways_carries_output_weight_in_both_files(tied, tmp_path: Path) -> None:
    folder, model = tied
    report = wb.convert(folder, tmp_path / "mp", to="pth", nproc_mp=2, quiet=True, verify=True)
    assert report.verified
    parts = [torch.load(tmp_path / "mp" / f"consolidated.0{r}.pth", weights_only=True) for r in range(2)]
    # ColumnParallelLinear: each file holds its rows of the output layer
    assert torch.equal(torch.cat([parts[0]["output.weight"], parts[1]["output.weight"]]), model.lm_head.weight.detach())


def test_verify_checks_the_pth_output_against_what_metas_model_declares(tied, tmp_path: Path) -> None:
    """The old fault, put back by a user mapper (no output.weight for a tied model): the plan is OK and every written
    tensor equals its ops, but the output check compares the file with Meta's layout from config.json and names the
    missing tensor."""
    import json

    from workbench import mapper as M
    from workbench.engine.output_check import check_outputs

    folder, _ = tied
    report = wb.convert(folder, tmp_path / "good", to="pth", nproc_mp=2, quiet=True, verify=True)
    assert "and with the Meta Llama (llama/model.py) statement (42 tensors)" in report.output_check.summary()
    config = json.loads((folder / "config.json").read_text())
    mapper = M.Sequential(M.presets.hf_to_meta(config), M.Drop("output.weight"))
    plan = wb.plan(folder, mapper, to="pth", dest=tmp_path / "out")
    assert plan.ok and "output.weight" not in set(plan.outputs.index)
    wb.convert(folder, tmp_path / "out", mapper, to="pth", quiet=True)
    check = check_outputs(plan)
    assert not check.ok and check.mismatches == ["output.weight"]
