"""A `tokenizer.json` read for GGUF in a fraction of the memory `json.load` takes.

A Llama 3 tokenizer.json (17 MB: 128k tokens, 280k merges) parsed whole is ~130 MiB of Python objects: the text,
the vocabulary, and for the merges 560k strings in 280k lists, which GGUF only needs as one array of "a b"
strings. Here the document is walked with the `json` module's own scanner (same strings, numbers, duplicate-key
rule), the merges are packed one by one into their GGUF bytes as they are met (`gguf.SpecialVocab`'s rules:
strings kept, [a, b] pairs joined by a space, a space inside encoded as U+0120), and everything else is kept as
`json.loads` would give it. `SlimFolder` writes the document without vocabulary and merges into a temporary
folder beside links to the other tokenizer files, for readers (`gguf.SpecialVocab`) that only need the rest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from json.decoder import scanstring
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .gguf_packed import PackedArray, strings

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_GLYPH_SPACE = "\u0120"  # how SpecialVocab encodes a space inside a merge part


def json_file(path: Path) -> Any:
    """A tokenizer folder's small JSON file (tokenizer_config.json, added_tokens.json ...) as data, None when it is
    absent; a file that cannot be read or parsed is refused naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise PlanError(f"Cannot read {path}: {exc}. Fix the file.") from None


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
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")  # from bytes: ~30 MiB less at the peak than read_text for a 17 MB file
        del data
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"Cannot read {path}: {exc}. Fix the file.") from None
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
    except ValueError as exc:
        raise PlanError(f"Cannot read {path}: {exc}. Fix the file.") from None
    del text
    if not isinstance(document, dict):
        raise PlanError(f"Cannot read {path}: it holds {type(document).__name__}, not a tokenizer object. Fix the file.")
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
    """A temporary folder holding links to every file beside `tokenizer.path` and, as tokenizer.json, the document
    without its vocabulary and merges; a context manager giving the folder (or the original one when links cannot
    be made here)."""

    def __init__(self, tokenizer: TokenizerJson) -> None:
        self.tokenizer = tokenizer
        self.folder: str | None = None

    def __enter__(self) -> Path:
        root = self.tokenizer.path.parent
        document = self.tokenizer.document
        model = document.get("model")
        slim = {**document, "model": {**model, "vocab": {}, "merges": []}} if isinstance(model, dict) else document
        self.folder = tempfile.mkdtemp(prefix="workbench-tokenizer-")
        try:
            for entry in os.listdir(root):
                if entry != self.tokenizer.path.name:
                    os.symlink(root / entry, os.path.join(self.folder, entry))
        except OSError:  # no symlinks on this file system: read the original folder
            return root
        with open(os.path.join(self.folder, self.tokenizer.path.name), "w", encoding="utf-8") as fh:
            json.dump(slim, fh)
        return Path(self.folder)

    def __exit__(self, *exc: object) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


__all__ = ["SlimFolder", "TokenizerJson", "give_back_freed_heap", "load"]
