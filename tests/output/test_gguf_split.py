"""Split GGUF output as llama.cpp writes it (issue 29, D5): the model's key/values (metadata and vocabulary) in the
first split only, the later splits holding just the split.* keys; byte-identical to the converter's
`--split-max-size` files."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_support.reference import model_folder, reference_split

import workbench as wb

gguf = pytest.importorskip("gguf")


def test_split_gguf_holds_the_key_values_in_the_first_split_only_as_llama_cpp(tmp_path: Path) -> None:
    wb.convert(model_folder("llama"), tmp_path / "out", to="gguf", dtype="f16", shard_size="60KB", quiet=True)
    ours = sorted((tmp_path / "out").glob("model-*.gguf"))
    theirs = reference_split("llama", "f16", "60K")
    assert [p.name for p in ours] == [p.name for p in theirs] and len(ours) > 2
    split_keys = {"split.no", "split.count", "split.tensors.count"}
    for k, path in enumerate(ours):
        keys = {key for key in gguf.GGUFReader(path).fields if not key.startswith("GGUF.")}
        if k == 0:
            assert split_keys < keys and "tokenizer.ggml.tokens" in keys and "general.architecture" in keys
        else:
            assert keys == split_keys, path.name
        assert path.read_bytes() == theirs[k].read_bytes(), path.name
