"""The tokenizer files of a GGUF file (workbench/output/gguf/hf_tokenizer.py): built in a child process (a process
without transformers) and in this one (a process holding transformers and torch already) they are the same files,
and transformers' config is made only when asked for."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")


def test_child_and_in_process_build_the_same_files(monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf_support.reference import reference_gguf

    from workbench.output.gguf import hf_tokenizer as H

    path = reference_gguf("llama", "f16")  # a small vocabulary: the child's cost is importing transformers and torch
    monkeypatch.setattr(H, "_cache", {})
    in_child, why = H.tokenizer_files(path, config=True, child=True)
    assert why == "" and set(in_child) == {*H.FILES, H.TRANSFORMERS_CONFIG}
    monkeypatch.setattr(H, "_cache", {})
    here, why = H.tokenizer_files(path, config=True, child=False)
    assert why == "" and here == in_child
    assert json.loads(here["tokenizer_config.json"])["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads(here[H.TRANSFORMERS_CONFIG])["model_type"] == "llama"
    assert set(H.tokenizer_files(path, child=False)[0]) == set(H.FILES)  # no config unless asked for
    assert H.tokenizer_files(path, config=True)[0] is here  # cached per file and question


def test_a_file_transformers_cannot_read_gives_no_files_and_why(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.output.gguf import hf_tokenizer as H

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(H, "_cache", {})
    files, why = H.tokenizer_files(bad, child=False)
    assert files == {} and why.startswith("transformers could not build them from the GGUF vocabulary (")
