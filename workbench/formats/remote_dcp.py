"""A torch.distributed.checkpoint folder (or a folder of `ppN/` stages) behind a URL, read by ranges.

Opening costs the `.metadata` file of each stage (cached on disk by version like safetensors headers);
its data-file paths are checked like an index's, and each named `.distcp` file must be listed (or answer
a HEAD) with room for its byte spans. Nothing else is fetched until tensors are wanted. Each chunk is a
small torch.save zip stream inside a `.distcp` file: the first time a plan or a read needs chunk layouts,
the first and last `HEAD_BYTES` of every chunk stream involved are fetched together (nearby ones merged,
several requests at a time) and parsed by the local DCP reader's own code; tensor bytes then come through
`RemoteReader`'s coalesced, windowed ranges like remote safetensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..catalog import Catalog, FileInfo, TensorInfo
from ..dtypes import DTYPE_BITS
from ..errors import CannotRead
from . import remote_cache
from .dcp import (
    LIGHTNING_META,
    MAX_METADATA_BYTES,
    METADATA_NAME,
    Chunk,
    DcpReader,
    DcpTensor,
    catalog_tables,
    check_spans,
    merge_stages,
    parse_metadata,
)
from .remote import RemoteFile, RemoteStore
from .remote_torch import RangeFile

HEAD_BYTES = 4096  # a chunk stream's local header + data.pkl, and its zip directory, fit in this at each end
METADATA_GAP = 8 * 1024  # chunk-layout ranges closer than this are fetched as one

_fail = CannotRead("remote DCP checkpoint", "Check the URL and the files behind it.")


def has_dcp(lookup: Any) -> list[tuple[int | None, str]]:
    """The DCP stages under a store's root as (stage, prefix): `[(None, '')]` for a plain DCP folder,
    `[(0, 'pp0/'), ...]` for per-stage folders, `[]` when there is no `.metadata`. `lookup(rel)` is the
    store's file lookup."""
    if lookup(METADATA_NAME) is not None:
        return [(None, "")]
    stages = []
    for stage in range(64):
        if lookup(f"pp{stage}/{METADATA_NAME}") is None:
            break
        stages.append((stage, f"pp{stage}/"))
    return stages


def stages_in_listing(files: dict[str, RemoteFile]) -> list[tuple[int | None, str]]:
    """`has_dcp` for a store that lists its files (no requests)."""
    return has_dcp(files.get)


class RangePool:
    """`FilePool`'s interface over a remote store: `fd(rel)` is a range handle that `read_at` accepts."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self._handles: dict[str, RangeFile] = {}

    def fd(self, rel: str) -> RangeFile:
        """The range handle of one data file (made once)."""
        handle = self._handles.get(rel)
        if handle is None:
            file = self.store.file(rel)
            if file is None:
                raise _fail(self.store.where(rel), "the data file is gone from the server", fix="Re-open the checkpoint.")
            handle = self._handles[rel] = RangeFile(self.store, file)
        return handle

    def close(self) -> None:
        """Drop the handles and the spans they cached."""
        self._handles.clear()


def _metadata_bytes(store: RemoteStore, file: RemoteFile) -> bytes:
    key = remote_cache.blob_key(store.identity, file, "dcp-metadata")
    raw = remote_cache.load_blob(key)
    if raw is None:
        if file.size > MAX_METADATA_BYTES:
            raise _fail(store.where(file.rel), f".metadata is {file.size} bytes, above the {MAX_METADATA_BYTES}-byte limit for a DCP index")
        raw = store.read(file.rel, 0, file.size)
        remote_cache.store_blob(key, raw)
    return raw


def open_dcp(store: RemoteStore, stages: list[tuple[int | None, str]], url: str, warnings: list[str],
             extras: list[str] | None) -> Catalog:
    """The catalog of a remote DCP folder from its `.metadata` files (see the module docstring)."""
    from .remote_safetensors import RemoteReader, _remote_member

    loaded = []
    for stage, prefix in stages:
        file = store.file(prefix + METADATA_NAME)
        assert file is not None
        raw = _metadata_bytes(store, file)
        loaded.append((stage, prefix, *parse_metadata(raw, store.where(file.rel), prefix, stage,
                                                        lambda rel, what: _remote_member(url, rel, what))))
    tensors, objects, more, versions = merge_stages(loaded)
    warnings.extend(more)

    def size_of(rel: str) -> int:
        file = store.file(rel)
        if file is None:
            raise LookupError("missing")
        return file.size

    check_spans(tensors, objects, size_of, url)
    n_stages = 0 if stages == [(None, "")] else len(stages)
    infos, columns, metadata = catalog_tables(tensors, versions, n_stages)
    if store.file(LIGHTNING_META) is not None:
        warnings.append(f"The Lightning {LIGHTNING_META} next to the DCP data is not read remotely (its loops and "
                        "callbacks are not listed); download the folder to see them.")
    counts: dict[str, int] = {}
    for info in infos.values():
        counts[info.file] = counts.get(info.file, 0) + 1
    files = {rel: FileInfo(rel, size_of(rel), 0, n) for rel, n in sorted(counts.items()) if rel}
    fetched: list[str] = []
    reader = RemoteDcpReader(store, tensors, objects, RemoteReader(store, extras, fetched))
    return Catalog(
        root=remote_cache.snapshot_folder(store.identity),
        format="dcp",
        tensors=infos,
        files=files,
        metadata=metadata,
        warnings=warnings,
        extras=fetched,
        reader=reader,
        columns=columns,
        url=url,
    )


class RemoteDcpReader(DcpReader):
    """`DcpReader` over range handles: chunk layouts parsed from prefetched ends of each chunk stream, tensor
    bytes through a `RemoteReader` (announced reads fetched ahead in coalesced ranges)."""

    def __init__(self, store: RemoteStore, tensors: dict[str, DcpTensor], objects: dict, ranges: Any) -> None:
        super().__init__(remote_cache.snapshot_folder(store.identity), tensors, objects)
        self.store = store
        self.files = RangePool(store)
        self.ranges = ranges
        self._prepared: set[str] = set()

    # --- chunk layouts ---------------------------------------------------------------------------
    def prepare(self, names: Iterable[str]) -> None:
        """Fetch the ends of every chunk stream of these tensors whose layout is not parsed yet, together."""
        per_file: dict[str, list[tuple[int, int]]] = {}
        for name in names:
            entry = self.tensors.get(name)
            if entry is None or name in self._prepared:
                continue
            self._prepared.add(name)
            for chunk in entry.chunks:
                if (chunk.file, chunk.offset) in self._places or not _count(chunk.sizes):
                    continue
                end = chunk.offset + chunk.length
                spans = per_file.setdefault(chunk.file, [])
                spans.append((chunk.offset, min(end, chunk.offset + HEAD_BYTES)))
                spans.append((max(chunk.offset, end - HEAD_BYTES), end))
        for rel, spans in per_file.items():
            self.files.fd(rel).prefetch(spans, gap=METADATA_GAP)

    def _pieces(self, infos: Iterable[TensorInfo]) -> list[TensorInfo]:
        """Each announced tensor as the byte ranges of its contiguous chunks (strided chunks are read when asked)."""
        infos = list(infos)
        self.prepare(i.name for i in infos)
        out = []
        for info in infos:
            entry = self.tensors.get(info.name)
            if entry is None:
                continue
            for chunk in entry.chunks:
                piece = self._piece(entry, chunk)
                if piece is not None:
                    out.append(piece)
        return out

    def _piece(self, entry: DcpTensor, chunk: Chunk) -> TensorInfo | None:
        if not _count(chunk.sizes):
            return None
        place = self._place(entry, chunk)
        if not place.contiguous:
            return None
        nbytes = _count(chunk.sizes) * (DTYPE_BITS[entry.dtype] // 8)
        return TensorInfo(f"{entry.name}\0{chunk.file}\0{chunk.offset}", entry.dtype, chunk.sizes, chunk.file,
                          place.begin, place.begin + nbytes)

    def _chunk_bytes(self, entry: DcpTensor, chunk: Chunk) -> bytes:
        piece = self._piece(entry, chunk)
        if piece is None:
            return super()._chunk_bytes(entry, chunk)
        return self.ranges.read_bytes(piece)

    def locate(self, info: TensorInfo) -> None:
        """Never a local file; parses the tensor's chunk layouts now (planning), so a run reads only tensor bytes."""
        entry = self.tensors.get(info.name)
        if entry is not None:
            self.prepare(self.tensors if not self._prepared else [info.name])
            for chunk in entry.chunks:
                if _count(chunk.sizes):
                    self._place(entry, chunk)
        return None

    # --- the remote reader protocol (what the engine, planner and source guard ask of remote readers) ---
    def will_read(self, infos: Iterable[TensorInfo]) -> None:
        """Announce the tensors a run reads, in order: their chunks' bytes are fetched ahead."""
        self.ranges.will_read(self._pieces(infos))

    def download_plan(self, infos: Iterable[TensorInfo]) -> dict[str, tuple[int, int]]:
        """File -> (bytes, range requests) that reading `infos` downloads."""
        return self.ranges.download_plan(self._pieces(infos))

    def file_state(self, rel: str) -> tuple[int, str] | None:
        """(size, version tag) listed at open."""
        return self.ranges.file_state(rel)

    def take_counts(self) -> tuple[list[str], int, int]:
        """(URLs read, body bytes, requests) since the last call."""
        return self.ranges.take_counts()

    def fetch_file(self, rel: str):
        """One small file as a local file (`RemoteReader.fetch_file`)."""
        return self.ranges.fetch_file(rel)

    def fetch_extras(self) -> list[str]:
        """The folder's small files (config, tokenizer) into the catalog's local root."""
        return self.ranges.fetch_extras()

    def object_sources(self) -> tuple[list, list[str]]:
        """Non-tensor entries are not copied from a remote folder (they would need a download of their streams)."""
        return [], ([f"{len(self.objects)} non-tensor entries of the remote DCP folder are not copied; download the "
                     "folder to keep them."] if self.objects else [])

    def close(self) -> None:
        """Stop fetching ahead and drop cached spans."""
        self.ranges.close()
        self.files.close()


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
