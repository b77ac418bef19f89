"""A byte-level BPE `tokenizer.json` (GPT-2, Llama 3, Qwen2/3) listed for GGUF without transformers.

llama.cpp's converter lists such a vocabulary through transformers' tokenizer (which imports torch): every id below
the vocabulary size with its token text, `[PADk]` for ids nobody holds; added tokens typed CONTROL (special, or
looking like a control token) or USER_DEFINED, and an added token that is not `normalized` replaced by what the
tokenizer decodes from encoding it. The texts and flags are in the JSON files; the round trip is the `tokenizers`
library's (the Rust tokenizer transformers wraps). A tokenizer_config.json asking to clean up tokenization spaces
after decoding returns None here: the caller then goes through transformers.

The file is parsed once (`load`) for the token list, the merges and the pre- and post-processor the caller reads,
and the merges are packed straight into their GGUF bytes (`merges`), as the `gguf` package's `SpecialVocab` lists
them: a parsed 128k-token tokenizer.json is ~100 MiB of Python objects, so it is never held twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .gguf_packed import PackedArray, strings

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType values


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise PlanError(f"Cannot read {path}: {exc}. Fix the file.") from None


def load(root: Path) -> Any:
    """`root/tokenizer.json` parsed (None when there is none); PlanError when it is not JSON."""
    return _json(root / "tokenizer.json")


def merges(root: Path, tokenizer: Any) -> PackedArray | None:
    """The merges of a parsed tokenizer.json as the GGUF string array `gguf.SpecialVocab` makes of them: "a b"
    strings kept, [a, b] pairs (transformers >= 4.45) joined by a space with spaces inside encoded as U+0120;
    None when the file has none (the converter then reads merges.txt)."""
    found = ((tokenizer or {}).get("model") or {}).get("merges") if isinstance(tokenizer, dict) else None
    if not isinstance(found, list) or not found:
        return None
    if isinstance(found[0], str):
        return strings(found)
    if isinstance(found[0], list) and len(found[0]) == 2 and isinstance(found[0][0], str):
        return strings(" ".join(part.replace(" ", "\u0120") for part in pair) for pair in found)
    raise PlanError(f"Cannot read {root / 'tokenizer.json'}: its merges are neither \"a b\" strings nor [a, b] pairs. "
                    "Fix the file.")


def read(root: Path, vocab_size: int | None, looks_special: Any, tokenizer: Any = None) -> tuple[list[str], list[int]] | None:
    """(tokens, types) as the converter lists them for `root`'s byte-level BPE; None when transformers is needed.
    `looks_special(text)`: llama.cpp's test for added tokens that are control tokens though not marked special;
    `tokenizer`: tokenizer.json already parsed (`load`), read here otherwise."""
    if tokenizer is None:
        tokenizer = load(root)
    config = _json(root / "tokenizer_config.json") or {}
    if not isinstance(tokenizer, dict) or (tokenizer.get("model") or {}).get("type") != "BPE" or config.get("clean_up_tokenization_spaces"):
        return None
    added: dict[int, tuple[str, bool, bool]] = {}  # id -> (content, special, normalized)
    for entry in tokenizer.get("added_tokens") or []:
        added[int(entry["id"])] = (entry["content"], bool(entry.get("special")), bool(entry.get("normalized", not entry.get("special"))))
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        added[int(key)] = (entry["content"], bool(entry.get("special")), bool(entry.get("normalized", not entry.get("special"))))
    vocab = {**tokenizer["model"].get("vocab", {}), **{text: k for k, (text, _, _) in added.items()}}
    size = vocab_size or len(vocab)
    if vocab and max(vocab.values()) >= size:
        raise PlanError(f"Cannot write GGUF for {root}: its tokenizer has token id {max(vocab.values())}, beyond vocab_size "
                        f"{size} in config.json. Fix the config or the tokenizer.")
    by_id = {k: text for text, k in vocab.items()}
    added_texts = {text for text, _, _ in added.values()}
    roundtrip = _round_trip(root, tokenizer) if any(not normalized for _, _, normalized in added.values()) else None
    tokens, types = [], []
    for k in range(size):
        if k not in by_id:
            tokens.append(f"[PAD{k}]")
            types.append(UNUSED)
            continue
        text = by_id[k]
        if text in added_texts and k in added:
            _, special, normalized = added[k]
            if not normalized:  # llama.cpp expects added tokens pre-normalised
                text = roundtrip(text)
            if special or looks_special(text):
                types.append(CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(text)
    return tokens, types


def _round_trip(root: Path, tokenizer: dict) -> Any:
    """text -> the tokenizer's decoding of its encoding (no special tokens added), by the `tokenizers` library.

    Only added tokens go through it: an added token's text splits off as that token before the model sees anything,
    so a tokenizer built from the same JSON with an empty vocabulary and no merges gives the same round trip
    (the full one holds ~100 MB more for a 128k vocabulary)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PlanError(f"Cannot write GGUF for {root}: reading its byte-level BPE tokenizer needs the `tokenizers` package. "
                        "Install it: pip install tokenizers.") from None
    model = {**tokenizer["model"], "vocab": {}, "merges": []}
    try:
        small = Tokenizer.from_str(json.dumps({**tokenizer, "model": model}))
    except Exception as exc:  # the tokenizers library's own errors name no common base class
        raise PlanError(f"Cannot read {root / 'tokenizer.json'} with the tokenizers library: {exc}. Fix the file.") from None
    return lambda text: small.decode(small.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)


__all__ = ["load", "merges", "read"]
