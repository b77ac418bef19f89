"""On-disk cache of what opening a remote checkpoint reads: listings, indexes and headers.

Headers and indexes are keyed by the store's identity (URL, and the commit for the Hub), the file name,
its size and its version tag (ETag, LFS sha256), so a re-uploaded file or a new revision is a miss and
is fetched again. Reopening a cached checkpoint reads no header over the network; with a pinned Hub
commit (or offline, `HF_HUB_OFFLINE=1`, or when the server cannot be reached) the listing comes from
the cache too. Tensor data is never cached. The folder is `$WORKBENCH_CACHE/remote` (default
`~/.cache/workbench/remote`); entries are written atomically through `files.py`.

The cache is not trusted blindly: every entry starts with one JSON line stating what it is (its key, its
size and the sha256 of its bytes), checked on every read. An entry that was edited, truncated or copied
under another key is a miss, with a `RemoteCacheWarning`, and is fetched again from the source (and
rewritten). A conversion's `verify=True` reopens a remote source with the cache bypassed (`uncached`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterator
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


class RemoteCacheWarning(UserWarning):
    """A cache entry did not match what it says it is (edited, truncated or moved): it was fetched again."""


_bypass = threading.local()


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Within the block, nothing is read from the cache (everything comes from the source, and is stored again)."""
    before = getattr(_bypass, "on", False)
    _bypass.on = True
    try:
        yield
    finally:
        _bypass.on = before


def _envelope(kind: str, key: str, data: bytes) -> bytes:
    head = {"key": f"{kind}/{key}", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return json.dumps(head, sort_keys=True).encode() + b"\n" + data


def _open_envelope(kind: str, key: str, raw: bytes, what: str) -> bytes | None:
    """The entry's bytes when its first line states this key, their size and their digest; else None (warned)."""
    line, sep, data = raw.partition(b"\n")
    try:
        head = json.loads(line) if sep else None
    except ValueError:
        head = None
    if (isinstance(head, dict) and head.get("key") == f"{kind}/{key}" and head.get("size") == len(data)
            and head.get("sha256") == hashlib.sha256(data).hexdigest()):
        return data
    if not (isinstance(head, dict) and "sha256" in head):  # written before entries stated what they are: a plain miss
        return None
    warnings.warn(f"The cached {what} ({_path(kind, key)}) does not match its stated key, size or digest; it was "
                  "changed after it was written. Ignoring it and reading from the source again.",
                  RemoteCacheWarning, stacklevel=4)
    return None


def _load(kind: str, key: str, what: str = "entry") -> bytes | None:
    if getattr(_bypass, "on", False):
        return None
    path = _path(kind, key)
    try:
        raw = read_regular(path)
    except Exception:  # noqa: BLE001 - a missing or unreadable entry is a miss
        return None
    return _open_envelope(kind, key, raw, what)


def _store(kind: str, key: str, data: bytes) -> None:
    path = _path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, _envelope(kind, key, data), sync_dir=False)
    except OSError:  # a read-only home must not stop opening a checkpoint
        pass


def blob_key(identity: str, file: RemoteFile, what: str) -> str | None:
    """The key of one file's header or body, None when the file has no version tag to trust."""
    return _key(what, identity, file.rel, file.size, file.tag) if file.tag else None


def load_blob(key: str | None) -> bytes | None:
    """A cached header or index, or None."""
    return None if key is None else _load("blobs", key, "header or index")


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
    """True when `folder` holds `file` at its listed version and with the bytes stored then (size and sha256 checked;
    a file without a tag is always fetched again)."""
    if not file.tag or getattr(_bypass, "on", False):
        return False
    try:
        stated = json.loads(read_regular(_tag_file(folder, file)))
        data = read_regular(folder / file.rel)
    except Exception:  # noqa: BLE001 - missing, unreadable or not ours: a miss
        return False
    if (isinstance(stated, dict) and stated.get("tag") == file.tag and stated.get("size") == len(data) == file.size
            and stated.get("sha256") == hashlib.sha256(data).hexdigest()):
        return True
    warnings.warn(f"The cached copy of {file.rel} ({folder / file.rel}) does not match the size or digest stored with it; "
                  "reading it from the source again.", RemoteCacheWarning, stacklevel=3)
    return False


def snapshot_put(folder: Path, file: RemoteFile, data: bytes) -> None:
    """Store one small file in the snapshot folder, with the version, size and digest it has."""
    _tag_file(folder, file).parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / file.rel, data, sync_dir=False)
    if file.tag:
        stated = {"tag": file.tag, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        atomic_write(_tag_file(folder, file), json.dumps(stated, sort_keys=True), sync_dir=False)


def load_listing(url: str) -> tuple[str, dict[str, RemoteFile]] | None:
    """(identity, files) of the last listing of `url`, or None."""
    raw = _load("listings", _key("listing", url), f"listing of {url}")
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
