"""`OutputFile` (workbench/mapper/output_file.py): the statements of files the output gets instead of the primary
source's copies — exported and rebuilt like any leaf, checked when built, and their content rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench import mapper as M
from workbench.errors import MapperError
from workbench.mapper.output_file import output_files


def test_statements_round_trip_through_code_and_json() -> None:
    mapper = M.Sequential(M.OutputFile("chat_template.jinja", text="{{ x }}", why="chat_template"),
                          M.OutputFile("tokenizer.json", source="/m/tokenizer.json", added=['{"id": 5, "content": "z"}']),
                          M.OutputFile("vocab.json", why="stale"))
    namespace: dict = {}
    exec(mapper.to_code(), namespace)
    assert namespace["mapper"] == mapper and M.from_json(mapper.to_json()) == mapper
    files, conflicts = output_files(mapper)
    assert [f.path for f in files] == ["chat_template.jinja", "tokenizer.json", "vocab.json"] and not conflicts
    assert [f.written for f in files] == [True, True, False]


@pytest.mark.parametrize("kwargs", [{"path": "../x"}, {"path": "a/b.json"}, {"path": "t.json", "text": "x", "source": "/s"},
                                    {"path": "t.json", "added": ["{}"], "source": "/s"},
                                    {"path": "t.json", "added": ['{"id": 1, "content": "a"}']}])
def test_malformed_statements_are_refused(kwargs: dict) -> None:
    with pytest.raises(MapperError, match="Cannot build OutputFile"):
        M.OutputFile(**kwargs)


def test_two_contents_for_one_file_are_a_conflict() -> None:
    _, conflicts = output_files(M.Sequential(M.OutputFile("a.json", text="1"), M.OutputFile("a.json", text="2")))
    assert conflicts and "'a.json'" in conflicts[0]


def test_content_adds_tokens_to_the_source_tokenizer(tmp_path: Path) -> None:
    source = tmp_path / "tokenizer.json"
    source.write_text(json.dumps({"added_tokens": [{"id": 0, "content": "<s>"}], "model": {"vocab": {"<s>": 0, "a": 1}}}))
    statement = M.OutputFile("tokenizer.json", source=str(source), added=['{"id": 2, "content": "b"}'])
    data = json.loads(statement.content())
    assert [t["content"] for t in data["added_tokens"]] == ["<s>", "b"] and data["model"]["vocab"] == {"<s>": 0, "a": 1}
    assert M.OutputFile("x.json", source=str(source)).content() == source.read_bytes()
    with pytest.raises(MapperError, match="cannot be read"):
        M.OutputFile("x.json", source=str(tmp_path / "gone.json")).content()


def test_content_strips_tokens_beyond_a_count_as_mergekit_does(tmp_path: Path) -> None:
    """keep_below: tokens of that id and above leave the vocabulary, the added tokens and the BPE merges using one
    (in either merges format); merges of kept tokens stay."""
    source = tmp_path / "tokenizer.json"
    source.write_text(json.dumps({"added_tokens": [{"id": 0, "content": "<s>"}, {"id": 5, "content": "<x>"}],
                                  "model": {"type": "BPE", "vocab": {"<s>": 0, "a": 1, "b": 2, "ab": 3, "bb": 4},
                                            "merges": [["a", "b"], "bb b", ["b", "bb"]]}}))
    statement = M.OutputFile("tokenizer.json", source=str(source), keep_below=4)
    data = json.loads(statement.content())
    assert data["model"]["vocab"] == {"<s>": 0, "a": 1, "b": 2, "ab": 3} and data["model"]["merges"] == [["a", "b"]]
    assert [t["content"] for t in data["added_tokens"]] == ["<s>"]
    namespace: dict = {}
    exec(M.Sequential(statement, M.OutputFile("x.txt", text="1")).to_code(), namespace)
    assert namespace["mapper"].mappers[0] == statement
    with pytest.raises(MapperError, match="keep_below"):
        M.OutputFile("tokenizer.json", keep_below=4)
