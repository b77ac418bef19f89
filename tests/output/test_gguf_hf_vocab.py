"""The byte-fallback BPE vocabulary read from the JSON files equals what the `gguf` package's `LlamaHfVocab` lists
through transformers (the converter's route), on tokenizers with added tokens, extra specials and left-out names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_support.models import _tokenizer

from workbench.output import gguf_hf_vocab

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


def _reference(root: Path) -> list[list]:
    vocab = gguf.LlamaHfVocab(root)
    return [list(column) for column in zip(*[(text, score, int(kind)) for text, score, kind in vocab.all_tokens()], strict=True)]


def _with_added_tokens(root: Path, config: dict, legacy: dict | None = None) -> Path:
    """The tests' byte-fallback tokenizer plus two special and one plain token beyond its vocabulary."""
    from tokenizers import AddedToken, Tokenizer

    root.mkdir(parents=True)
    _tokenizer(root)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|tool|>", special=True)])
    tok.add_tokens([AddedToken("hello world", special=False)])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "special_tokens_map.json").unlink()
    if legacy is not None:
        (root / "special_tokens_map.json").write_text(json.dumps(legacy))
    return root


CASES = {
    "named in the config": {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "class defaults": {"tokenizer_class": "LlamaTokenizerFast"},
    "extra specials": {"tokenizer_class": "LlamaTokenizerFast", "eos_token": "<|im_start|>",
                       "additional_special_tokens": ["<|tool|>"]},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_json_vocabulary_equals_llama_hf_vocab(tmp_path: Path, case: str) -> None:
    root = _with_added_tokens(tmp_path / "tok", CASES[case])
    mine = gguf_hf_vocab.read(root)
    assert mine is not None
    assert [list(column) for column in mine] == _reference(root)
    assert 3 in mine[2] and 4 in mine[2] or case == "named in the config"  # CONTROL and USER_DEFINED added tokens


def test_the_legacy_special_tokens_map_overrides_the_config(tmp_path: Path) -> None:
    root = _with_added_tokens(tmp_path / "tok", {"tokenizer_class": "LlamaTokenizerFast", "eos_token": "</s>"},
                              legacy={"eos_token": "<|tool|>", "bos_token": "<s>"})
    mine = gguf_hf_vocab.read(root)
    assert mine is not None and [list(column) for column in mine] == _reference(root)


def test_an_unknown_tokenizer_class_leaving_names_out_is_left_to_transformers(tmp_path: Path) -> None:
    root = _with_added_tokens(tmp_path / "tok", {"tokenizer_class": "SomeOtherTokenizerFast"})
    assert gguf_hf_vocab.read(root) is None


def _byte_level_folder(tmp_path: Path, tokenizer: str) -> Path:
    """A copy of the GGUF tests' `tokenizer` files with two non-normalised added tokens whose decoding differs
    from their text (byte-level characters) and one looking like a control token."""
    import shutil

    from gguf_support.reference import model_folder
    from tokenizers import AddedToken, Tokenizer

    source = model_folder("qwen2" if tokenizer == "qwen2" else "llama", tokenizer)
    root = tmp_path / tokenizer
    root.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, root / name)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.add_tokens([AddedToken("helloĠworld", normalized=False), AddedToken("<|odd|>", normalized=False)])
    tok.add_tokens([AddedToken("plain added", normalized=True)])
    tok.save(str(root / "tokenizer.json"))
    return root


@pytest.mark.parametrize("tokenizer", ["qwen2", "llama3", "gpt2"])
def test_byte_level_vocabulary_equals_transformers_listing(tmp_path: Path, tokenizer: str) -> None:
    from workbench.output import gguf_bpe_vocab
    from workbench.output.gguf_vocab import _looks_special, gpt2_vocab

    root = _byte_level_folder(tmp_path, tokenizer)
    size = json.loads((root / "config.json").read_text()).get("vocab_size") if tokenizer == "qwen2" else None  # Qwen2: padded
    mine = gguf_bpe_vocab.read(root, size, _looks_special)
    reference = gpt2_vocab(root, size)
    assert mine is not None
    assert mine[0] == reference[0] and mine[1] == reference[1]
    assert "hello world" in mine[0] and "<|odd|>" in mine[0]  # the round trip decoded the byte-level character


@pytest.mark.parametrize("merges", [[["a b", "c"], ["Ġt", "he"]], ["a c", "Ġt he"]], ids=["pairs", "strings"])
def test_tokenizer_json_read_once_equals_json_and_special_vocab_merges(tmp_path: Path, merges: list) -> None:
    """`gguf_tokenizer_json.load` gives json.load's document (merges aside) and the merges packed as the gguf
    package's SpecialVocab lists them (a space inside a pair part encoded as U+0120); its slim copy gives
    SpecialVocab the same special tokens and flags without vocabulary and merges."""
    from workbench.output.gguf_packed import strings
    from workbench.output.gguf_tokenizer_json import SlimFolder, load

    root = tmp_path / "tok"
    root.mkdir()
    document = {"version": "1.0", "added_tokens": [{"id": 3, "content": "<|end|>", "special": True}],
                "post_processor": {"type": "ByteLevel", "trim_offsets": False}, "extra": {"x": [1, 2.5, None]},
                "model": {"type": "BPE", "vocab": {"a": 0, "c": 1, "Ġt": 2, "<|end|>": 3, "\"q\\u00e9": 4}, "merges": merges}}
    (root / "tokenizer.json").write_text(json.dumps(document, indent=2, ensure_ascii=False))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "add_bos_token": False}))
    loaded = load(root / "tokenizer.json")
    assert loaded.document == {**document, "model": {**document["model"], "merges": []}}
    reference = gguf.SpecialVocab(root, load_merges=True)
    assert loaded.merges == strings(reference.merges)
    with SlimFolder(loaded) as folder:
        slim = gguf.SpecialVocab(folder, load_merges=False)
        assert json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"] == {}
    assert (slim.special_token_ids, slim.add_special_token) == (reference.special_token_ids, reference.add_special_token)
    assert not folder.exists()


def test_a_broken_tokenizer_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    from workbench.errors import PlanError
    from workbench.output.gguf_tokenizer_json import load

    (tmp_path / "tokenizer.json").write_text('{"model": {"merges": [["a", "b"], 7]}}')
    with pytest.raises(PlanError, match=r"Cannot read .*tokenizer.json: its merges are neither"):
        load(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}} trailing')
    with pytest.raises(PlanError, match="tokenizer.json"):
        load(tmp_path / "tokenizer.json")
