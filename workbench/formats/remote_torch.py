"""A torch.save zip (`pytorch_model.bin`, `*.pt`) behind a URL, read by ranges without downloading it.

The zip's end records and central directory come from one request for the file's last 64 KiB (a second
one only when the directory is larger); the pickle is read inertly as for local files; then every
storage's local header is fetched, nearby ones merged into one range and `PARALLEL` requests at a time.
Tensor bytes are read like remote safetensors (prefetched, coalesced ranges); a strided view is
gathered from its storage's span. The parsing is `torch_zip`'s own, on a range handle (`RangeFile`)
that `iostats.read_at` accepts in place of a file descriptor.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..catalog import Catalog, FileInfo, TensorInfo
from ..errors import CheckpointError
from . import remote_cache, torch_zip
from .remote import RemoteFile, RemoteStore
from .remote_safetensors import PARALLEL, RemoteReader
from .shard_index import check_shard_present, shard_map
from .torch_folder import join_shards

TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
TAIL_BYTES = 64 * 1024
BLOCK_BYTES = 4096  # a local header (30 bytes + name + alignment padding) fits
MERGE_GAP = 64 * 1024  # local headers closer than this are fetched in one range
MAX_SPAN = 4 << 20  # merging stops here: cached spans stay small next to the tensors they describe


class RangeFile:
    """One remote file as a range handle: small reads are served from spans fetched before (the tail, the
    local headers); larger ones go to the store."""

    def __init__(self, store: RemoteStore, file: RemoteFile) -> None:
        self.store, self.file = store, file
        self._starts: list[int] = []
        self._spans: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def _cached(self, length: int, offset: int) -> bytes | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            if i >= 0:
                start = self._starts[i]
                data = self._spans[start]
                if offset + length <= start + len(data):
                    return data[offset - start: offset - start + length]
        return None

    def _keep(self, start: int, data: bytes) -> None:
        with self._lock:
            if start not in self._spans:
                bisect.insort(self._starts, start)
            self._spans[start] = data

    def read_at(self, length: int, offset: int) -> bytes:
        """Exactly `length` bytes at `offset` (EOFError past the end, as for local files)."""
        if offset + length > self.file.size:
            raise EOFError(f"wanted {length} bytes at offset {offset}, the file has {self.file.size}")
        hit = self._cached(length, offset)
        if hit is not None:
            return hit
        if length <= BLOCK_BYTES:
            end = min(self.file.size, offset + BLOCK_BYTES)
            data = self.store.read(self.file.rel, offset, end)
            self._keep(offset, data)
            return data[:length]
        return bytes(self.store.read(self.file.rel, offset, offset + length))

    def prefetch(self, ranges: Iterable[tuple[int, int]], gap: int = MERGE_GAP) -> None:
        """Fetch [start, end) ranges into the cache, those less than `gap` apart merged (up to `MAX_SPAN`
        bytes per request), `PARALLEL` requests at a time."""
        merged: list[list[int]] = []
        for start, end in sorted(ranges):
            end = min(end, self.file.size)
            if merged and start - merged[-1][1] <= gap and end - merged[-1][0] <= MAX_SPAN:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        todo = [(s, e) for s, e in merged if e > s and self._cached(e - s, s) is None]
        with ThreadPoolExecutor(PARALLEL) as pool:
            for (start, _), data in zip(todo, pool.map(lambda r: self.store.read(self.file.rel, *r), todo), strict=True):
                self._keep(start, data)


def is_torch_name(rel: str) -> bool:
    """True for a file name a torch.save checkpoint usually has."""
    return rel.lower().endswith(TORCH_SUFFIXES)


def _open_part(store: RemoteStore, file: RemoteFile) -> tuple[Catalog, RangeFile]:
    """One remote torch.save zip's catalog (tensors' `file` is the store-relative name) and range handle."""
    handle = RangeFile(store, file)
    where = store.where(file.rel)
    handle.prefetch([(max(0, file.size - TAIL_BYTES), file.size)])
    head = handle.read_at(min(64, file.size), 0)
    torch_zip._refuse_non_zip(Path(where), head)
    if not head.startswith(torch_zip.ZIP_MAGIC):
        raise CheckpointError(f"Cannot open {where}: it is not a torch.save zip archive. Download it and open the local "
                              "copy to see what it is.", file=where)

    def headers(archive: torch_zip.TorchArchive) -> None:
        handle.prefetch((m.header_offset, m.header_offset + BLOCK_BYTES) for m in archive.members.values())

    archive, contents, places, skipped = torch_zip.inspect_open(handle, where, length=file.size, before_places=headers)
    tf = torch_zip.TorchFile(Path(file.rel or where.rsplit("/", 1)[-1]), archive, contents, places, skipped)
    catalog = torch_zip.catalog_of(tf, size=file.size)
    if tf.path.name != file.rel:  # a URL naming the file itself (the store reads it as ''), or a shard in a subfolder
        catalog.tensors = {n: TensorInfo(t.name, t.dtype, t.shape, file.rel, t.begin, t.end) for n, t in catalog.tensors.items()}
        (info,) = catalog.files.values()
        catalog.files = {file.rel: FileInfo(file.rel, info.size, info.header_bytes, info.n_tensors)}
    return catalog, handle


def open_torch(store: RemoteStore, file: RemoteFile, url: str, warnings: list[str]) -> Catalog:
    """The catalog of a remote torch.save zip, from its directory, pickle and local headers."""
    catalog, handle = _open_part(store, file)
    catalog.warnings[:0] = warnings
    catalog.url = url
    catalog.reader = RemoteTorchReader(store, {file.rel: handle}, {n: catalog.reader.places[n] for n in catalog.tensors})
    return catalog


def open_torch_sharded(store: RemoteStore, index_file: RemoteFile, url: str, warnings: list[str], extras: list[str] | None) -> Catalog:
    """The catalog of a remote sharded torch.save folder (`pytorch_model.bin.index.json`), each shard opened
    like a single remote file; the index's claims are checked like a local folder's."""
    from .remote_safetensors import _index_bytes, _remote_member
    from .safetensors_folder import parse_index_bytes

    index_name = index_file.rel
    weight_map, _ = parse_index_bytes(_index_bytes(store, index_file), store.where(index_name))
    shard_of, shards = shard_map(weight_map, lambda rel, what: _remote_member(url, rel, what), index_name)
    catalogs: dict[str, Catalog] = {}
    handles: dict[str, RangeFile] = {}
    for rel in shards:
        file = store.file(rel)
        check_shard_present(url, index_name, rel, "missing" if file is None else None, shard_of)
        assert file is not None
        catalogs[rel], handles[rel] = _open_part(store, file)
    tensors, tables, more = join_shards(url, index_name, shard_of, catalogs)
    files = {}
    for rel, catalog in catalogs.items():
        (info,) = catalog.files.values()
        files[rel] = FileInfo(rel, info.size, info.header_bytes, sum(1 for t in tensors.values() if t.file == rel))
    places = {n: catalogs[t.file].reader.places[n] for n, t in tensors.items()}
    fetched: list[str] = []
    return Catalog(
        root=remote_cache.snapshot_folder(store.identity),
        format="torch-sharded",
        tensors=tensors,
        files=files,
        metadata=tables["metadata"],
        warnings=warnings + more,
        extras=fetched,
        reader=RemoteTorchReader(store, handles, places, extras, fetched),
        columns=tables["columns"],
        url=url,
    )


class RemoteTorchReader(RemoteReader):
    """Remote reads for torch.save zips: contiguous tensors as byte ranges (prefetched like safetensors),
    strided views gathered from their storage's span."""

    def __init__(self, store: RemoteStore, handles: dict[str, RangeFile], places: dict,
                 extras: list[str] | None = None, fetched: list[str] | None = None) -> None:
        super().__init__(store, [] if extras is None and len(handles) == 1 else extras, fetched)
        self.handles = handles
        self.places = places

    def will_read(self, infos: Iterable[TensorInfo]) -> None:
        """Prefetch the contiguous tensors; strided ones are read when asked."""
        super().will_read(i for i in infos if self.places[i.name].contiguous)

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's row-major bytes."""
        place = self.places[info.name]
        if place.contiguous:
            return super().read_bytes(info)
        return torch_zip.read_place(self.handles[info.file], place, info.nbytes)
