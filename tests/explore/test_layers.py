"""Layer folding and name selection."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.explore.layers import (
    compact_runs,
    fold_name,
    fold_names,
    natural_key,
)
from workbench.names import filter_names


def test_fold_name_replaces_numeric_segments_only():
    assert fold_name("model.layers.12.mlp.up_proj.weight") == ("model.layers.{i}.mlp.up_proj.weight", (12,))
    assert fold_name("blocks.3.experts.7.w1") == ("blocks.{i}.experts.{j}.w1", (3, 7))
    assert fold_name("0.weight") == ("{i}.weight", (0,))
    assert fold_name("h.5") == ("h.{i}", (5,))
    # digits inside a segment are part of a name, not an index
    assert fold_name("model.layer1.conv2d.weight") == ("model.layer1.conv2d.weight", ())
    assert fold_name("lm_head.weight") == ("lm_head.weight", ())


def test_fold_names_groups_and_orders_members():
    names = ["a.10.w", "a.2.w", "a.0.w", "b.1.x.3.y", "b.0.x.3.y", "b.0.x.1.y", "c"]
    folds = fold_names(names)
    assert [f.template for f in folds] == ["a.{i}.w", "b.{i}.x.{j}.y", "c"]
    a, b, c = folds
    assert a.names == ("a.0.w", "a.2.w", "a.10.w")
    assert a.indices == ((0,), (2,), (10,))
    assert a.count == 3 and a.placeholders == ("i",)
    assert a.index_range() == "0, 2, 10"
    assert b.placeholders == ("i", "j")
    assert b.index_range() == "i=0-1; j=1, 3"
    assert b.label(0) == "0.1"
    assert c.count == 1 and c.placeholders == () and c.index_range() == ""


def test_compact_runs():
    assert compact_runs([0, 1, 2, 3]) == "0-3"
    assert compact_runs([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert compact_runs([4]) == "4"
    assert compact_runs([]) == ""


def test_natural_key_orders_numbers_numerically():
    names = ["l.10.w", "l.9.w", "l.1.w", "a"]
    assert sorted(names, key=natural_key) == ["a", "l.1.w", "l.9.w", "l.10.w"]


def test_templates_and_globs_select_names():
    names = ["m.layers.0.q", "m.layers.1.q", "m.layers.1.k", "m.layers.x.q", "m.layers.1.2.q"]
    assert filter_names(names, "m.layers.{i}.q") == ["m.layers.0.q", "m.layers.1.q", "m.layers.x.q"]
    assert filter_names(names, "m.layers.*.q") == ["m.layers.0.q", "m.layers.1.q", "m.layers.x.q", "m.layers.1.2.q"]
    assert filter_names(names, "m.layers.1.k") == ["m.layers.1.k"]
    assert filter_names(["a.3.b.3", "a.3.b.4"], "a.{i}.b.{i}") == ["a.3.b.3"]


def test_layers_table_of_llama_sample(llama_sample):
    layers = wb.open_checkpoint(llama_sample).layers
    assert len(layers) == 12
    row = layers.loc["model.layers.{i}.self_attn.k_proj.weight"]
    assert row["count"] == 4 and row["range"] == "0-3"
    assert row["dtype"] == "F32" and row["shape"] == (32, 64)
    assert row["numel"] == 2048 and row["nbytes"] == 4 * 2048 * 4
    assert (layers["odd_layers"] == "").all()
    assert layers["nbytes"].sum() == 723_200
    assert list(layers.index[:3]) == ["lm_head.weight", "model.embed_tokens.weight", "model.layers.{i}.input_layernorm.weight"]


def test_layers_table_of_bert_sample(bert_sample):
    layers = wb.open_checkpoint(bert_sample).layers
    assert layers.loc["encoder.layer.{i}.attention.self.query.weight", "count"] == 2
    assert layers.loc["pooler.dense.weight", "count"] == 1
    assert layers["count"].sum() == 39


def test_odd_layer_is_flagged(tiny_checkpoint, tiny_tensors):
    tensors = tiny_tensors(layers=4, hidden=8)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(16, 8, dtype=torch.float16)
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(5, 8)
    ck = wb.open_checkpoint(tiny_checkpoint(tensors, shards=2))
    layers = ck.layers
    up = layers.loc["model.layers.{i}.mlp.up_proj.weight"]
    assert up["dtype"] == "F32" and up["shape"] == (16, 8)
    assert up["odd_layers"] == "2 (F16 [16, 8])"
    assert up["nbytes"] == 3 * 16 * 8 * 4 + 16 * 8 * 2
    assert layers.loc["model.layers.{i}.self_attn.k_proj.weight", "odd_layers"] == "3 (F32 [5, 8])"
    assert (layers.drop(index=["model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"])["odd_layers"] == "").all()
    assert "odd: 2 (F16 [16, 8])" in repr(ck)
    assert "<td>2 (F16 [16, 8])</td>" in ck._repr_html_()


def test_missing_layer_shows_in_range(tiny_checkpoint, tiny_tensors):
    tensors = tiny_tensors(layers=4)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    layers = wb.open_checkpoint(tiny_checkpoint(tensors)).layers
    assert layers.loc["model.layers.{i}.mlp.up_proj.weight", "range"] == "0, 2-3"
    assert layers.loc["model.layers.{i}.mlp.up_proj.weight", "count"] == 3


@pytest.mark.parametrize(
    "pattern,count",
    [
        ("model.layers.{i}.mlp.up_proj.weight", 4),
        ("*norm*", 9),
        ("lm_head.weight", 1),
        ("layers.{i}.self_attn.*", 16),  # a template with a glob, matching the end of the names
        ("self_attn.q_proj", 4),  # a run of whole segments inside the names
        ("norm.weight", 1),  # model.norm.weight, not input_layernorm.weight
    ],
)
def test_select_on_checkpoint(llama_sample, pattern, count):
    assert len(wb.open_checkpoint(llama_sample).select(pattern)) == count


def test_select_unknown_pattern_raises(llama_sample):
    with pytest.raises(wb.CheckpointError, match="no such tensor"):
        wb.open_checkpoint(llama_sample).select("model.blocks.{i}.attn")
    with pytest.raises(wb.CheckpointError, match=r"whole dotted segments; to match inside names write '\*attn\*'"):
        wb.open_checkpoint(llama_sample).select("attn")
