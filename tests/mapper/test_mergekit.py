"""mergekit configs as mappers (workbench.mapper.presets.mergekit, mapper.merge.slices): the outputs equal
mergekit's bit for bit on a few representative cases (the full set runs in tests/system/test_mergekit_reference.py),
slices renumber and copy bytes, and every key the workbench does not carry out is a plan problem naming it."""

from __future__ import annotations

import importlib.util

import pytest

import workbench as wb
from tests.mergekit_reference import (
    config,
    differences,
    inputs_folder,
    manifest,
    merge_case,
    token_differences,
)
from workbench import mapper as M
from workbench.errors import MapperError
from workbench.mapper.merge.slices import MergeSlices, SliceCopies, merge_slices, rereads
from workbench.mapper.presets.mergekit import config_mapper, model_references

FAST = ["linear-bf16", "slerp-gradient-fp32", "ties-gradient-bf16", "passthrough-slices-bf16", "slerp-slices-fp32"]


@pytest.mark.parametrize("case", FAST)
def test_outputs_equal_mergekits_bit_for_bit(case: str, tmp_path) -> None:
    merge_case(case, tmp_path / "out")
    assert differences(case, tmp_path / "out") == []


def test_slices_renumber_layers_and_copy_bytes(tmp_path) -> None:
    ck, mapper = wb.merge_config(config("passthrough-slices-bf16"), root=inputs_folder())
    plan = wb.plan(ck, mapper)
    assert plan.ok, plan.problems
    outputs = plan.outputs
    assert sorted({int(n.split(".")[2]) for n in outputs.index if n.startswith("model.layers.")}) == list(range(7))
    # ft1 layers 0-2 -> 0-2, ft2 layers 1-3 -> 3-5, ft1 layer 3 -> 6: ft1's layer 3 read once, nothing recomputed
    assert not rereads(config("passthrough-slices-bf16")["slices"])
    ft1, ft2 = wb.open_checkpoint(inputs_folder() / "bf16/ft1"), wb.open_checkpoint(inputs_folder() / "bf16/ft2")
    wb.convert(ck, tmp_path / "out", mapper, quiet=True)
    out = wb.open_checkpoint(tmp_path / "out")
    import torch

    assert torch.equal(out.load("model.layers.4.mlp.up_proj.weight"), ft2.load("model.layers.2.mlp.up_proj.weight"))
    assert torch.equal(out.load("model.layers.6.self_attn.q_proj.weight"), ft1.load("model.layers.3.self_attn.q_proj.weight"))
    assert torch.equal(out.load("model.embed_tokens.weight"), ft1.load("model.embed_tokens.weight"))  # first slice's model
    assert torch.equal(out.load("model.norm.weight"), ft1.load("model.norm.weight"))  # last slice's model
    import json

    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 7


def test_a_layer_read_twice_is_copied_first(tmp_path) -> None:
    slices = [{"sources": [{"model": "a", "layer_range": [0, 3]}]}, {"sources": [{"model": "a", "layer_range": [1, 4]}]}]
    mapper = merge_slices("passthrough", slices)
    assert isinstance(mapper, M.Sequential) and isinstance(mapper.mappers[0], SliceCopies)
    ck = wb.open_checkpoint({"a": str(inputs_folder() / "fp32/ft1")})
    plan = wb.plan(ck, mapper)
    assert plan.ok, plan.problems
    assert len([n for n in plan.outputs.index if n.endswith("mlp.up_proj.weight")]) == 6
    wb.convert(ck, tmp_path / "out", mapper, quiet=True)
    out, src = wb.open_checkpoint(tmp_path / "out"), wb.open_checkpoint(inputs_folder() / "fp32/ft1")
    import torch

    for layer in (1, 3):  # source layers 1 and 2 appear twice: out 1 and 3, out 2 and 4
        assert torch.equal(out.load(f"model.layers.{layer}.mlp.up_proj.weight"), src.load("model.layers.1.mlp.up_proj.weight"))
    # without the copy step the slices refuse (each read needs its own tensor)
    bare = wb.plan(ck, MergeSlices("passthrough", slices))
    assert not bare.ok and any("read by several layers" in p.message for p in bare.problems)


def test_mapper_round_trips_through_code() -> None:
    names = {ref: ref.replace("/", "_") for ref in model_references(config("slerp-slices-bf16"))}
    mapper = config_mapper(config("slerp-slices-bf16"), names)
    namespace: dict = {}
    exec(mapper.to_code(), namespace)
    assert namespace["mapper"] == mapper
    assert M.from_json(mapper.to_json()) == mapper  # what workers receive


@pytest.mark.parametrize(("key", "value"), [("modules", {"text": {}}), ("chat_template", "x"), ("lora_rank", 8),
                                            ("tokenizer", {"source": "union", "tokens": {"<x>": {"source": "nowhere"}}})])
def test_unsupported_keys_are_plan_problems_naming_the_key(key: str, value: object) -> None:
    cfg = {**config("linear-fp32"), key: value}
    ck, mapper = wb.merge_config(cfg, root=inputs_folder())
    plan = wb.plan(ck, mapper)
    assert not plan.ok
    named = key if key != "tokenizer" else "tokenizer.tokens"
    assert any(f"config key {named!r}" in p.message and p.kind == "unsupported" for p in plan.problems), plan.problems


def test_unknown_parameters_and_model_keys_are_refused() -> None:
    cfg = config("ties-fp32")
    cfg["parameters"] = {"densty": 0.5}
    cfg["models"][0]["weights"] = 1
    ck, mapper = wb.merge_config(cfg, root=inputs_folder())
    messages = [p.message for p in wb.plan(ck, mapper).problems]
    assert any("'densty' is unknown" in m for m in messages)
    assert any("'models[0].weights'" in m for m in messages)


def test_tokenizer_union_builds_the_vocabulary_and_moves_rows_by_token(tmp_path) -> None:
    # tok/ft3 adds zeta and omega, tok/ft5 lacks five of the base's words and adds alpha, zeta (averaged with ft3's,
    # the base lacks it), beta and two special tokens: 70 rows, each equal to mergekit's row of the same token
    case = "linear-tokenizer-union-added"
    ck, mapper = wb.merge_config(config(case), root=inputs_folder())
    namespace: dict = {}
    exec(mapper.to_code(), namespace)
    assert namespace["mapper"] == mapper and M.from_json(mapper.to_json()) == mapper
    plan = wb.plan(ck, mapper)  # the dry-run: the new shapes, vocab_size and the tokenizer file, nothing read yet
    assert plan.ok, plan.problems
    assert tuple(plan.outputs.loc["model.embed_tokens.weight", "shape"]) == (70, 32)
    generated = {e.path: e for e in plan.extra_files if e.action == "generate"}
    assert "tokenizer.json" in generated and "and 6 more tokens" in generated["tokenizer.json"].reason
    wb.convert(ck, tmp_path / "out", mapper, quiet=True)
    assert token_differences(case, tmp_path / "out") == []
    import json

    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 70
    added = json.loads((tmp_path / "out" / "tokenizer.json").read_text())["added_tokens"]
    # the workbench's order: models in config order, each model's tokens by id, the added tokens last
    assert [(a["id"], a["content"], a["special"]) for a in added[4:]] == [
        (64, "zeta", False), (65, "omega", False), (66, "alpha", False), (67, "beta", False),
        (68, "<|im_start|>", True), (69, "<|im_end|>", True)]


def test_a_model_as_tokenizer_source_gives_its_vocabulary_and_files(tmp_path) -> None:
    case = "ties-tokenizer-model"
    ck, mapper = wb.merge_config(config(case), root=inputs_folder())
    wb.convert(ck, tmp_path / "out", mapper, quiet=True)
    assert differences(case, tmp_path / "out") == []  # one order: bit for bit
    assert token_differences(case, tmp_path / "out") == []
    ft5 = inputs_folder() / "tok" / "ft5"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (ft5 / name).read_bytes()


@pytest.mark.parametrize("case", ["linear-chat-template-literal", "linear-chat-template-auto"])
def test_chat_template_is_written_as_mergekit_writes_it(case: str, tmp_path) -> None:
    merge_case(case, tmp_path / "out")
    want = manifest()["cases"][case]["tokenizer"]["chat_template"]
    assert (tmp_path / "out" / "chat_template.jinja").read_text(encoding="utf-8") == want  # byte for byte
    import json

    assert "chat_template" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert token_differences(case, tmp_path / "out") == []


def test_a_built_in_chat_template_is_read_from_an_installed_mergekit(tmp_path, monkeypatch) -> None:
    case = "linear-chat-template-chatml"
    refused = wb.plan(*wb.merge_config(config(case), root=inputs_folder())).problems
    if importlib.util.find_spec("mergekit") is None:
        assert any("'chat_template'" in p.message and "Install mergekit" in p.message for p in refused)
    # a mergekit package (its template file: the text mergekit wrote for this case) found on the path
    want = manifest()["cases"][case]["tokenizer"]["chat_template"]
    package = tmp_path / "site" / "mergekit"
    (package / "_data" / "chat_templates").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (package / "_data" / "chat_templates" / "chatml.jinja").write_text(want, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    merge_case(case, tmp_path / "out")
    assert (tmp_path / "out" / "chat_template.jinja").read_text(encoding="utf-8") == want
    assert token_differences(case, tmp_path / "out") == []


def test_tokenizer_settings_that_cannot_be_matched_name_their_key() -> None:
    cases = [({"chat_template": "{bad"}, "chat_template", "neither a built-in"),
             ({"tokenizer_source": "union", "slices": [{"sources": [{"model": "tok/base", "layer_range": [0, 4]},
                                                                     {"model": "tok/ft5", "layer_range": [0, 4]}]}]},
              "tokenizer_source", "not slices")]
    for change, key, why in cases:
        cfg = {**config("linear-tokenizer-section"), **change}
        if "slices" in change:
            cfg.pop("models")
            cfg.pop("tokenizer")
        ck, mapper = wb.merge_config(cfg, root=inputs_folder())
        messages = [p.message for p in wb.plan(ck, mapper).problems]
        assert any(f"{key!r}" in m and why in m for m in messages), messages


def test_tokenizer_source_base_moves_rows_by_token_as_mergekit(tmp_path) -> None:
    # tok/ft3 has ten tokens at other ids and two more tokens: its rows are moved to the base's vocabulary
    ck, mapper = wb.merge_config(config("linear-tokenizer-base"), root=inputs_folder())
    assert isinstance(mapper, M.Sequential) and isinstance(mapper.mappers[0], M.Parallel)
    namespace: dict = {}
    exec(mapper.to_code(), namespace)
    assert namespace["mapper"] == mapper
    plan = wb.plan(ck, mapper)
    assert plan.ok, plan.problems
    assert tuple(plan.outputs.loc["lm_head.weight", "shape"]) == (64, 32)
    wb.convert(ck, tmp_path / "out", mapper, quiet=True)
    assert differences("linear-tokenizer-base", tmp_path / "out") == []


def test_tokenizer_source_base_without_a_base_model_says_what_it_needs() -> None:
    cfg = {k: v for k, v in config("linear-tokenizer-base").items() if k != "base_model"}
    ck, mapper = wb.merge_config(cfg, root=inputs_folder())
    assert any("'tokenizer_source'" in p.message and "needs base_model" in p.message for p in wb.plan(ck, mapper).problems)


def test_vocabulary_rows_follow_mergekits_defaults() -> None:
    from workbench.mapper.merge.vocabulary import align_rows

    out = {"a": 0, "b": 1, "c": 2, "d": 3}
    vocabs = [{"a": 0, "b": 1}, {"b": 0, "a": 1, "c": 2}, {"a": 0, "b": 1, "c": 2, "d": 3}]
    tables = align_rows(out, vocabs, [2, 3, 3], base=None)  # model 2's "d" is beyond its 3 rows: absent
    assert tables[0] == (((0, 0),), ((0, 1),), ((1, 2), (2, 2)), ())  # c: the average of the two that have it; d: zeros
    assert tables[1][:2] == (((1, 1),), ((1, 0),))  # own rows, moved by token
    assert align_rows(out, vocabs, [2, 3, 3], base=2)[0][2] == ((2, 2),)  # the base's row before an average


def test_tokenizer_source_base_with_one_vocabulary_is_a_plain_merge(tmp_path) -> None:
    cfg = {**config("linear-fp32"), "tokenizer_source": "base", "base_model": "fp32/ft1"}
    ck, mapper = wb.merge_config(cfg, root=inputs_folder())
    assert wb.plan(ck, mapper).ok
    wb.convert(ck, tmp_path / "out", mapper, quiet=True)
    assert differences("linear-fp32", tmp_path / "out") == []


def test_malformed_slices_are_refused_when_built() -> None:
    with pytest.raises(MapperError, match="layer_range"):
        MergeSlices("passthrough", [{"sources": [{"model": "a", "layer_range": [3, 1]}]}])
    with pytest.raises(MapperError, match="different numbers of layers"):
        MergeSlices("slerp", [{"sources": [{"model": "a", "layer_range": [0, 2]}, {"model": "b", "layer_range": [0, 3]}]}])
    with pytest.raises(MapperError, match="'residual_weight' is not supported"):
        MergeSlices("passthrough", [{"sources": [{"model": "a", "layer_range": [0, 2]}], "residual_weight": 0.1}])


def test_manifest_describes_its_format() -> None:
    assert "inputs" in manifest()["format"] and manifest()["tools"]["mergekit"] == "0.1.5"


def test_parameter_table_lists_the_values_each_tensor_gets() -> None:
    from workbench.mapper.merge.table import parameter_table

    ck, mapper = wb.merge_config(config("ties-slices-fp32"), root=inputs_folder())
    table = parameter_table(mapper, ck)
    assert len(table) == len(wb.plan(ck, mapper).outputs)
    up = table.loc[[f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)]]
    # slice 1: ft1's mlp weight is the gradient [0.2, 0.9] over its 3 layers; slice 2: its own base (ft3), flat weights
    assert list(up["weight"]) == ["ft1=0.2, ft2=0.4", "ft1=0.55, ft2=0.4", "ft1=0.9, ft2=0.4", "ft1=0.5, base=0.3",
                                  "ft1=0.5, base=0.3"]
    assert list(up["base"]) == ["base", "base", "base", "ft3", "ft3"]
    assert table.loc["model.layers.1.self_attn.q_proj.weight", "weight"] == "ft1=0.6, ft2=0.4"  # the filter's default
