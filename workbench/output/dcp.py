"""Writing torch.distributed.checkpoint (DCP) folders with every byte placed before the first write.

In a DCP folder each tensor chunk is a complete torch.save zip stream inside a `__<r>_<n>.distcp` file, and
`.metadata` (a pickle of DCP's dataclasses) says which stream holds which chunk. The stream of a tensor of
known dtype and shape is fixed except for the tensor's data and its CRC-32, so a plan can lay out every
stream in advance, exactly as it lays out safetensors tensors: the engine then fills the data slots with
the same kernel copies, chunked casts and computes, and the writer patches the CRCs when the file is
complete. Each tensor is stored as one chunk covering it whole; DCP reshards on load, so the folder loads
at any world size. Output bytes depend only on the layout, never on the number of writing processes.

Commit (rank 0, after every file is complete): the non-tensor entries of a DCP source (step counters,
param_groups ...) are copied verbatim (their torch.save streams, never unpickled) into one more file, then
`.metadata` is written last under a temporary name and renamed: its presence marks a complete checkpoint.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import _TORCH_NAMES, DTYPE_BITS, nbytes_of
from ..errors import PlanError
from ..files import atomic_write, claim_temp, fsync_dir, temp_path
from ..formats.dcp import METADATA_NAME
from ..iostats import IO, open_for_read, read_at
from .base import OutputFormat
from .safetensors import FileLayout, SafetensorsWriter, preallocate

ALIGNMENT = 64  # torch.save aligns every record's data to 64 bytes (mmap loading relies on it)
ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets at or above this need zip64 fields
_ZIP64_MARK = 0xFFFFFFFF  # what a 32-bit field holds when the real value is in a zip64 field
CRC_BUFFER_BYTES = 8 << 20
ARCHIVE = "archive"

# Dtypes torch pickles through a legacy typed storage (`torch.FloatStorage` ...) with `_rebuild_tensor_v2`;
# every other dtype goes through `torch.storage.UntypedStorage` + `_rebuild_tensor_v3` with the dtype named.
_LEGACY_STORAGE = {
    "BOOL": "BoolStorage", "U8": "ByteStorage", "I8": "CharStorage", "I16": "ShortStorage", "I32": "IntStorage",
    "I64": "LongStorage", "F16": "HalfStorage", "BF16": "BFloat16Storage", "F32": "FloatStorage",
    "F64": "DoubleStorage", "C64": "ComplexFloatStorage",
}
# Small records torch.save writes beside the pickle and the data (name inside the archive, content).
_SMALL_RECORDS = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"), ("version", b"3\n"))


def dcp_file_name(k: int) -> str:
    """Name of the k-th (0-based) data file of a DCP written by the workbench: `__0_<k>.distcp`."""
    return f"__0_{k}.distcp"


def writable(dtype: str) -> bool:
    """True when DCP (torch.save) can store this safetensors dtype (whole bytes per element)."""
    return dtype in _TORCH_NAMES and DTYPE_BITS[dtype] % 8 == 0


# ---------------------------------------------------------------------------------------------- pickle


class _PickleEmitter:
    """Protocol-2 opcodes exactly as Python's pickler writes them for torch.save's tensor tuple."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo = 0

    def put(self) -> None:
        self.out += b"q" + bytes([self.memo]) if self.memo < 256 else b"r" + struct.pack("<I", self.memo)
        self.memo += 1

    def global_(self, module: str, name: str) -> None:
        self.out += b"c" + f"{module}\n{name}\n".encode()
        self.put()

    def text(self, value: str) -> None:
        raw = value.encode()
        self.out += b"X" + struct.pack("<I", len(raw)) + raw
        self.put()

    def integer(self, value: int) -> None:
        self.out += pickle.dumps(value, protocol=2)[2:-1]  # ints are never memoised

    def ints(self, values: Sequence[int]) -> None:
        if not values:
            self.out += b")"
            return
        if len(values) > 3:
            self.out += b"("
        for v in values:
            self.integer(v)
        self.out += b"t" if len(values) > 3 else (b"\x85", b"\x86", b"\x87")[len(values) - 1]
        self.put()


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides as torch computes them (a zero-size dimension counts as 1)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tensor_pickle(dtype: str, shape: Sequence[int]) -> bytes:
    """The `data.pkl` torch.save writes for a fresh contiguous CPU tensor of this dtype and shape."""
    numel = 1
    for d in shape:
        numel *= d
    legacy = _LEGACY_STORAGE.get(dtype)
    p = _PickleEmitter()
    p.global_("torch._utils", "_rebuild_tensor_v2" if legacy else "_rebuild_tensor_v3")
    p.out += b"(("
    p.text("storage")
    if legacy:
        p.global_("torch", legacy)
    else:
        p.global_("torch.storage", "UntypedStorage")
    p.text("0")
    p.text("cpu")
    p.integer(numel if legacy else nbytes_of(dtype, numel))
    p.out += b"t"
    p.put()
    p.out += b"Q"
    p.integer(0)
    p.ints(tuple(shape))
    p.ints(contiguous_strides(shape))
    p.out += b"\x89"
    p.global_("collections", "OrderedDict")
    p.out += b")R"
    p.put()
    if not legacy:
        p.global_("torch", _TORCH_NAMES[dtype])
    p.out += b"t"
    p.put()
    p.out += b"R"
    p.put()
    p.out += b"."
    return bytes(p.out)


# ---------------------------------------------------------------------------------------------- zip stream


def _size_fields(size: int) -> tuple[int, bytes, int]:
    """How a stored entry of `size` bytes records its size: the 32-bit size field, the zip64 extra field
    (empty when 32 bits suffice) and the zip version needed to extract it."""
    if size >= ZIP64_LIMIT:
        return _ZIP64_MARK, struct.pack("<HHQQ", 1, 16, size, size), 45
    return size, b"", 20


def _local_header(name: bytes, crc: int, size: int, at: int) -> bytes:
    """A stored entry's local header, padded (torch's 'FB' extra field) so its data starts 64-aligned."""
    field, extra, version = _size_fields(size)
    pad = -(at + 30 + len(name) + len(extra)) % ALIGNMENT
    if pad:
        pad += ALIGNMENT if pad < 4 else 0
        extra += struct.pack("<HH", 0x4246, pad - 4) + b"Z" * (pad - 4)
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, version, 0, 0, 0, 0, crc, field, field, len(name), len(extra)) + name + extra


def _central_entry(name: bytes, crc: int, size: int, header_at: int) -> bytes:
    field, extra, version = _size_fields(size)
    return struct.pack(
        "<IHHHHHHIIIHHHHHII", 0x02014B50, 45, version, 0, 0, 0, 0, crc, field, field, len(name), len(extra), 0, 0, 0, 0,
        header_at,
    ) + name + extra


@dataclass(frozen=True)
class TensorStream:
    """The torch.save zip stream of one tensor: `head`, then `data_len` data bytes, then `tail`.

    The data's CRC-32 sits at `crc_in_head` (its local header) and `crc_in_tail` (its directory entry);
    both are zero here and patched once the data is written.
    """

    head: bytes
    data_len: int
    tail: bytes
    crc_in_head: int
    crc_in_tail: int

    @property
    def length(self) -> int:
        """Bytes of the whole stream."""
        return len(self.head) + self.data_len + len(self.tail)


def tensor_stream(dtype: str, shape: Sequence[int]) -> TensorStream:
    """Lay out the torch.save stream of a tensor: records first, the data entry last, then the directory."""
    return _tensor_stream(dtype, tuple(shape), ZIP64_LIMIT)


@lru_cache(maxsize=4096)  # layers repeat shapes: equal streams are shared, not rebuilt per tensor
def _tensor_stream(dtype: str, shape: tuple[int, ...], _zip64_limit: int) -> TensorStream:
    numel = 1
    for d in shape:
        numel *= d
    data_len = nbytes_of(dtype, numel)
    records = [("data.pkl", tensor_pickle(dtype, shape)), *_SMALL_RECORDS]
    head = bytearray()
    central = bytearray()
    for name, content in records:
        raw = f"{ARCHIVE}/{name}".encode()
        crc = zlib.crc32(content)
        central += _central_entry(raw, crc, len(content), len(head))
        head += _local_header(raw, crc, len(content), len(head)) + content
    data_name = f"{ARCHIVE}/data/0".encode()
    data_header_at = len(head)
    crc_in_head = data_header_at + 14
    head += _local_header(data_name, 0, data_len, data_header_at)
    crc_in_tail = len(central) + 16
    central += _central_entry(data_name, 0, data_len, data_header_at)
    cd_offset = len(head) + data_len
    n = len(records) + 1
    eocd64_at = cd_offset + len(central)
    tail = bytes(central)
    tail += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(central), cd_offset)
    tail += struct.pack("<IIQI", 0x07064B50, 0, eocd64_at, 1)
    tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), cd_offset if cd_offset < ZIP64_LIMIT else _ZIP64_MARK, 0)
    return TensorStream(bytes(head), data_len, tail, crc_in_head, crc_in_tail)


# ---------------------------------------------------------------------------------------------- file layout


@dataclass(frozen=True)
class StreamPlace:
    """Where one tensor's stream lies in its `.distcp` file (absolute offsets)."""

    name: str
    offset: int
    stream: TensorStream

    @property
    def data_begin(self) -> int:
        return self.offset + len(self.stream.head)

    @property
    def end(self) -> int:
        return self.offset + self.stream.length


@dataclass(frozen=True)
class DcpFileLayout(FileLayout):
    """A `.distcp` file laid out in advance: `tensors` are the data slots (what the engine fills),
    `streams` the zip streams around them; `header` is the first stream's bytes up to its data entry."""

    streams: tuple[StreamPlace, ...] = ()


def layout_dcp_file(file: str, tensors: Sequence[TensorInfo]) -> DcpFileLayout:
    """Place one stream per tensor, in the given order, each starting 64-aligned."""
    places: list[StreamPlace] = []
    slots: list[TensorInfo] = []
    offset = 0
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise PlanError(f"Cannot lay out {file}: tensor name {t.name!r} appears twice. Rename it.", tensor=t.name)
        seen.add(t.name)
        if not writable(t.dtype):
            raise PlanError(
                f"Cannot lay out {file}: tensor {t.name!r} is {t.dtype}, which a DCP checkpoint (torch.save) cannot store. "
                "Cast it (dtype=... or M.Cast) or write safetensors instead.",
                tensor=t.name,
            )
        offset += -offset % ALIGNMENT
        stream = tensor_stream(t.dtype, t.shape)
        place = StreamPlace(t.name, offset, stream)
        places.append(place)
        slots.append(TensorInfo(t.name, t.dtype, tuple(t.shape), file, place.data_begin, place.data_begin + stream.data_len))
        offset = place.end
    header = places[0].stream.head[: places[0].stream.crc_in_head] if places else b""
    return DcpFileLayout(file, header, tuple(slots), offset, tuple(places))


# ---------------------------------------------------------------------------------------------- writer


class DcpShardWriter(SafetensorsWriter):
    """Writes one `.distcp` file laid out in advance; the engine fills data slots like a safetensors shard.

    The streams' fixed bytes (and the padding between streams) are written when the file is opened; on
    `commit()` every data slot is read back once to compute its CRC-32, the CRCs are patched in, and the
    file is synced and renamed, as a safetensors shard is.
    """

    def __init__(self, folder: str | os.PathLike, layout: FileLayout) -> None:
        if not isinstance(layout, DcpFileLayout):
            raise PlanError(f"Cannot write {layout.file} as DCP: its layout was made for safetensors. Re-plan with to='dcp'.")
        self.folder = Path(folder)
        self.layout = layout
        self.final_path = self.folder / layout.file
        self.partial_path = temp_path(self.final_path)
        self._by_name = layout.by_name()
        self._written = dict.fromkeys(self._by_name, 0)
        self._fd = claim_temp(self.partial_path, flags=os.O_RDWR)  # read back for the CRCs at commit
        try:
            preallocate(self._fd, layout.size)
            places = layout.streams
            for k, place in enumerate(places):
                gap_end = places[k + 1].offset if k + 1 < len(places) else layout.size
                self._pwrite(place.stream.head, place.offset)
                self._pwrite(place.stream.tail + bytes(gap_end - place.end), place.data_begin + place.stream.data_len)
        except BaseException:
            self.abort()
            raise

    def takes_direct_writes(self) -> bool:
        """No: the commit reads every data slot back for its CRC, which then finds it in the page cache."""
        return False

    def _crc_of(self, fd: int, begin: int, length: int, buffer: bytearray) -> int:
        crc = 0
        done = 0
        view = memoryview(buffer)
        while done < length:
            want = min(length - done, len(buffer))
            got = os.preadv(fd, [view[:want]], begin + done)
            if got <= 0:
                raise PlanError(f"Cannot finish {self.layout.file}: it is shorter than planned (was it truncated?).", file=self.layout.file)
            crc = zlib.crc32(view[:got], crc)
            done += got
        return crc

    def commit(self, *, sync_dir: bool = True) -> Path:
        """Check completeness, patch every stream's data CRC, fsync, rename to the final name."""
        missing = self.missing()
        if missing or self._fd is None:
            return super().commit(sync_dir=sync_dir)  # raises, naming what is missing
        try:  # read back through the descriptor created exclusively, not the name (another process could swap it)
            buffer = bytearray(min(CRC_BUFFER_BYTES, max((p.stream.data_len for p in self.layout.streams), default=1) or 1))
            for place in self.layout.streams:
                crc = struct.pack("<I", self._crc_of(self._fd, place.data_begin, place.stream.data_len, buffer))
                os.pwrite(self._fd, crc, place.offset + place.stream.crc_in_head)
                os.pwrite(self._fd, crc, place.data_begin + place.stream.data_len + place.stream.crc_in_tail)
        except BaseException:
            self.abort()
            raise
        return super().commit(sync_dir=sync_dir)


# ---------------------------------------------------------------------------------------------- commit


@dataclass(frozen=True)
class ObjectSource:
    """A non-tensor entry to copy: its name and where its torch.save stream lies in a source file."""

    name: str
    path: Path
    offset: int
    length: int


def _write_atomic(path: Path, chunks: Iterable[bytes]) -> None:
    def counted() -> Iterable[bytes]:
        for chunk in chunks:
            yield chunk
            IO.add_written(len(chunk))

    atomic_write(path, counted(), sync_dir=False)  # write_metadata syncs the folder after `.metadata`


def write_objects(dest: Path, file: str, objects: Sequence[ObjectSource]) -> dict[str, tuple[str, int, int]]:
    """Copy the objects' streams (verbatim, 64-aligned) into `dest/file`; returns name -> (file, offset, length)."""
    places: dict[str, tuple[str, int, int]] = {}
    fds: dict[Path, int] = {}

    def chunks() -> Iterable[bytes]:
        at = 0
        for obj in objects:
            pad = -at % ALIGNMENT
            if pad:
                yield bytes(pad)
                at += pad
            fd = fds.get(obj.path)
            if fd is None:
                fd = fds[obj.path] = open_for_read(obj.path)
            yield read_at(fd, obj.length, obj.offset)
            places[obj.name] = (file, at, obj.length)
            at += obj.length

    try:
        _write_atomic(dest / file, chunks())
    finally:
        for fd in fds.values():
            os.close(fd)
    return places


def write_metadata(
    dest: Path,
    layouts: Sequence[DcpFileLayout],
    objects: dict[str, tuple[str, int, int]],
    paths: dict[str, tuple] | None = None,
) -> Path:
    """Write `.metadata` (DCP's own dataclasses, pickled) for the laid-out files and copied objects; last, atomically.

    `paths` gives the nested state-dict path of an entry (DCP's planner_data) when known; other entries are
    flat keys, which load the same way into any (nested or flat) state dict.
    """
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ..dtypes import to_torch

    paths = paths or {}
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for layout in layouts:
        for slot, place in zip(layout.tensors, layout.streams, strict=True):
            origin = torch.Size([0] * len(slot.shape))
            size = torch.Size(slot.shape)
            entries[slot.name] = TensorStorageMetadata(TensorProperties(dtype=to_torch(slot.dtype)), size, [ChunkStorageMetadata(origin, size)])
            storage[MetadataIndex(slot.name, origin, 0)] = _StorageInfo(layout.file, place.offset, place.stream.length)
    for name, (file, offset, length) in objects.items():
        entries[name] = BytesStorageMetadata()
        storage[MetadataIndex(name)] = _StorageInfo(file, offset, length)
    planner_data = {name: tuple(paths.get(name) or (name,)) for name in entries}
    metadata = Metadata(state_dict_metadata=entries, planner_data=planner_data, storage_data=storage, version="1.0.0")
    target = dest / METADATA_NAME
    _write_atomic(target, [pickle.dumps(metadata)])
    fsync_dir(dest)
    return target


def source_objects(reader: Any) -> tuple[list[ObjectSource], list[str]]:
    """The non-tensor entries a source reader can hand over verbatim (DCP sources only), and warnings."""
    get = getattr(reader, "object_sources", None)
    if get is None:
        return [], []
    found, warnings = get()
    return [ObjectSource(*item) for item in found], list(warnings)


def commit_files(n_data_files: int, objects: bool) -> list[str]:
    """Files written at commit, in order: the objects file (when there are objects), then `.metadata`."""
    return [dcp_file_name(n_data_files), METADATA_NAME] if objects else [METADATA_NAME]


def commit_dcp(dest: Path, layouts: Sequence[DcpFileLayout], reader: Any = None, *, objects: bool = True) -> list[str]:
    """Finish a DCP folder whose data files are complete: copy the source's objects, then write `.metadata`.

    `reader` (the source's) supplies the objects and the nested state-dict paths of entries it recorded;
    returns the names written, `.metadata` last.
    """
    found = source_objects(reader)[0] if objects else []
    names = commit_files(len(layouts), bool(found))
    placed = write_objects(dest, names[0], found) if found else {}
    path_of = getattr(reader, "planner_path", None)
    paths: dict[str, tuple] = {}
    if path_of is not None:
        for name in [t.name for layout in layouts for t in layout.tensors] + list(placed):
            path = path_of(name)
            if path and ".".join(map(str, path)) == name:
                paths[name] = path
    write_metadata(dest, layouts, placed, paths)
    return names


__all__ = [
    "commit_dcp", "commit_files", "source_objects",
    "DcpFileLayout", "DcpShardWriter", "ObjectSource", "StreamPlace", "TensorStream", "dcp_file_name", "layout_dcp_file",
    "tensor_pickle", "tensor_stream", "writable", "write_metadata", "write_objects",
]


_OWNED = re.compile(r"__\d+_\d+\.distcp")


class DcpOutput(OutputFormat):
    """torch.distributed.checkpoint: `__0_<k>.distcp` data files, the source's non-tensor entries (with
    rest='keep') in one more file, and `.metadata` written last as the commit marker."""

    name = "dcp"
    title = "DCP"
    label = " (DCP)"
    keeps_header_metadata = False

    def file_name(self, k: int, n: int) -> str:
        return dcp_file_name(k)

    def owns(self, name: str) -> bool:
        """`__<rank>_<k>.distcp` data files and `.metadata`."""
        return name == METADATA_NAME or _OWNED.fullmatch(name) is not None

    def layout_file(self, name: str, tensors: Sequence[TensorInfo], metadata: Mapping[str, str] | None = None) -> FileLayout:
        return layout_dcp_file(name, tensors)

    def open_writer(self, folder: str | os.PathLike, layout: FileLayout) -> SafetensorsWriter:
        return DcpShardWriter(folder, layout)

    def carried_objects(self, reader: Any, rest: str) -> tuple[list[Any], list[str]]:
        return source_objects(reader) if rest == "keep" else ([], [])

    def commit_files(self, layouts: Sequence[FileLayout], objects: bool) -> list[str]:
        return commit_files(len(layouts), objects)

    def commit(self, dest: Path, layouts: Sequence[FileLayout], reader: Any, *, objects: bool) -> bool:
        commit_dcp(dest, layouts, reader, objects=objects)
        return True
