"""The small files the GGUF and Meta `.pth` writers read from a source folder, read one checked way.

config.json, generation_config.json, the tokenizer files (tokenizer.json, tokenizer.model, tokenizer_config.json,
special_tokens_map.json, added_tokens.json, vocab.json, merges.txt, chat templates) and the model card come with an
untrusted checkpoint. Every read of them goes through `read_bytes` / `read_json`, which apply the rule extras
follow (`formats.links`): a file linked outside the folder (or outside a Hub cache snapshot's `blobs/`) is refused,
never read; so is anything that is not a regular file, a file above its size bound, JSON nested deeper than
`MAX_DEPTH`, and bytes that are not UTF-8 JSON. Refusals are `PlanError`s naming the file and what to do.

Size bounds (the largest real files are far below them): `TOKENIZER_LIMIT` = 128 MiB for the tokenizer's own
files (a 256k-token tokenizer.json with its merges is ~35 MB; tokenizer_config.json may carry every added
token), `CONFIG_LIMIT` = 16 MiB for everything else (a config.json is a few KB).

Readers outside the workbench (the `gguf` package's `SpecialVocab` and `Metadata`, transformers' tokenizer)
open files themselves, so they are given `staged(...)`: a temporary folder of *copies* made by these reads,
never links into the source (a link would be followed again by them, and a relative one would point nowhere).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..formats.links import leads_inside

MiB = 1 << 20
TOKENIZER_LIMIT = 128 * MiB
CONFIG_LIMIT = 16 * MiB
MAX_DEPTH = 64  # JSON nesting: real configs and tokenizers nest fewer than 10 levels
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt")
# What the gguf package and transformers read from a model folder to list a vocabulary, its special tokens and
# chat template, and the model card's names: the files a staged folder holds (when the source has them).
STAGED_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "vocab.json", "merges.txt", "config.json", "generation_config.json", "chat_template.json", "chat_template.jinja",
                "README.md")
CHAT_TEMPLATES = "additional_chat_templates"


def limit_of(name: str) -> int:
    """The size bound of source file `name` (see the module docstring)."""
    return TOKENIZER_LIMIT if name in TOKENIZER_FILES else CONFIG_LIMIT


def _refuse(path: Path, cause: str, fix: str) -> PlanError:
    return PlanError(f"Cannot read {path}: {cause}. {fix}.", file=str(path))


def present(path: Path) -> bool:
    """True when `path` names something in its folder (a file, a link, anything): the writers then read it through
    `read_bytes`, which refuses what may not be read, rather than silently doing without it."""
    return os.path.lexists(path)


def read_bytes(path: Path, limit: int | None = None) -> bytes | None:
    """The bytes of `path`, a file directly in the source folder `path.parent`; None when it does not exist.

    Refused (PlanError): a link leading outside the folder, not a regular file, more than `limit` bytes (by
    default `limit_of(path.name)`), unreadable. The file is read through one descriptor and at most `limit` + 1
    bytes are taken, so a file that grows while read cannot go past the bound."""
    path = Path(path)
    limit = limit_of(path.name) if limit is None else limit
    if not os.path.lexists(path):
        return None
    if not leads_inside(path.parent, path):
        raise _refuse(path, f"it is a link to {os.path.realpath(path)}, outside the source folder",
                      "Replace the link by the file itself (a source folder's files are read only from inside it)")
    try:
        # O_NONBLOCK: opening a FIFO planted under a tokenizer's name must not wait for a writer
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)), "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise _refuse(path, "it is not a regular file", "Replace it by the model's own file")
            if info.st_size > limit:
                raise _refuse(path, f"it holds {info.st_size} bytes, more than the {limit} a {path.name} may hold",
                              "Replace it by the model's own file")
            data = fh.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _refuse(path, exc.strerror or str(exc), "Check the file's permissions") from None
    if len(data) > limit:
        raise _refuse(path, f"it grew past the {limit} bytes a {path.name} may hold while read", "Replace it by the model's own file")
    return data


def read_text(path: Path, limit: int | None = None) -> str | None:
    """`read_bytes` decoded as UTF-8 (refused naming the file when it is not)."""
    data = read_bytes(path, limit)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(path, f"it is not UTF-8 text ({exc.reason} at byte {exc.start})", "Fix the file") from None


def check_depth(value: Any, path: Path, limit: int = MAX_DEPTH) -> Any:
    """`value` (parsed JSON) if it nests at most `limit` containers deep; PlanError naming `path` otherwise.
    Walked without recursion, so any depth is measured safely."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            raise _refuse(path, f"its JSON nests more than {limit} levels deep", "Replace it by the model's own file")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def parse_json(text: str, path: Path) -> Any:
    """JSON `text` (the contents of `path`) as data: refused naming the file when it is not JSON or nests deeper than
    `MAX_DEPTH` (Python's parser would otherwise overflow its recursion on a deeply nested file)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _refuse(path, f"its JSON nests more than {MAX_DEPTH} levels deep", "Replace it by the model's own file") from None
    except ValueError as exc:
        raise _refuse(path, f"it is not JSON ({exc})", "Fix the file") from None
    return check_depth(value, path)


def read_json(path: Path, limit: int | None = None) -> Any:
    """The JSON value of source file `path` (`read_text`, then `parse_json`); None when it does not exist."""
    text = read_text(path, limit)
    return None if text is None else parse_json(text, path)


def read_json_object(path: Path, what: str = "an object") -> dict[str, Any] | None:
    """`read_json`, refused unless the value is a JSON object."""
    value = read_json(path)
    if value is not None and not isinstance(value, dict):
        raise _refuse(path, f"it holds {type(value).__name__}, not {what}", "Fix the file")
    return value


def _copy(source: Path, target: Path) -> None:
    data = read_bytes(source)
    if data is not None:
        with open(target, "xb") as fh:
            fh.write(data)


@contextmanager
def staged(root: Path, names: tuple[str, ...] = STAGED_FILES, replace: Mapping[str, bytes] | None = None) -> Iterator[Path]:
    """A temporary folder, named like `root`, holding copies of `root`'s files `names` (by default `STAGED_FILES`,
    and then the chat templates under `additional_chat_templates/` too), each read by `read_bytes`; `replace` gives
    other contents for some of them (e.g. a slimmed tokenizer.json). For readers that open files themselves
    (gguf's `SpecialVocab` and `Metadata`, transformers); removed on exit."""
    root = Path(root)
    replace = dict(replace or {})
    base = tempfile.mkdtemp(prefix="workbench-source-")
    try:
        folder = Path(base) / (root.name or Path(os.path.realpath(root)).name or "model")
        folder.mkdir()
        for name in names:
            if name in replace:
                (folder / name).write_bytes(replace[name])
            else:
                _copy(root / name, folder / name)
        templates = root / CHAT_TEMPLATES
        if names == STAGED_FILES and os.path.lexists(templates):
            if not leads_inside(root, templates) or not templates.is_dir():
                raise _refuse(templates, "it is a link outside the source folder, or not a folder",
                              "Replace the link by the folder itself")
            (folder / CHAT_TEMPLATES).mkdir()
            for entry in sorted(os.listdir(templates))[:256]:
                if entry.endswith(".jinja"):
                    _copy(templates / entry, folder / CHAT_TEMPLATES / entry)
        yield folder
    finally:
        shutil.rmtree(base, ignore_errors=True)


__all__ = ["CONFIG_LIMIT", "MAX_DEPTH", "STAGED_FILES", "TOKENIZER_LIMIT", "check_depth", "limit_of", "parse_json", "present",
           "read_bytes", "read_json", "read_json_object", "read_text", "staged"]
