"""A byte-fallback BPE `tokenizer.json` (Llama / Mistral style) listed for GGUF without transformers.

llama.cpp's converter reads such a tokenizer through the `gguf` package's `LlamaHfVocab`, which loads it with
transformers' `AutoTokenizer` (and transformers imports torch: ~400 MiB for a list of strings). The list depends
only on the JSON files, so it is read from them here, by the same rules:

- base tokens: `model.vocab` of tokenizer.json, in id order (ids below its size), each scored -1000 and typed
  BYTE (`<0xNN>`), CONTROL (a special token's id) or NORMAL;
- then the added tokens (tokenizer.json's `added_tokens` and tokenizer_config.json's `added_tokens_decoder`)
  whose ids lie beyond the base vocabulary, in id order: CONTROL when special, else USER_DEFINED;
- special tokens are transformers' `all_special_tokens`: the named ones (bos, eos, unk, sep, pad, cls, mask)
  from tokenizer_config.json (and special_tokens_map.json when the config has no `added_tokens_decoder`),
  the tokenizer class's defaults for names it leaves out, and `extra_special_tokens` /
  `additional_special_tokens`.

Only the Llama tokenizer classes' defaults are known here (`<unk>`, `<s>`, `</s>`); for another class that
leaves a name out, `read` returns None and the caller goes through transformers as the converter does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...errors import PlanError
from .tokenizer_json import json_file

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CLASS_DEFAULTS = {"LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
                  "PreTrainedTokenizerFast": {}, "TokenizersBackend": {}}
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # gguf.TokenType values
SCORE = -1000.0
_BYTE = re.compile(rb"<0x[0-9A-Fa-f]{2}>")


def _text(value: Any) -> str | None:
    """A special token as a string (configs hold strings or serialised AddedToken dicts)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def is_byte_fallback_bpe(tokenizer: dict) -> bool:
    """True for the tokenizers `gguf.LlamaHfVocab` accepts: a byte-fallback BPE with a Sequence decoder (not Llama 3's)."""
    model = tokenizer.get("model") or {}
    llama3 = model.get("type") == "BPE" and model.get("ignore_merges", False) and not model.get("byte_fallback", True)
    return (not llama3 and model.get("type") == "BPE" and bool(model.get("byte_fallback", False))
            and (tokenizer.get("decoder") or {}).get("type") == "Sequence")


def special_tokens(root: Path, config: dict) -> list[str] | None:
    """transformers' `all_special_tokens` for `root`; None when the tokenizer class's defaults are not known here."""
    values = {key: config[key] for key in NAMED if key in config}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = list(extra) if isinstance(extra, (list, dict)) else []
    if "added_tokens_decoder" not in config:  # transformers then reads the legacy special_tokens_map.json over the config
        legacy = json_file(root / "special_tokens_map.json") or {}
        for key, value in legacy.items():
            if key in NAMED:
                values[key] = value
            elif key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                extra += [t for t in value if t not in extra]
    missing = [key for key in NAMED if key not in values]
    if missing:
        kind = str(config.get("tokenizer_class") or "PreTrainedTokenizerFast").removesuffix("Fast")
        kind = kind if kind in CLASS_DEFAULTS else kind + "Fast" if kind + "Fast" in CLASS_DEFAULTS else None
        if kind is None:
            return None
        for key in missing:
            values[key] = CLASS_DEFAULTS[kind].get(key)
    found: list[str] = []
    for value in [values[key] for key in NAMED] + (extra if isinstance(extra, list) else []):
        text = _text(value)
        if text is not None and text not in found:
            found.append(text)
    return found


def read(root: Path, tokenizer: Any = None) -> tuple[list[bytes], list[float], list[int]] | None:
    """(tokens, scores, types) as `gguf.LlamaHfVocab(root).all_tokens()` lists them; None when `root` holds no
    byte-fallback BPE tokenizer.json (the converter goes on to other routes) or its special tokens need transformers.
    `tokenizer`: tokenizer.json's document already read, read here otherwise."""
    if tokenizer is None:
        tokenizer = json_file(root / "tokenizer.json")
    if not isinstance(tokenizer, dict) or not is_byte_fallback_bpe(tokenizer):
        return None
    config = json_file(root / "tokenizer_config.json") or {}
    specials = special_tokens(root, config)
    if specials is None:
        return None
    vocab: dict[str, int] = dict(tokenizer["model"].get("vocab") or {})
    base = len(vocab)
    added: dict[int, tuple[str, bool]] = {}
    for entry in tokenizer.get("added_tokens") or []:
        added[int(entry["id"])] = (entry["content"], bool(entry.get("special")))
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        added.setdefault(int(key), (entry["content"], bool(entry.get("special"))))
    everything = {**vocab, **{text: k for k, (text, _) in added.items()}}
    by_id = {k: text for text, k in everything.items()}
    unk = _text(config.get("unk_token"))
    special_ids = {everything.get(t, everything.get(unk or "", -1)) for t in specials}
    beyond = sorted(k for k in added if k >= base)
    tokens, scores, types = [], [], []
    for k in range(base):
        if k not in by_id:
            raise PlanError(f"Cannot read {root / 'tokenizer.json'}: token id {k} is missing from its vocabulary. Fix the file.")
        text = by_id[k].encode("utf-8")
        tokens.append(text)
        scores.append(SCORE)
        types.append(BYTE if _BYTE.fullmatch(text) else CONTROL if k in special_ids else NORMAL)
    for k in beyond:
        text = added[k][0]
        tokens.append(text.encode("utf-8"))
        scores.append(SCORE)
        types.append(CONTROL if text in specials else USER_DEFINED)
    return tokens, scores, types


__all__ = ["is_byte_fallback_bpe", "read", "special_tokens"]
