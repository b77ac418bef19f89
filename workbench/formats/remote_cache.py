"""On-disk cache of what opening a remote checkpoint reads: listings, indexes and headers.

Headers and indexes are keyed by the store's identity (URL, and the commit for the Hub), the file name,
its size and its version tag (ETag, LFS sha256), so a re-uploaded file or a new revision is a miss and
is fetched again. Reopening a cached checkpoint reads no header over the network; with a pinned Hub
commit (or offline, `HF_HUB_OFFLINE=1`, or when the server cannot be reached) the listing comes from
the cache too. Tensor data is never cached. The folder is `$WORKBENCH_CACHE/remote` (default
`~/.cache/workbench/remote`); entries are written atomically through `files.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..files import atomic_write, read_regular
from .remote import RemoteFile


def cache_root() -> Path:
    """The cache folder (not created until something is stored)."""
    base = os.environ.get("WORKBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "workbench")
    return Path(base) / "remote"


def _key(*parts: object) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()


def _path(kind: str, key: str) -> Path:
    return cache_root() / kind / key[:2] / key


def _load(kind: str, key: str) -> bytes | None:
    path = _path(kind, key)
    try:
        return read_regular(path)
    except Exception:  # noqa: BLE001 - a missing or unreadable entry is a miss
        return None


def _store(kind: str, key: str, data: bytes) -> None:
    path = _path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, sync_dir=False)
    except OSError:  # a read-only home must not stop opening a checkpoint
        pass


def blob_key(identity: str, file: RemoteFile, what: str) -> str | None:
    """The key of one file's header or body, None when the file has no version tag to trust."""
    return _key(what, identity, file.rel, file.size, file.tag) if file.tag else None


def load_blob(key: str | None) -> bytes | None:
    """A cached header or index, or None."""
    return None if key is None else _load("blobs", key)


def store_blob(key: str | None, data: bytes) -> None:
    """Remember a header or index under its key (nothing without a version tag)."""
    if key is not None:
        _store("blobs", key, data)


def snapshot_folder(identity: str) -> Path:
    """The local folder of one remote checkpoint's small files (config, tokenizer); its catalog's root."""
    return cache_root() / "snapshots" / _key("snapshot", identity)[:32]


def _tag_file(folder: Path, file: RemoteFile) -> Path:
    return folder.parent / (folder.name + ".versions") / _key(file.rel, file.size, file.tag)


def snapshot_has(folder: Path, file: RemoteFile) -> bool:
    """True when `folder` holds `file` at its listed version (a file without a tag is always fetched again)."""
    return bool(file.tag) and _tag_file(folder, file).is_file() and (folder / file.rel).is_file()


def snapshot_put(folder: Path, file: RemoteFile, data: bytes) -> None:
    """Store one small file in the snapshot folder, and the version it is."""
    _tag_file(folder, file).parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / file.rel, data, sync_dir=False)
    if file.tag:
        atomic_write(_tag_file(folder, file), file.tag, sync_dir=False)


def load_listing(url: str) -> tuple[str, dict[str, RemoteFile]] | None:
    """(identity, files) of the last listing of `url`, or None."""
    raw = _load("listings", _key("listing", url))
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        return doc["identity"], {rel: RemoteFile(rel, int(size), tag) for rel, (size, tag) in doc["files"].items()}
    except (ValueError, KeyError, TypeError):
        return None


def store_listing(url: str, identity: str, files: dict[str, RemoteFile]) -> None:
    """Remember a listing (for pinned revisions and offline reopening)."""
    doc = {"identity": identity, "files": {rel: [f.size, f.tag] for rel, f in files.items()}}
    _store("listings", _key("listing", url), json.dumps(doc, sort_keys=True).encode())
