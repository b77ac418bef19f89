"""The tokenizer side of mergekit configs (workbench/mergekit_tokenizer.py): the union vocabulary, the tokenizer
config edits and the chat template choices, on small hand-made tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.mergekit_tokenizer import (
    ModelTokenizer,
    chat_template,
    config_with,
    contiguous,
    model_template,
    read_tokenizer,
    union_vocabulary,
)


def _added(i: int, content: str, special: bool = True) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": not special,
            "special": special}


def _tok(tokens: list[str], added: list[dict] = (), size: int | None = None) -> ModelTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    vocab.update({a["content"]: a["id"] for a in added})
    return ModelTokenizer("x", vocab, tuple(added), size if size is not None else len(vocab))


def test_union_adds_other_models_tokens_in_config_order_then_their_added_tokens() -> None:
    base = _tok(["<s>", "a", "b"], [_added(0, "<s>")])
    one = _tok(["<s>", "c", "a", "d"], [_added(0, "<s>"), _added(4, "<x>")])
    two = _tok(["b", "e", "c", "f"], [_added(3, "<x>", special=False)], size=3)  # "f" is beyond its 3 rows
    out, entries = union_vocabulary([base, one, two])
    assert out == {"<s>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "<x>": 6}
    assert [(e["id"], e["content"], e["special"], e["normalized"]) for e in entries] == [
        (3, "c", False, True), (4, "d", False, True), (5, "e", False, True), (6, "<x>", True, False)]  # first settings win


def test_a_plain_base_token_another_model_adds_keeps_its_id() -> None:
    out, entries = union_vocabulary([_tok(["a", "<y>"]), _tok(["a"], [_added(1, "<y>")])])
    assert out == {"a": 0, "<y>": 1} and [(e["id"], e["content"]) for e in entries] == [(1, "<y>")]


def test_contiguous_ids() -> None:
    assert contiguous({"a": 1, "b": 0}) and not contiguous({"a": 0, "b": 2}) and not contiguous({"a": 0, "b": 0})


def test_read_tokenizer_takes_vocab_size_from_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["a", 0.0], ["b", -1.0]]},
                                                         "added_tokens": [_added(2, "<s>")]}))
    (tmp_path / "config.json").write_text('{"vocab_size": 8}')
    tok = read_tokenizer(str(tmp_path))
    assert tok is not None and tok.vocab == {"a": 0, "b": 1, "<s>": 2} and tok.size == 8
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert read_tokenizer(str(tmp_path)) is None and read_tokenizer(str(tmp_path / "missing")) is None


def test_tokenizer_config_lists_added_tokens_and_loses_its_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"0": {"content": "<s>"}},
                                                                "chat_template": "{{ x }}", "eos_token": "<s>"}))
    text = config_with(str(tmp_path), added=[_added(5, "<x>")], drop_template=True)
    data = json.loads(text)
    assert data["added_tokens_decoder"]["5"]["content"] == "<x>" and data["added_tokens_decoder"]["5"]["special"] is True
    assert "chat_template" not in data and data["eos_token"] == "<s>"
    assert config_with(str(tmp_path)) is None  # nothing to change


def test_chat_template_choices(tmp_path: Path) -> None:
    literal = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat_template(literal, []) == (literal, None)
    text, why = chat_template("{x}", [])  # too short for a template, a brace for a name
    assert text is None and "neither a built-in template name nor a Jinja template" in why
    folders = []
    for i, template in enumerate(["{{ b }}\n", "{{ a }}", "{{ b }}", None]):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        config = {"chat_template": template} if template else {}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        folders.append(str(folder))
    assert chat_template("auto", folders) == ("{{ b }}", None)  # the most common one, stripped
    assert chat_template("auto", folders[3:]) == (None, None)  # none: the tokenizer stays as it is
    (tmp_path / "m1" / "chat_template.jinja").write_text("{{ jinja }}")
    assert model_template(folders[1]) == "{{ jinja }}"  # the file wins, as transformers loads it


def test_a_template_name_without_mergekit_installed_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    text, why = chat_template("chatml", [])
    assert text is None and "built-in templates" in why and "Install mergekit" in why


def test_token_settings_become_rows_where_mergekit_uses_them() -> None:
    from workbench.mapper.merge.vocabulary import TokenSource, align_rows, token_rows
    from workbench.mergekit_tokenizer import token_sources

    models = ["base", "ft"]
    vocabs, sizes = [{"a": 0, "b": 1}, {"b": 0, "c": 1, "d": 2}], [2, 2]  # ft's "d" is beyond its 2 rows
    tokens = {"a": {"source": {"kind": "zero"}}, "b": {"source": "ft"},  # b: both have it, not forced: nothing
              "c": {"source": {"kind": "model_token", "model": "base", "token": "a"}, "force": True},
              "d": {"source": {"kind": "model_token", "model": "ft", "token_id": 2}}}
    found, why = token_sources(tokens, models, vocabs, sizes, base=0)
    assert why is None and found == {"a": TokenSource(()), "c": TokenSource(((0, 0),), True), "d": TokenSource(((1, 2),))}
    out = {"a": 0, "b": 1, "c": 2, "d": 3}
    tables = token_rows(align_rows(out, vocabs, sizes, 0), out, vocabs, sizes, found)
    assert tables[0] == (((0, 0),), ((0, 1),), ((0, 0),), ((1, 2),))  # base keeps a; forced c from base's a
    assert tables[1] == ((), ((1, 0),), ((0, 0),), ((1, 2),))  # ft lacks a: zeros; c forced over its own row
    for bad, words in (({"x": {"source": "other"}}, "not one of the merged models"),
                       ({"x": {}}, "needs a source"), ({"x": {"source": "ft", "weight": 1}}, "expected {source, force}"),
                       ({"c": {"source": "base"}}, "does not have it"),
                       ({"x": {"source": {"kind": "model_token", "model": "ft", "token": "b", "token_id": 0}}}, "exactly one")):
        assert words in token_sources(bad, models, vocabs, sizes)[1]


def test_padding_rows_are_the_mean_of_the_rows_above() -> None:
    import torch

    from workbench import mapper as M

    op = M.AlignVocabulary(["e"], ["e"], [[[[0, 1]], [[0, 0]], []]], pad=2)
    assert M.from_json(op.to_json()) == op
    (out,) = op._compute([torch.tensor([[1.0, 2.0], [3.0, 5.0]])])
    assert out[:3].tolist() == [[3.0, 5.0], [1.0, 2.0], [0.0, 0.0]]
    assert torch.equal(out[3:], torch.mean(out[:3], dim=0).expand(2, 2))  # mergekit's mean, bit for bit
    with pytest.raises(Exception, match="pad"):
        M.AlignVocabulary(["e"], ["e"], [[[[0, 0]]]], pad=-1)


def test_the_plan_counts_the_rebuilt_rows_of_a_group() -> None:
    """Bound with the merge that follows, the rebuilt tensors are intermediates: the op's scratch counts them (and
    a dtype cast's copies), so the dry-run's peak covers them."""
    from workbench import mapper as M
    from workbench.catalog import TensorInfo

    op = M.AlignVocabulary(["a", "b"], ["a", "b"], [[[[0, 0]]] * 5, [[[1, 0]]] * 5], dtype="F32", pad=3)
    inputs = [TensorInfo("a", "BF16", (4, 8), "f", 0, 64), TensorInfo("b", "F32", (4, 8), "f", 0, 128)]
    assert op.scratch_bytes(inputs) == 4 * 8 * 4 + 8 * 4 + 2 * (5 + 3) * 8 * 4  # a's cast, one row, two outputs
