"""wb.merge_config's front half (workbench/mergekit_config.py): reading the YAML, resolving model references,
naming sources, and the checkpoint it opens."""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from tests.mergekit_reference import FIXTURE, inputs_folder
from workbench.errors import MapperError
from workbench.mergekit_config import read_config, resolve_reference, same_vocabulary, source_names


def test_relative_models_resolve_against_the_config_folder_and_name_sources(tmp_path: Path) -> None:
    config = inputs_folder() / "slerp.yml"
    config.write_text((FIXTURE / "configs" / "slerp-bf16.yml").read_text())
    ck, mapper = wb.merge_config(config)
    assert list(ck.catalog.sources) == ["base", "ft1"]  # the base model is the primary source
    assert "ft1::model.norm.weight" in ck.tensors.index and "model.norm.weight" in ck.tensors.index
    assert mapper.method == "slerp" and mapper.base_model == "base"


def test_source_names_are_unique_path_tails() -> None:
    assert source_names(["fp32/base", "bf16/base", "org/model-x", "a/b/"]) == {
        "fp32/base": "base", "bf16/base": "base-2", "org/model-x": "model-x", "a/b/": "b"}


def test_references_resolve_to_urls_paths_or_hub_ids(tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    assert resolve_reference("local", tmp_path) == str(tmp_path / "local")
    assert resolve_reference("org/name", tmp_path) == "hf://org/name"
    assert resolve_reference("s3://bucket/model/", tmp_path) == "s3://bucket/model/"
    with pytest.raises(MapperError, match="model\\+lora"):
        resolve_reference("base+adapter", tmp_path)


def test_bad_yaml_and_missing_files_are_clear(tmp_path: Path) -> None:
    (tmp_path / "bad.yml").write_text("models: [\n")
    with pytest.raises(MapperError, match="not valid YAML"):
        read_config(tmp_path / "bad.yml")
    with pytest.raises(MapperError, match="Cannot read merge config"):
        read_config(tmp_path / "absent.yml")
    (tmp_path / "list.yml").write_text("- a\n")
    with pytest.raises(MapperError, match="expected a mapping"):
        read_config(tmp_path / "list.yml")
    with pytest.raises(MapperError, match="names no model"):
        wb.merge_config({"merge_method": "linear"})


def test_vocabularies_compare_by_token_and_id() -> None:
    tok = inputs_folder() / "tok"
    assert same_vocabulary([str(tok / "base"), str(tok / "ft1")])
    assert not same_vocabulary([str(tok / "base"), str(tok / "ft3")])
    assert not same_vocabulary([str(tok / "base"), str(tok / "missing")])


def test_yaml_anchor_bombs_and_huge_files_are_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
              for i in range(1, 9)]
    (tmp_path / "bomb.yml").write_text("\n".join(lines) + "\nmerge_method: linear\n")
    with pytest.raises(MapperError, match="expands to more than"):
        read_config(tmp_path / "bomb.yml")
    (tmp_path / "big.yml").write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(MapperError, match="larger than"):
        read_config(tmp_path / "big.yml")


def _copy_model(src: Path, dst: Path, **config: object) -> Path:
    import json
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**data, **config}))
    return dst


def test_a_shared_vocabulary_shorter_than_the_rows_is_cut_or_refused_for_slices() -> None:
    """mergekit cuts the rows to the tokenizer's length (the fixture case checks the bytes); over slices the
    workbench does not, and says so naming tokenizer_source instead of keeping vocab_size rows."""
    models = [{"model": "wide/base", "parameters": {"weight": 0.5}}, {"model": "wide/ft1", "parameters": {"weight": 0.5}}]
    ck, mapper = wb.merge_config({"merge_method": "linear", "models": models, "tokenizer_source": "base",
                                  "base_model": "wide/base"}, root=inputs_folder())
    plan = wb.plan(ck, mapper)
    assert plan.ok and plan.outputs.loc["model.embed_tokens.weight", "shape"] == (64, 32)
    slices = {"merge_method": "passthrough", "tokenizer_source": "base",
              "slices": [{"sources": [{"model": "wide/base", "layer_range": [0, 4]}]}]}
    ck, mapper = wb.merge_config(slices, root=inputs_folder())
    text = " ".join(str(p) for p in wb.plan(ck, mapper).problems)
    assert "tokenizer_source" in text and "cuts the rows" in text


def test_tokens_beyond_vocab_size_are_stripped_from_bpe_only(tmp_path: Path) -> None:
    """A WordLevel tokenizer with tokens beyond vocab_size under `base`: mergekit fails, the plan refuses; a model
    source with tokens beyond its rows likewise."""
    short = _copy_model(inputs_folder() / "fp32" / "base", tmp_path / "short", vocab_size=60)
    ck, mapper = wb.merge_config({"merge_method": "linear", "models": [{"model": str(short)}], "tokenizer_source": "base"})
    text = " ".join(str(p) for p in wb.plan(ck, mapper).problems)
    assert "tokenizer_source" in text and "BPE tokenizers only" in text
    ck, mapper = wb.merge_config({"merge_method": "linear", "models": [{"model": "bpe/base", "parameters": {"weight": 1.0}}],
                                  "tokenizer_source": "bpe/ft1"}, root=inputs_folder())
    text = " ".join(str(p) for p in wb.plan(ck, mapper).problems)
    assert "tokenizer_source" in text and "'yy'" in text


def test_each_model_longer_than_the_shared_tokenizer_is_cut() -> None:
    """A base of 64 rows and a fine-tune padded to 72 (same tokenizer): only the fine-tune is cut, the merge binds."""
    ck, mapper = wb.merge_config({"merge_method": "linear", "tokenizer_source": "base", "base_model": "fp32/base",
                                  "models": [{"model": "fp32/base", "parameters": {"weight": 0.5}},
                                             {"model": "wide/ft1", "parameters": {"weight": 0.5}}]}, root=inputs_folder())
    plan = wb.plan(ck, mapper)
    assert plan.ok, plan.problems
    assert plan.outputs.loc["lm_head.weight", "shape"] == (64, 32)
    code = mapper.to_code()
    assert "'ft1::lm_head.weight.beyond_tokenizer'" in code and "'lm_head.weight.beyond_tokenizer'" not in code
