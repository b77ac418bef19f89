"""`OutputFile`: a statement that the output gets a file other than the primary source's copy (or none at all).

A merge that builds a new vocabulary (mergekit's `tokenizer_source: union`, a model as the tokenizer source) or
sets a chat template writes tokenizer files that no source has as they are: the union's tokenizer.json is the base
model's with the new tokens added, chat_template.jinja holds the config's template. Like `ConfigUpdate`, such a
statement is a leaf of the mapper that reads and writes no tensor; it travels with the mapper (to_code, JSON) and
the planner carries it (`planning.extras.with_output_files`): the file is listed as generated, with `why`, and the
extras step writes it instead of the copy. The content is one of

- `text`: the file's text;
- `source`: a local file whose bytes the file gets (a tokenizer file of a model that is not the primary source),
  with `added` (JSON texts of tokenizer.json `added_tokens` entries) added to its added tokens when given, and with
  `keep_below` (when > 0) its tokens of id `keep_below` and above removed first — from the model's vocabulary, the
  added tokens and the BPE merges that use one of them (mergekit strips a tokenizer so beyond config.json's
  vocab_size);
- neither: the file is not written (a copied file the new ones would contradict), listed as skipped with `why`.

The tokenizer.json edit is stated, not its text, so a 10 MB tokenizer does not travel inside the mapper.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MapperError
from .base import Mapper, NoTensorLeaf

MAX_SOURCE_BYTES = 256 << 20  # a tokenizer file is at most tens of MB


@dataclass(frozen=True, repr=False)
class OutputFile(NoTensorLeaf):
    """The output's top-level file `path` (see the module docstring for `text`, `source` and `added`)."""

    path: str
    text: str | None = None
    source: str = ""
    added: tuple[str, ...] = ()
    why: str = ""
    keep_below: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path or "/" in self.path or "\\" in self.path or self.path.startswith("."):
            raise MapperError(f"Cannot build OutputFile: path must be a plain file name such as 'tokenizer.json' (got {self.path!r}).")
        if self.text is not None and (not isinstance(self.text, str) or self.source):
            raise MapperError(f"Cannot build OutputFile {self.path!r}: give text (a string) or source, not both.")
        if not isinstance(self.source, str) or not isinstance(self.why, str):
            raise MapperError(f"Cannot build OutputFile {self.path!r}: source and why must be strings.")
        added = tuple(self.added)
        for entry in added:
            try:
                value = json.loads(entry) if isinstance(entry, str) else None
            except ValueError:
                value = None
            if not isinstance(value, dict) or not isinstance(value.get("id"), int) or not isinstance(value.get("content"), str):
                raise MapperError(f"Cannot build OutputFile {self.path!r}: each added token is the JSON text of an object "
                                  f"with 'id' and 'content' (got {str(entry)[:80]!r}).")
        if added and not self.source:
            raise MapperError(f"Cannot build OutputFile {self.path!r}: added tokens need the source tokenizer.json they are added to.")
        if isinstance(self.keep_below, bool) or not isinstance(self.keep_below, int) or self.keep_below < 0 \
                or (self.keep_below and not self.source):
            raise MapperError(f"Cannot build OutputFile {self.path!r}: keep_below is a token count (got {self.keep_below!r}) "
                              "of a source tokenizer.json.")
        object.__setattr__(self, "added", added)

    @property
    def written(self) -> bool:
        """True when the output gets this file (False: the statement leaves it out)."""
        return self.text is not None or bool(self.source)

    def content(self) -> bytes:
        """The file's bytes (MapperError when the source cannot be read or is not a tokenizer JSON to add to)."""
        if self.text is not None:
            return self.text.encode("utf-8")
        if not self.source:
            raise MapperError(f"Cannot write {self.path!r}: the mapper leaves it out of the output.")
        path = Path(self.source)
        try:
            if path.stat().st_size > MAX_SOURCE_BYTES:
                raise MapperError(f"Cannot write {self.path!r}: its source {path} is larger than {MAX_SOURCE_BYTES} bytes.")
            raw = path.read_bytes()
        except OSError as exc:
            raise MapperError(f"Cannot write {self.path!r}: its source {path} cannot be read ({exc.strerror or exc}). "
                              "Check that the model folder is still there.") from None
        if not self.added and not self.keep_below:
            return raw
        try:
            data = json.loads(raw)
            tokens = list(data.get("added_tokens") or [])
            if self.keep_below:
                tokens = _strip(data, tokens, self.keep_below)
        except (ValueError, AttributeError, TypeError, KeyError):
            raise MapperError(f"Cannot write {self.path!r}: its source {path} is not a tokenizer.json (JSON with "
                              "added_tokens and a model vocabulary).") from None
        tokens += [json.loads(entry) for entry in self.added]
        data["added_tokens"] = sorted(tokens, key=lambda t: t.get("id", 0) if isinstance(t, dict) else 0)
        return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _strip(data: dict, tokens: list, below: int) -> list:
    """Remove from the tokenizer.json `data` every token of id `below` or more (model vocabulary, BPE merges using
    one) and return its added tokens without them."""
    model = data["model"]
    vocab = model["vocab"]
    unused = {str(t) for t, i in vocab.items() if int(i) >= below} | {str(t["content"]) for t in tokens if int(t["id"]) >= below}
    model["vocab"] = {t: i for t, i in vocab.items() if t not in unused}
    if isinstance(model.get("merges"), list):
        model["merges"] = [m for m in model["merges"]
                           if not set(m.split(" ") if isinstance(m, str) else m) & unused]
    return [t for t in tokens if int(t["id"]) < below]


def output_files(mapper: Any) -> tuple[list[OutputFile], list[str]]:
    """(every OutputFile leaf of `mapper`, conflicts): two statements about one path that differ are a conflict."""
    if not isinstance(mapper, Mapper):
        return [], []
    found: dict[str, OutputFile] = {}
    conflicts: list[str] = []
    for leaf in mapper.leaves():
        if not isinstance(leaf, OutputFile):
            continue
        if leaf.path in found and found[leaf.path] != leaf:
            conflicts.append(f"Cannot write {leaf.path!r}: the mapper states two different contents for it. Keep one "
                             "OutputFile per file.")
            continue
        found[leaf.path] = leaf
    return list(found.values()), conflicts
