"""A `tokenizer.json` read for GGUF in a fraction of the memory `json.load` takes.

A Llama 3 tokenizer.json (17 MB: 128k tokens, 280k merges) parsed whole is ~130 MiB of Python objects: the text,
the vocabulary, and for the merges 560k strings in 280k lists, which GGUF only needs as one array of "a b"
strings. Here the document is walked with the `json` module's own scanner (same strings, numbers, duplicate-key
rule), the merges are packed one by one into their GGUF bytes as they are met (`gguf.SpecialVocab`'s rules:
strings kept, [a, b] pairs joined by a space, a space inside encoded as U+0120), and everything else is kept as
`json.loads` would give it. `SlimFolder` stages the document without vocabulary and merges in a temporary folder
beside copies of the other tokenizer files (`source_files.staged`), for readers (`gguf.SpecialVocab`) that only
need the rest. Every file is read by `source_files`' rule (no link out of the folder, bounded size and nesting),
and the parts of the document the workbench indexes are checked for their JSON types (`check_tokenizer`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from json.decoder import scanstring
from pathlib import Path
from typing import Any

from ...errors import PlanError
from .. import source_files
from ..config_values import MAX_VOCAB
from .packed import PackedArray, strings

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_GLYPH_SPACE = "\u0120"  # how SpecialVocab encodes a space inside a merge part


def json_file(path: Path) -> Any:
    """A tokenizer folder's small JSON file (tokenizer_config.json, added_tokens.json ...) as data, None when it is
    absent; a file that cannot be read or parsed, or is linked out of the folder, is refused naming it
    (`source_files.read_json`). tokenizer_config.json's `added_tokens_decoder` is checked as `check_tokenizer` says."""
    found = source_files.read_json(path)
    if path.name == "tokenizer_config.json" and found is not None:
        if not isinstance(found, dict):
            raise _bad(path, "", found, "an object")
        _check_entries(path, "added_tokens_decoder", found.get("added_tokens_decoder"), keyed=True)
    elif path.name == "added_tokens.json" and found is not None and (not isinstance(found, dict) or not all(_is_id(k) for k in found.values())):
        raise _bad(path, "", found, "an object of token -> id")
    return found


def _bad(path: Path, key: str, value: Any, wanted: str) -> PlanError:
    shown = type(value).__name__ if isinstance(value, (dict, list)) else repr(value)[:40]
    where = f"{key} is {shown}" if key else f"it holds {shown}"
    return PlanError(f"Cannot read {path}: {where}, not {wanted}. Use the model's own tokenizer files.", file=str(path))


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_VOCAB


def _check_entries(path: Path, key: str, entries: Any, *, keyed: bool) -> None:
    """tokenizer.json's `added_tokens` (a list of {id, content}) or tokenizer_config.json's `added_tokens_decoder`
    (`keyed`: an object id -> {content}), checked for the types the vocabulary readers use."""
    if entries is None:
        return
    items = entries.items() if keyed and isinstance(entries, dict) else enumerate(entries) if not keyed and isinstance(entries, list) else None
    if items is None:
        raise _bad(path, key, entries, "an object of id -> token" if keyed else "a list of tokens")
    for at, entry in items:
        ident = (int(at) if isinstance(at, str) and at.isdecimal() and len(at) < 12 else None) if keyed else (entry.get("id") if isinstance(entry, dict) else None)
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not _is_id(ident):
            raise _bad(path, f"{key}[{at!r}]", entry, f"a token with a content string and an id below {MAX_VOCAB}")


def check_tokenizer(path: Path, document: dict[str, Any]) -> None:
    """The parts of tokenizer.json's `document` the workbench indexes, checked for their JSON types (PlanError naming
    the file and key otherwise): `model` an object, its `vocab` an object token -> id for BPE / WordPiece /
    WordLevel models, `added_tokens` a list of {id, content}, the pipeline steps objects."""
    model = document.get("model")
    if model is not None and not isinstance(model, dict):
        raise _bad(path, "model", model, "an object")
    model = model or {}
    if model.get("type") in ("BPE", "WordPiece", "WordLevel") or "type" not in model:
        vocab = model.get("vocab")
        if vocab is not None and (not isinstance(vocab, dict) or not all(_is_id(k) for k in vocab.values())):
            raise _bad(path, "model.vocab", vocab, f"an object of token -> id (ids below {MAX_VOCAB})")
    _check_entries(path, "added_tokens", document.get("added_tokens"), keyed=False)
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        step = document.get(key)
        if step is not None and not isinstance(step, dict):
            raise _bad(path, key, step, "an object")
        for part in ("pretokenizers", "processors", "decoders", "normalizers"):
            inner = (step or {}).get(part)
            if inner is not None and (not isinstance(inner, list) or not all(isinstance(x, dict) for x in inner)):
                raise _bad(path, f"{key}.{part}", inner, "a list of objects")
    pre = document.get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers") or [pre]:
        if not isinstance(step.get("pattern", {}), dict):
            raise _bad(path, "pre_tokenizer.pattern", step.get("pattern"), "an object")


@dataclass
class TokenizerJson:
    """A parsed tokenizer.json: `document` as json.loads gives it but for `model.merges` (an empty list),
    and `merges` packed (None when the file has none)."""

    path: Path
    document: dict[str, Any]
    merges: PackedArray | None


def _skip(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


def _expect(text: str, at: int, char: str) -> int:
    if text[at:at + 1] != char:
        raise ValueError(f"expected {char!r} at character {at}")
    return at + 1


def _object(text: str, at: int, handlers: dict[str, Callable[[str, int], tuple[Any, int]]]) -> tuple[dict, int]:
    """The object starting at `text[at]` ('{'); keys in `handlers` are read by them, other values by the scanner."""
    out: dict[str, Any] = {}
    at = _skip(text, _expect(text, at, "{"))
    if text[at:at + 1] == "}":
        return out, at + 1
    while True:
        key, at = scanstring(text, _expect(text, at, '"'))
        at = _skip(text, _expect(text, _skip(text, at), ":"))
        handler = handlers.get(key)
        out[key], at = handler(text, at) if handler is not None else _DECODER.raw_decode(text, at)
        at = _skip(text, at)
        if text[at:at + 1] == "}":
            return out, at + 1
        at = _skip(text, _expect(text, at, ","))


def _merges(text: str, at: int) -> tuple[PackedArray, int]:
    """The merges array at `text[at]` packed as GGUF strings, each merge decoded and packed on its own."""
    end = [at]

    def items() -> Iterator[str]:
        pos = _skip(text, _expect(text, at, "["))
        pairs = None
        while text[pos:pos + 1] != "]":
            item, pos = _DECODER.raw_decode(text, pos)
            pairs = isinstance(item, list) if pairs is None else pairs
            if pairs and isinstance(item, list) and all(isinstance(part, str) for part in item):
                yield " ".join(part.replace(" ", _GLYPH_SPACE) for part in item)
            elif not pairs and isinstance(item, str):
                yield item
            else:
                raise ValueError("its merges are neither all \"a b\" strings nor all [a, b] pairs")
            pos = _skip(text, pos)
            if text[pos:pos + 1] != "]":
                pos = _skip(text, _expect(text, pos, ","))
        end[0] = pos + 1

    packed = strings(items())
    return packed, end[0]


def load(path: Path) -> TokenizerJson | None:
    """`path` (a tokenizer.json) read as the module docstring says; None when it does not exist."""
    text = source_files.read_text(path)  # decoded from bytes: ~30 MiB less at the peak than read_text for a 17 MB file
    if text is None:
        return None
    packed: list[PackedArray] = []

    def merges(text: str, at: int) -> tuple[Any, int]:
        if text[at:at + 1] != "[":  # not a list: no merges, as SpecialVocab reads it
            return _DECODER.raw_decode(text, at)
        found, end = _merges(text, at)
        packed.append(found)
        return [], end

    def model(text: str, at: int) -> tuple[Any, int]:
        return _object(text, at, {"merges": merges}) if text[at:at + 1] == "{" else _DECODER.raw_decode(text, at)

    try:
        at = _skip(text, 0)
        document, at = _object(text, at, {"model": model}) if text[at:at + 1] == "{" else _DECODER.raw_decode(text, at)
        if _skip(text, at) != len(text):
            raise ValueError(f"extra data at character {_skip(text, at)}")
    except RecursionError:
        raise PlanError(f"Cannot read {path}: its JSON nests more than {source_files.MAX_DEPTH} levels deep. Replace it by "
                        "the model's own file.", file=str(path)) from None
    except ValueError as exc:
        raise PlanError(f"Cannot read {path}: {exc}. Fix the file.", file=str(path)) from None
    del text
    if not isinstance(document, dict):
        raise PlanError(f"Cannot read {path}: it holds {type(document).__name__}, not a tokenizer object. Fix the file.", file=str(path))
    source_files.check_depth(document, path)
    check_tokenizer(path, document)
    return TokenizerJson(path, document, packed[-1] if packed and packed[-1].count else None)


def give_back_freed_heap() -> None:
    """Return the heap freed by a tokenizer read to the system (glibc's malloc_trim; nothing elsewhere).

    The text and the parsed objects of a large tokenizer.json leave tens of MiB of free heap that glibc keeps
    (its mmap threshold rises after large frees, so later big blocks come from the heap): a conversion would
    carry them, resident, for its whole run."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return


class SlimFolder:
    """A context manager giving a temporary folder (`source_files.staged`) holding copies of the tokenizer's folder's
    files and, as tokenizer.json, the document without its vocabulary and merges. Copies, not links: a reader of the
    folder then sees only what the source-file rule let through, whatever the source path (a relative link would
    lead nowhere from the temporary folder)."""

    def __init__(self, tokenizer: TokenizerJson) -> None:
        self.tokenizer = tokenizer
        self._staged: Any = None

    def __enter__(self) -> Path:
        document = self.tokenizer.document
        model = document.get("model")
        slim = {**document, "model": {**model, "vocab": {}, "merges": []}} if isinstance(model, dict) else document
        self._staged = source_files.staged(self.tokenizer.path.parent, replace={"tokenizer.json": json.dumps(slim).encode()})
        return self._staged.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._staged is not None:
            self._staged.__exit__(*exc)


__all__ = ["SlimFolder", "TokenizerJson", "check_tokenizer", "give_back_freed_heap", "json_file", "load"]
