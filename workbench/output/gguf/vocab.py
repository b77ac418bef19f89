"""The tokenizer part of a GGUF header (`tokenizer.ggml.*`), read from an HF folder as llama.cpp's converter reads it.

Three routes, chosen as `convert_hf_to_gguf.py` chooses them for the Llama family:
- SentencePiece (`tokenizer.model`, Llama 2 / Mistral): model "llama", pre "default", pieces, scores and types.
  The protobuf is parsed here (pieces are fields 1/2/3 of each `pieces` entry), so no `sentencepiece` install is
  needed; `added_tokens.json`, `tokenizer_config.json`'s `added_tokens_decoder` and padding to `vocab_size`
  follow the converter's rules.
- HF byte-fallback BPE (`tokenizer.json`, Llama-style): listed as the `gguf` package's `LlamaHfVocab` lists it, read
  from the JSON files (`hf_vocab`; `LlamaHfVocab` itself, through transformers, for unknown tokenizer classes).
- GPT-2 byte-level BPE (`tokenizer.json`; Llama 3, Qwen2/3): model "gpt2", tokens and types as transformers'
  tokenizer lists them, read from the JSON files (`bpe_vocab`; transformers itself when the config asks to
  clean up tokenization spaces), merges by the `gguf` package, and the pre-tokenizer named after the `tokenizer.json` pre-tokenizer
  (the converter hashes the tokenization of a probe text; the regex is what that hash stands for).
Qwen2/3 try SentencePiece then GPT-2; Llama and Mistral try SentencePiece, byte-fallback BPE, then GPT-2.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...errors import PlanError
from .. import source_files
from . import bpe_vocab, packed
from .packed import add_packed
from .tokenizer_json import json_file

# SentencePiece piece types (its protobuf enum) as llama.cpp records them: a user-defined piece is NORMAL there.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SP_TYPES = {NORMAL: NORMAL, UNKNOWN: UNKNOWN, CONTROL: CONTROL, USER_DEFINED: NORMAL, UNUSED: UNUSED, BYTE: BYTE}
_PAD_SCORE, _ADDED_SCORE = -10000.0, -1000.0

# The GPT-2 family's pre-tokenizer regexes (as tokenizer.json holds them) -> llama.cpp's pre-tokenizer names.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise ValueError("a varint runs past the end")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("a varint is longer than 10 bytes")


def _fields(data: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message; length-delimited values as bytes."""
    out, at = [], 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = data[at:at + 8], at + 8
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at:at + length], at + length
        elif wire == 5:
            value, at = data[at:at + 4], at + 4
        else:
            raise ValueError(f"wire type {wire} of field {number} is not a protobuf type")
        if at > len(data):
            raise ValueError(f"field {number} runs past the end")
        out.append((number, wire, value))
    return out


def sentencepiece_pieces(path: Path) -> list[tuple[bytes, float, int]]:
    """(piece, score, type) of every piece of a SentencePiece `tokenizer.model`, in id order."""
    data = source_files.read_bytes(path)  # the source-file rule: no link out of the folder, bounded size
    if data is None:
        raise PlanError(f"Cannot read the SentencePiece model {path}: it does not exist. Copy the model's own tokenizer.model.",
                        file=str(path))
    try:
        pieces = []
        for number, wire, entry in _fields(data):
            if number != 1 or wire != 2:
                continue
            piece, score, kind = b"", 0.0, NORMAL
            for field, field_wire, value in _fields(entry):
                if field == 1 and field_wire == 2:
                    piece = bytes(value)
                elif field == 2 and field_wire == 5:
                    score = struct.unpack("<f", value)[0]
                elif field == 3 and field_wire == 0:
                    kind = value
            pieces.append((piece, score, kind))
    except (OSError, ValueError) as exc:
        raise PlanError(f"Cannot read the SentencePiece model {path}: {exc}. Copy the model's own tokenizer.model.") from None
    if not pieces:
        raise PlanError(f"Cannot read the SentencePiece model {path}: it holds no pieces. Copy the model's own tokenizer.model.")
    return pieces


def _looks_special(text: str) -> bool:
    """llama.cpp's test for added tokens that are control tokens though not marked special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>")) or (text.startswith("<unused") and text.endswith(">")))


def sentencepiece_vocab(root: Path, vocab_size: int | None) -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and types of `root/tokenizer.model` as llama.cpp's converter lists them."""
    pieces = sentencepiece_pieces(root / "tokenizer.model")
    size = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores = [_PAD_SCORE] * size
    types = [UNUSED] * size
    for k, (piece, score, kind) in enumerate(pieces[:size]):
        tokens[k], scores[k], types[k] = piece, score, _SP_TYPES.get(kind, NORMAL)
    added = json_file(root / "added_tokens.json") or {}
    for text, k in added.items():
        if k < size:
            tokens[k], scores[k], types[k] = text.encode(), _ADDED_SCORE, USER_DEFINED
    config = json_file(root / "tokenizer_config.json") or {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        k, text = int(key), entry["content"]
        if k >= size:
            continue
        if entry.get("special") or _looks_special(text):
            types[k] = CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[k] = USER_DEFINED
        scores[k], tokens[k] = _ADDED_SCORE, text.encode()
    return tokens, scores, types


def pre_tokenizer_name(root: Path, tokenizer: Any = None) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE `tokenizer.json` (`tokenizer`: already parsed);
    PlanError if it is not one the workbench knows (Llama 3, Qwen2/3, GPT-2)."""
    found = json_file(root / "tokenizer.json") if tokenizer is None else tokenizer
    found = found if isinstance(found, dict) else {}
    pre = found.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(regexes) == 1 and regexes[0] in PRE_TOKENIZERS and byte_level and not byte_level[0].get("use_regex", True):
        return PRE_TOKENIZERS[regexes[0]]
    if not regexes and len(byte_level) == 1 and byte_level[0].get("use_regex", True) and not byte_level[0].get("add_prefix_space"):
        return "gpt-2"
    raise PlanError(f"Cannot write GGUF for {root}: its tokenizer.json pre-tokenizer is not one the workbench names for "
                    "llama.cpp (Llama 3, Qwen2/3 or GPT-2 byte-level BPE). Use llama.cpp's convert_hf_to_gguf.py for this model.")


def gpt2_vocab(root: Path, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """Tokens and types of a byte-level BPE tokenizer, as llama.cpp's converter lists them (through transformers)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise PlanError(f"Cannot write GGUF for {root}: reading its byte-level BPE tokenizer needs transformers. "
                        "Install it: pip install transformers.") from None
    with outside_reader(root) as copy:
        tokenizer = AutoTokenizer.from_pretrained(copy, local_files_only=True)
    vocab = tokenizer.vocab
    size = vocab_size or len(vocab)
    if max(vocab.values()) >= size:
        raise PlanError(f"Cannot write GGUF for {root}: its tokenizer has token id {max(vocab.values())}, beyond vocab_size "
                        f"{size} in config.json. Fix the config or the tokenizer.")
    by_id = {k: text for text, k in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for k in range(size):
        if k not in by_id:
            tokens.append(f"[PAD{k}]")
            types.append(UNUSED)
            continue
        text = by_id[k]
        if text in added:
            text, kind = bpe_vocab.added_token(text, decoder[k].special, decoder[k].normalized,
                                               lambda t: tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)),
                                               _looks_special)
        else:
            kind = NORMAL
        tokens.append(text)
        types.append(kind)
    return tokens, types


@contextmanager
def outside_reader(root: Path) -> Iterator[Path]:
    """A staged copy of `root`'s tokenizer files (`source_files.staged`) for a reader outside the workbench (the gguf
    package's vocabularies, transformers' tokenizer), whose failures on malformed files (they index what they
    expect to find) become a PlanError naming the folder's tokenizer files."""
    with source_files.staged(root) as folder:
        try:
            yield folder
        except (AttributeError, TypeError, KeyError, IndexError, ValueError, RecursionError) as exc:
            raise PlanError(f"Cannot read the tokenizer files of {root} (tokenizer.json, tokenizer_config.json ...): they are "
                            f"not shaped as a tokenizer's ({type(exc).__name__}: {str(exc)[:200]}). Copy the model's own "
                            "tokenizer files into the folder.", file=str(root)) from None


def _llama_hf_vocab(root: Path, tokenizer: dict) -> tuple[list[Any], list[float], list[int]] | None:
    from . import hf_vocab

    if not hf_vocab.is_byte_fallback_bpe(tokenizer):  # LlamaHfVocab refuses it: the converter goes on to GPT-2
        return None
    found = hf_vocab.read(root, tokenizer)  # from the JSON files: transformers (and the torch it imports) is not needed
    if found is not None:
        return found
    import gguf

    with outside_reader(root) as copy:
        try:
            vocab = gguf.LlamaHfVocab(copy)
        except (FileNotFoundError, TypeError):  # not a byte-fallback BPE: the converter goes on to GPT-2
            return None
        tokens, scores, types = [], [], []
        for text, score, kind in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(kind)
    return tokens, scores, types


def add_vocab(writer: Any, root: Path, arch: str, vocab_size: int | None) -> int:
    """Add the tokenizer keys of `root` to a `gguf.GGUFWriter`, by the converter's route for `arch`; the token count.

    tokenizer.json is read once (`tokenizer_json`: merges packed as they are met) and `gguf.SpecialVocab` reads
    it without vocabulary and merges (`SlimFolder`); the long arrays (tokens, scores, types, merges) go in packed
    (`packed`), so the writer's key/values, and the plan holding them, keep a few bytes per token."""
    import gguf

    from .tokenizer_json import SlimFolder, load

    keys = gguf.Keys.Tokenizer
    loaded = None
    if source_files.present(root / "tokenizer.model"):
        tokens, scores, types = sentencepiece_vocab(root, vocab_size)
        found: tuple[Any, ...] | None = (tokens, scores, types)
    else:
        loaded = load(root / "tokenizer.json")
        if loaded is None:
            raise PlanError(f"Cannot write GGUF for {root}: it has neither tokenizer.model nor tokenizer.json. Copy the model's "
                            "tokenizer files into the folder.")
        found = _llama_hf_vocab(root, loaded.document) if arch == "llama" else None
    if found is not None:
        tokens, scores, types = found
        count = len(tokens)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        add_packed(writer, keys.LIST, packed.strings(tokens))
        add_packed(writer, keys.SCORES, packed.float32s(scores))
        add_packed(writer, keys.TOKEN_TYPE, packed.int32s(types))
        del found, tokens, scores, types
        with outside_reader(root) if loaded is None else SlimFolder(loaded) as folder:
            special_vocab = _special_vocab(root, folder, n_vocab=count)
        special_vocab.add_to_gguf(writer)
        return count
    assert loaded is not None
    document = loaded.document
    pre = pre_tokenizer_name(root, document)
    with SlimFolder(loaded) as folder:  # without merges in tokenizer.json, SpecialVocab reads merges.txt as the converter does
        special = _special_vocab(root, folder, load_merges=loaded.merges is None)
    flags = _with_byte_level_flags(root, special.add_special_token, document)
    found_bpe = bpe_vocab.read(root, vocab_size, _looks_special, document)  # without transformers (and torch)
    tokens, types = found_bpe if found_bpe is not None else gpt2_vocab(root, vocab_size)
    count = len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    add_packed(writer, keys.LIST, packed.strings(tokens))
    add_packed(writer, keys.TOKEN_TYPE, packed.int32s(types))
    del found_bpe, tokens, types
    if loaded.merges is not None:
        add_packed(writer, keys.MERGES, loaded.merges)  # where SpecialVocab.add_to_gguf puts them: before the special ids
    special.add_special_token = flags
    special.add_to_gguf(writer)
    return count


def _special_vocab(root: Path, folder: Path, **options: Any) -> Any:
    """`gguf.SpecialVocab` of a staged `folder` (special token ids, add-BOS/EOS flags, chat template, merges.txt), its
    failures on malformed files refused naming `root`'s tokenizer files."""
    import gguf

    try:
        return gguf.SpecialVocab(folder, **options)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError, RecursionError) as exc:
        raise PlanError(f"Cannot read the tokenizer files of {root} (tokenizer.json, tokenizer_config.json, config.json ...): "
                        f"they are not shaped as a tokenizer's ({type(exc).__name__}: {str(exc)[:200]}). Copy the model's own "
                        "tokenizer files into the folder.", file=str(root)) from None


def _with_byte_level_flags(root: Path, flags: dict[str, bool], tokenizer: Any = None) -> dict[str, bool]:
    """llama.cpp's gguf-py (newer than PyPI's 0.19.0) reads a ByteLevel post-processor as adding neither BOS nor EOS
    unless a later step says otherwise; the flags in the order it records them (a ByteLevel step first: bos, eos)."""
    found = json_file(root / "tokenizer.json") if tokenizer is None else tokenizer
    post = (found if isinstance(found, dict) else {}).get("post_processor") or {}
    kinds = [step.get("type") for step in post.get("processors", [post])]
    if "ByteLevel" not in kinds:
        return flags
    templates = [k for k, kind in enumerate(kinds) if kind in ("TemplateProcessing", "RobertaProcessing")]
    if templates and templates[0] < kinds.index("ByteLevel"):
        return {**flags, "bos": flags.get("bos", False), "eos": flags.get("eos", False)}
    return {"bos": flags.get("bos", False), "eos": flags.get("eos", False), **flags}


__all__ = ["PRE_TOKENIZERS", "add_vocab", "gpt2_vocab", "pre_tokenizer_name", "sentencepiece_pieces", "sentencepiece_vocab"]
