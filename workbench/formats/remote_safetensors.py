"""Safetensors checkpoints behind a URL: the index, then each shard's header, by range requests.

Opening costs one listing (Hub, S3) or one HEAD per file (plain HTTP), the index, and one range request
per shard whose header fits `FIRST_READ` bytes, two otherwise. Headers and the index are validated
exactly like local files (the same parser, the same index checks) and cached on disk by version, so a
second open fetches no header. Tensor bytes are fetched by `RemoteReader`: when the engine announces
what it will read (`will_read`), adjacent tensors are fetched together in ranges of up to
`CHUNK_BYTES`, `PARALLEL` at a time, at most `WINDOW_BYTES` ahead of the consumer.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from ..catalog import Catalog, TensorInfo
from ..errors import CannotRead, CheckpointError
from . import remote_cache
from .remote import RemoteError, RemoteFile, RemoteStore, open_store
from .safetensors import MAX_HEADER_BYTES, SUFFIX, SafetensorsHeader, file_info, gc_paused, parse_header_bytes
from .safetensors_folder import INDEX_NAME, SINGLE_NAME, UNFINISHED_MARKER, parse_index_bytes
from .shard_index import check_claims, check_shard_present, shard_map
from .weight_files import names_weights

# 8-byte length + JSON in one request for all but very large headers (a 400 GB repo's shards have ~50-150 KB).
FIRST_READ = 256 * 1024
CHUNK_BYTES = 16 << 20
PARALLEL = 4
WINDOW_BYTES = 128 << 20
LAZY_FORMATS = "safetensors (single file, folder, or sharded with an index), DCP folders and torch.save zip files (single or sharded with an index)"
TORCH_SINGLE_NAME = "pytorch_model.bin"
# Small files a conversion copies along (config, tokenizer): fetched when a plan wants extras, never on open.
MAX_EXTRA_BYTES = 64 << 20
MAX_EXTRAS = 64
# Plain HTTP cannot list a folder: these are the names asked for.
KNOWN_EXTRAS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


_fail = CannotRead("remote checkpoint", "Check the URL and the files behind it.")


def read_remote_header(store: RemoteStore, file: RemoteFile) -> SafetensorsHeader:
    """Parse one shard's header from at most two range requests (none when cached)."""
    where = store.where(file.rel)
    key = remote_cache.blob_key(store.identity, file, "safetensors-header")
    raw = remote_cache.load_blob(key)
    if raw is None or len(raw) < 8 or len(raw) != 8 + struct.unpack("<Q", raw[:8])[0]:
        if file.size < 8:
            raise _fail(where, f"the file is {file.size} bytes, shorter than the 8-byte header length", fix="Re-upload it.")
        first = store.read(file.rel, 0, min(file.size, FIRST_READ))
        (n,) = struct.unpack("<Q", first[:8])
        if n > MAX_HEADER_BYTES:
            raise _fail(where, f"the header length field says {n} bytes, above the {MAX_HEADER_BYTES} byte limit",
                        fix="The file is corrupt or not a safetensors file.")
        if 8 + n > file.size:
            raise _fail(where, f"the header length field says {n} bytes but the file has only {file.size - 8} after it",
                        fix="The file is truncated; re-upload it.")
        # The header is bytes [0, 8 + n): the first read holds it when 8 + n <= len(first) (end exclusive).
        raw = first[: 8 + n] if 8 + n <= len(first) else first + store.read(file.rel, len(first), 8 + n)
        remote_cache.store_blob(key, raw)
    n = len(raw) - 8
    tensors, metadata = parse_header_bytes(raw[8:], where, file.rel, 8 + n, file.size)
    return SafetensorsHeader(tensors, metadata, 8 + n, file.size)


def _index_bytes(store: RemoteStore, file: RemoteFile) -> bytes:
    key = remote_cache.blob_key(store.identity, file, "index")
    raw = remote_cache.load_blob(key)
    if raw is None:
        if file.size > 512 * 1024 * 1024:
            raise _fail(store.where(file.rel), f"the index is {file.size} bytes, more than any real index", fix="Check the file.")
        raw = store.read(file.rel, 0, file.size)
        remote_cache.store_blob(key, raw)
    return raw


def _remote_member(url: str, rel: object, what: str) -> str:
    """An index entry as a file name under the store's root: no absolute paths, no `..`."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise CheckpointError(f"Cannot use {what}: the shard path {rel!r} is not a file name. Fix the index.", file=url)
    pure = PurePosixPath(rel.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or "://" in rel or (len(rel) > 1 and rel[1] == ":"):
        raise CheckpointError(
            f"Cannot use {what}: the shard path {rel!r} points outside the checkpoint {url}. Refusing it; an index may "
            "only name files inside its own folder.", file=url)
    return str(pure)


def _listing(store: RemoteStore) -> tuple[dict[str, RemoteFile] | None, list[str]]:
    """The store's files, from the cache for a pinned commit or when the server cannot be reached."""
    cached = remote_cache.load_listing(store.url)
    pinned = getattr(store, "commit", None) and getattr(store, "revision", None) == getattr(store, "commit", None)
    if cached is not None and (pinned or store.offline):
        store.identity = cached[0]
        store.set_listing(cached[1])
        return cached[1], []
    try:
        files = store.listing()
    except RemoteError as exc:
        if cached is None:
            raise
        store.identity = cached[0]
        store.set_listing(cached[1])
        store.offline = True
        return cached[1], [f"Using the cached listing of {store.url}: the server could not be reached ({exc.message})."]
    if files is not None:
        remote_cache.store_listing(store.url, store.identity, files)
    else:  # a server that cannot list: what the last open looked up stands in when it cannot be reached
        probed = remote_cache.load_listing(store.url + PROBED)
        store.probe_cache = None if probed is None else probed[1]
    return files, []


PROBED = "#probed"  # the cache's listing key of the files an open of an HTTP folder looked up


def _remember_probes(store: RemoteStore, warnings: list[str]) -> None:
    """After opening a store that cannot list: cache the files it looked up (online), or say it worked from them."""
    if store.listing() is not None:
        return
    if store.offline_reason:
        warnings.append(f"Using the cached lookups of {store.url}: the server could not be reached ({store.offline_reason}).")
    else:
        remember_lookups(store)


def remember_lookups(store: RemoteStore) -> None:
    """Cache the files this store looked up, added to those an earlier open of the same version looked up (a later
    open that asks for fewer files, e.g. not config.json, must not make an offline reopen forget them)."""
    found = dict(store.probed())
    earlier = remote_cache.load_listing(store.url + PROBED)
    if earlier is not None and earlier[0] == store.identity:
        found = {**earlier[1], **found}
    remote_cache.store_listing(store.url + PROBED, store.identity, found)


def open_url(url: str) -> Catalog:
    """Open a remote checkpoint from its headers (see the module docstring for the cost). A bare `org/repo`
    that the Hub does not have is reported as the missing local path it may also have been meant as."""
    store = open_store(url)
    try:
        with gc_paused():
            catalog = _open(store)
        _remember_probes(store, catalog.warnings)
        return catalog
    except RemoteError as exc:
        if url.startswith(("hf://", "http://", "https://", "s3://")):
            raise
        raise CheckpointError(
            f"Cannot open checkpoint {url}: no such file or folder, and as a Hub repo id: {exc.message}",
            file=url,
        ) from None


def reopen_uncached(url: str) -> Catalog:
    """The remote checkpoint at `url` opened again from the source alone: no listing, index, header or config comes
    from the cache (what a conversion's `verify=True` compares the output with; the fresh entries are stored)."""
    with remote_cache.uncached():
        return open_url(url)


def _open(store: RemoteStore) -> Catalog:
    url = store.url
    files, warnings = _listing(store)
    shard_of: dict[str, str] | None = None
    index_name = ""
    index_meta: dict = {}
    from .remote_dcp import has_dcp, open_dcp, stages_in_listing
    from .remote_torch import is_torch_name, open_torch, open_torch_sharded
    from .torch_folder import TORCH_INDEX_NAME, find_torch_index

    if files is not None:
        if "" in files and is_torch_name(url.rstrip("/")):
            return open_torch(store, files[""], url, warnings)
        if "" in files:  # the URL names one object
            names = [""]
        else:
            index_names = [INDEX_NAME] if INDEX_NAME in files else sorted(r for r in files if "/" not in r and r.endswith(SUFFIX + ".index.json"))
            names = []
            if len(index_names) == 1:
                index_name = index_names[0]
            else:
                names = sorted(r for r in files if "/" not in r and r.endswith(SUFFIX))
            if names and UNFINISHED_MARKER in files:  # as a local folder: a conversion (into s3://) never committed
                raise _fail(url, f"it is an unfinished conversion ({UNFINISHED_MARKER} is there and the conversion never "
                                 "committed)", fix="Run the same conversion again to finish it, or open one shard file directly.")
            torch_index = find_torch_index(files)
            if not index_name and not names and torch_index:
                return open_torch_sharded(store, files[torch_index], url, warnings, _listed_extras(files))
            torch_files = [r for r in files if "/" not in r and is_torch_name(r)]
            if not index_name and not names and len(torch_files) == 1:
                return open_torch(store, files[torch_files[0]], url, warnings)
            stages = stages_in_listing(files)
            if not index_name and not names and stages:
                return open_dcp(store, stages, url, warnings, _listed_extras(files))
            if not index_name and not names:
                other = sorted(r for r in files if "/" not in r)[:5]
                raise _fail(url, f"it holds no safetensors file and no index (found: {', '.join(other) or 'nothing'})",
                            fix=f"Remote checkpoints are read lazily in {LAZY_FORMATS}; download other formats "
                            "and open the local copy.")
    else:  # plain HTTP cannot list: the URL is a file, or a folder with an index or model.safetensors
        last = url.rstrip("/").rsplit("/", 1)[-1]
        if is_torch_name(last) and store.file("") is not None:
            return open_torch(store, store.file(""), url, warnings)
        if last.endswith(SUFFIX) and store.file("") is not None:
            names = [""]
        elif last.endswith(".index.json"):
            raise _fail(url, "point at the folder that holds the index, not at the index itself", fix="Drop the file name from the URL.")
        elif store.file(INDEX_NAME) is not None:
            index_name, names = INDEX_NAME, []
        elif store.file(SINGLE_NAME) is not None:
            names = [SINGLE_NAME]
        elif store.file(TORCH_INDEX_NAME) is not None:
            return open_torch_sharded(store, store.file(TORCH_INDEX_NAME), url, warnings, None)
        elif store.file(TORCH_SINGLE_NAME) is not None:
            return open_torch(store, store.file(TORCH_SINGLE_NAME), url, warnings)
        elif stages := has_dcp(store.file):
            return open_dcp(store, stages, url, warnings, None)
        else:
            raise _fail(url, f"none of {INDEX_NAME}, {SINGLE_NAME}, {TORCH_INDEX_NAME}, {TORCH_SINGLE_NAME}, .metadata (DCP) is there "
                        "(an HTTP server cannot list a folder)",
                        fix=f"Point at a folder holding one of them or at a .safetensors file; remote checkpoints are read "
                        f"lazily in {LAZY_FORMATS}.")
    if index_name:
        index_file = store.file(index_name)
        assert index_file is not None
        weight_map, index_meta = parse_index_bytes(_index_bytes(store, index_file), store.where(index_name))
        shard_of, names = shard_map(weight_map, lambda rel, what: _remote_member(url, rel, what), index_name)
    headers: dict[str, SafetensorsHeader] = {}
    for rel in names:
        file = store.file(rel)
        check_shard_present(url, index_name, rel, "missing" if file is None else None, shard_of or {})
        assert file is not None
        headers[rel] = read_remote_header(store, file)
    if shard_of is None:
        tensors, more = check_claims(url, "the shards", {i.name: rel for rel, h in headers.items() for i in h.tensors},
                                     {rel: h.tensors for rel, h in headers.items()})
    else:
        tensors, more = check_claims(url, index_name, shard_of, {rel: h.tensors for rel, h in headers.items()})
    warnings.extend(more)
    metadata: dict[str, str] = {}
    for header in headers.values():
        metadata.update(header.metadata)
    fmt = "hf-sharded" if index_name else ("safetensors" if len(names) == 1 else "safetensors-folder")
    del index_meta
    if names == [""]:
        extras: list[str] | None = []
    elif files is not None:
        extras = _listed_extras(files)
    else:
        extras = None  # asked for by name when a plan wants them
    fetched: list[str] = []  # filled by RemoteReader.fetch_extras, which a plan calls when it copies extras
    return Catalog(
        root=remote_cache.snapshot_folder(store.identity),
        format=fmt,
        tensors=tensors,
        files={rel: file_info(rel, h) for rel, h in headers.items()},
        metadata=metadata,
        warnings=warnings,
        file_metadata={rel: dict(h.metadata) for rel, h in headers.items()},
        reader=RemoteReader(store, extras, fetched),
        extras=fetched,
        url=url,
    )


def _listed_extras(files: dict[str, RemoteFile]) -> list[str]:
    """The small non-weight files at the top of a listed store (config, tokenizer), which conversions copy."""
    return sorted(r for r, f in files.items() if "/" not in r and r and not r.startswith(".")
                  and not names_weights(r) and f.size <= MAX_EXTRA_BYTES)[:MAX_EXTRAS]


class _Chunk:
    __slots__ = ("rel", "start", "end", "names", "left", "buffer", "parts")

    def __init__(self, rel: str, start: int, end: int) -> None:
        self.rel, self.start, self.end = rel, start, end
        self.names: list[str] = []
        self.left = 0
        self.buffer: bytearray | None = None
        self.parts: list[Future] = []

    def pieces(self) -> list[tuple[int, int]]:
        """The range requests of this chunk: [start, stop) pieces of at most `CHUNK_BYTES`."""
        return [(s, min(s + CHUNK_BYTES, self.end)) for s in range(self.start, self.end, CHUNK_BYTES)]


def chunk_ranges(infos: Iterable[TensorInfo]) -> list[_Chunk]:
    """The ranges a run fetches: each tensor once, in reading order, adjacent tensors of a file merged up
    to `CHUNK_BYTES` (a larger tensor is one chunk fetched in `CHUNK_BYTES` pieces)."""
    chunks: list[_Chunk] = []
    seen: set[str] = set()
    for info in infos:
        if info.name in seen or info.end <= info.begin:
            continue
        seen.add(info.name)
        last = chunks[-1] if chunks else None
        if last is not None and last.rel == info.file and last.end == info.begin and info.end - last.start <= CHUNK_BYTES:
            last.end = info.end
        else:
            last = _Chunk(info.file, info.begin, info.end)
            chunks.append(last)
        last.names.append(info.name)
        last.left += 1
    return chunks


class RemoteReader:
    """Tensor bytes of a remote checkpoint by range requests, fetched ahead in large coalesced ranges."""

    def __init__(self, store: RemoteStore, extras: list[str] | None = None, fetched: list[str] | None = None) -> None:
        self.store = store
        self._extras = extras
        self._fetched = fetched if fetched is not None else []
        self._chunks: list[_Chunk] = []
        self._chunk_of: dict[str, int] = {}
        self._next = 0  # first chunk not yet submitted
        self._ahead = 0  # bytes submitted and not yet consumed
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._counted: dict[str, tuple[int, int]] = {}

    def locate(self, info: TensorInfo) -> None:
        """Never a local file: the engine reads every tensor through `read_bytes`."""
        return None

    def raw_offset(self, info: TensorInfo) -> int:
        """Where the tensor's bytes start in its remote file, as they would on disk: the plan places output
        data starts from it (`planning.page_align`), so a URL gives the same output bytes as a local copy."""
        return info.begin

    def file_state(self, rel: str) -> tuple[int, str] | None:
        """(size, version tag) listed at open: what the source guard and the plan fingerprint compare."""
        file = self.store.file(rel)
        return None if file is None else (file.size, file.tag)

    def will_read(self, infos: Iterable[TensorInfo]) -> None:
        """Announce the tensors a run reads, in order: they are fetched ahead in coalesced ranges."""
        self.close()
        chunks = chunk_ranges(infos)
        with self._lock:
            self._chunks = chunks
            self._chunk_of = {name: i for i, c in enumerate(chunks) for name in c.names}
            self._next = self._ahead = 0
            self._pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="workbench-remote") if chunks else None

    def fetch_extras(self) -> list[str]:
        """Bring the checkpoint's small files (config, tokenizer) into the catalog's local root folder, where a
        conversion copies them from like any local extra; cached by version tag, so asked for once."""
        names = self._extras if self._extras is not None else list(KNOWN_EXTRAS)
        fetched = [rel for rel in names if self.fetch_file(rel) is not None]
        self._fetched[:] = fetched  # the catalog's `extras`
        return fetched

    def fetch_file(self, rel: str) -> Path | None:
        """One small file of the checkpoint (config.json ...) as a local file in the catalog's root folder, fetched
        once per version (cached and checked); None when the server does not have it or it is over `MAX_EXTRA_BYTES`.
        What lets remote config files be read like local ones (presets, suggestions)."""
        if "/" in rel or rel.startswith("."):
            return None
        folder = remote_cache.snapshot_folder(self.store.identity)
        file = self.store.file(rel)
        if file is None or file.size > MAX_EXTRA_BYTES:
            return None
        if not remote_cache.snapshot_has(folder, file):
            remote_cache.snapshot_put(folder, file, self.store.read(rel, 0, file.size))
        if self.store.listing() is None and not self.store.offline:  # found by a HEAD: reopening offline finds it too
            remember_lookups(self.store)
        return folder / rel

    def download_plan(self, infos: Iterable[TensorInfo]) -> dict[str, tuple[int, int]]:
        """File -> (bytes, range requests) a run reading `infos` in this order downloads (`will_read`'s ranges)."""
        out: dict[str, list[int]] = {}
        for chunk in chunk_ranges(infos):
            row = out.setdefault(chunk.rel, [0, 0])
            row[0] += chunk.end - chunk.start
            row[1] += -(-(chunk.end - chunk.start) // CHUNK_BYTES)
        return {rel: (n, k) for rel, (n, k) in sorted(out.items())}

    def take_counts(self) -> tuple[list[str], int, int]:
        """(URLs read, body bytes, requests) since the last call: what a run's report shows for a remote source."""
        stats = self.store.stats
        with stats._lock:
            now = {rel: tuple(v) for rel, v in stats.per_file.items()}
        before, self._counted = self._counted, now
        urls = [self.store.where(rel) for rel, (k, _) in now.items() if rel and k > before.get(rel, (0, 0))[0]]
        n_bytes = sum(v[1] for v in now.values()) - sum(v[1] for v in before.values())
        requests = sum(v[0] for v in now.values()) - sum(v[0] for v in before.values())
        return sorted(urls), n_bytes, requests

    def _fetch(self, chunk: _Chunk) -> bytearray:
        """The chunk's bytes in a fresh buffer, fetched piece by piece on this thread (unannounced reads)."""
        buffer = bytearray(chunk.end - chunk.start)
        for start, stop in chunk.pieces():
            self._fetch_piece(chunk.rel, memoryview(buffer)[start - chunk.start: stop - chunk.start], start, stop)
        return buffer

    def _fetch_piece(self, rel: str, target: memoryview, start: int, stop: int) -> None:
        self.store.read(rel, start, stop, into=target)  # the body goes straight into the chunk's buffer

    def _fill(self, upto: int) -> None:
        """Submit chunks up to index `upto` and beyond while the window allows."""
        pool = self._pool
        if pool is None:
            return
        while self._next < len(self._chunks) and (self._next <= upto or self._ahead < WINDOW_BYTES):
            chunk = self._chunks[self._next]
            # Each piece is its own request, so a large tensor downloads on every connection at once; the
            # pieces fill one buffer, filled on the fetching threads and handed to the consumer as it is.
            chunk.buffer = bytearray(chunk.end - chunk.start)
            view = memoryview(chunk.buffer)
            chunk.parts = [pool.submit(self._fetch_piece, chunk.rel, view[a - chunk.start: b - chunk.start], a, b)
                           for a, b in chunk.pieces()]
            self._ahead += chunk.end - chunk.start
            self._next += 1

    def read_bytes(self, info: TensorInfo) -> bytearray:
        """The bytes of one tensor (a buffer the caller owns): from its prefetched range when announced, else
        fetched now."""
        with self._lock:
            index = self._chunk_of.get(info.name)
            if index is not None:
                self._fill(index)
                chunk = self._chunks[index]
        if index is None:
            return self._fetch(_Chunk(info.file, info.begin, info.end))
        for part in chunk.parts:
            part.result()
        data = chunk.buffer
        with self._lock:
            chunk.left -= 1
            self._chunk_of.pop(info.name, None)
            if chunk.left <= 0:
                chunk.buffer, chunk.parts = None, []  # drop the bytes: the window moves on
                self._ahead -= chunk.end - chunk.start
        if chunk.start == info.begin and chunk.end == info.end:
            return data  # the chunk is this tensor: hand the buffer over
        return data[info.begin - chunk.start: info.end - chunk.start]

    def close(self) -> None:
        """Stop fetching ahead and drop fetched ranges; later reads go straight to the store."""
        with self._lock:
            pool, self._pool = self._pool, None
            for chunk in self._chunks:
                for part in chunk.parts:
                    part.cancel()
            self._chunks, self._chunk_of, self._next, self._ahead = [], {}, 0, 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
