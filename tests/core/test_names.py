"""`workbench.names`: one `{placeholder}` syntax for mapper templates, folded layers and name filters."""

from __future__ import annotations

import pytest

from workbench.errors import WorkbenchError
from workbench.explore.layers import fold_name
from workbench.names import Template, filter_names, name_filter, no_match_hint

NAMES = [
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.10.self_attn.q_proj.weight",
    "model.norm.weight",
]


def test_the_explorer_example_combines_a_placeholder_with_a_glob() -> None:
    assert name_filter("layers.{i}.self_attn.*")("model.layers.0.self_attn.q_proj.weight")
    assert filter_names(NAMES, "layers.{i}.self_attn.*") == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.10.self_attn.q_proj.weight",
    ]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("model.norm.weight", ["model.norm.weight"]),  # the whole name
        ("norm.weight", ["model.norm.weight"]),  # a run of whole segments at the end ...
        ("model.layers.1", ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]),  # ... at the start
        ("mlp", ["model.layers.1.mlp.up_proj.weight"]),  # ... in the middle
        ("layers.1", ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]),  # not layers.10
        ("proj", []),  # part of a segment only
        ("*proj*", [n for n in NAMES if "proj" in n]),
        ("q_proj.weight", [n for n in NAMES if "q_proj" in n]),
        ("model.layers.{i}.self_attn.q_proj.weight", [n for n in NAMES if "q_proj" in n]),  # a mapper template
        ("{i}.self_attn.q_proj", [n for n in NAMES if "q_proj" in n]),  # a placeholder is a whole segment
        ("model.layers.?.self_attn.q_proj.weight", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]),
        ("layers.[!0].*", ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]),
        ("*.input_layernorm.*", ["model.layers.0.input_layernorm.weight"]),
        ("Model.norm.weight", []),  # case-sensitive
        ("*", NAMES),
        ("", NAMES),
    ],
)
def test_filter_rule(pattern: str, expected: list[str]) -> None:
    assert filter_names(NAMES, pattern) == expected


@pytest.mark.parametrize("word", ["weight", "model", "layers.1", "norm.weight", "proj", "odel", "model.norm.weight", "q_proj.weight"])
def test_plain_words_take_the_same_rule_as_patterns(word: str) -> None:
    """Plain text is tested with string operations (faster); it must select what the regex would."""
    as_pattern = f"[{word[0]}]{word[1:]}"  # the same text, forced through the regular expression
    assert filter_names(NAMES, word) == filter_names(NAMES, as_pattern)


def test_a_repeated_placeholder_is_the_same_text() -> None:
    names = ["a.3.b.3", "a.3.b.4", "x.a.7.b.7.w"]
    assert filter_names(names, "a.{i}.b.{i}") == ["a.3.b.3", "x.a.7.b.7.w"]
    assert filter_names(["a.3.b.33"], "a.{i}.b.{i}") == []


def test_filters_capture_as_mapper_templates_do() -> None:
    """Within a segment, placeholders take the shortest text; a repeated one is the same text wherever it
    is. Mapper templates and filters read names by one regular expression, so they agree."""
    assert Template("m.{a}_{b}.w", ("a", "b")).match(["m", "x_y_z", "w"]) == ("x", "y_z")
    assert Template("m.{a}_{a}.w", ("a",)).match(["m", "x_y_x_y", "w"]) == ("x_y",)
    assert filter_names(["m.x_y_x_y.w", "m.x_y_x.w"], "m.{a}_{a}.w") == ["m.x_y_x_y.w"]
    assert Template("{a}.{a}_{b}", ("a", "b")).match(["x_y", "x_y_z"]) == ("x_y", "z")
    assert filter_names(["x_y.x_y_z", "x.x_y_z", "x_z.x_y_z"], "{a}.{a}_{b}") == ["x_y.x_y_z", "x.x_y_z"]
    assert Template("m.{i}.w*", ("i",)).match(["m", "3", "w*"]) == ("3",)  # no globs in mapper names
    assert Template("m.{i}.w*", ("i",)).match(["m", "3", "wx"]) is None


def test_a_folded_layer_template_selects_its_members() -> None:
    for name in NAMES:
        template, _ = fold_name(name)
        members = filter_names(NAMES, template)
        assert name in members and all(fold_name(m)[0] == template for m in members)


def test_malformed_placeholder_and_literal_brackets() -> None:
    with pytest.raises(WorkbenchError, match=r"Cannot filter by 'layers\.\{i': it has a malformed placeholder"):
        name_filter("layers.{i")
    with pytest.raises(WorkbenchError, match="malformed placeholder"):
        name_filter("layers.{0}")
    assert filter_names(["a.[x", "a.x"], "a.[x") == ["a.[x"]  # an unclosed '[' is itself


def test_no_match_hint_only_for_plain_words() -> None:
    assert no_match_hint("attn") == "A filter matches whole dotted segments; to match inside names write '*attn*'."
    assert no_match_hint("*attn*") == "" and no_match_hint("layers.{i}") == ""
