"""A byte-level BPE `tokenizer.json` (GPT-2, Llama 3, Qwen2/3) listed for GGUF without transformers.

llama.cpp's converter lists such a vocabulary through transformers' tokenizer (which imports torch): every id below
the vocabulary size with its token text, `[PADk]` for ids nobody holds; added tokens typed CONTROL (special, or
looking like a control token) or USER_DEFINED, and an added token that is not `normalized` replaced by what the
tokenizer decodes from encoding it. The texts and flags are in the JSON files; the round trip is the `tokenizers`
library's (the Rust tokenizer transformers wraps). A tokenizer_config.json asking to clean up tokenization spaces
after decoding returns None here: the caller then goes through transformers.

tokenizer.json is read once by the caller (`tokenizer_json`, merges packed on the way) and handed in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import PlanError
from . import tokenizer_json
from .tokenizer_json import json_file

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # gguf.TokenType values


def read(root: Path, vocab_size: int | None, looks_special: Any, tokenizer: Any = None) -> tuple[list[str], list[int]] | None:
    """(tokens, types) as the converter lists them for `root`'s byte-level BPE; None when transformers is needed.
    `looks_special(text)`: llama.cpp's test for added tokens that are control tokens though not marked special;
    `tokenizer`: tokenizer.json's document already read (`tokenizer_json.load`), read here otherwise."""
    if tokenizer is None:
        loaded = tokenizer_json.load(root / "tokenizer.json")
        tokenizer = loaded.document if loaded is not None else None
    config = json_file(root / "tokenizer_config.json") or {}
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
            text, kind = added_token(text, special, normalized, roundtrip, looks_special)
        else:
            kind = NORMAL
        tokens.append(text)
        types.append(kind)
    return tokens, types


def added_token(text: str, special: bool, normalized: bool, normalize: Any, looks_special: Any) -> tuple[str, int]:
    """An added token's text and type as llama.cpp's converter writes them: pre-normalised by `normalize(text)` when the
    tokenizer does not normalise it, CONTROL when special or `looks_special(text)`, else USER_DEFINED with SentencePiece's
    word marker turned back into a space. Shared by both vocabulary routes (JSON files, transformers)."""
    if not normalized:
        text = normalize(text)
    if special or looks_special(text):
        return text, CONTROL
    return text.replace("\u2581", " "), USER_DEFINED


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


__all__ = ["read"]
