"""torch.save zip files (`.pt`, `.pth`, `.bin`, `.ckpt`): listed and read without executing their pickle.

A torch.save file is an uncompressed zip: `<prefix>/data.pkl` (the object tree) and one `<prefix>/data/<key>`
entry per storage. The zip directory is parsed here with counted preads, the pickle goes through the
inert unpickler (`restricted_pickle`), and each tensor becomes a strided view of its storage entry.

Catalog conventions for this format: tensor names are the dotted paths of the object tree
(`state_dict.model.layers.0.weight`, `optimizer_states.0.state.3.exp_avg`; for a plain state_dict the
keys). `TensorInfo.begin/end` are the tensor's raw bytes when it is contiguous, else the whole storage
entry (the reader materialises strided views). Extra columns: `storage` (storage key) and `shared_with`
(other tensors over the same storage: tied weights, views).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..catalog import Catalog, FileInfo, TensorInfo
from ..dtypes import _TORCH_NAMES, DTYPE_BITS
from ..errors import CannotRead, CheckpointError
from ..iostats import open_for_read, read_at
from .pickle.unpickler import (
    PickleResult,
    Placeholder,
    TensorRef,
    UnsupportedTensor,
    _short_repr,
    load_inert,
)
from .shape_bounds import index_problem, shape_problem

ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC = b"\x80\x02\x8a\x0a"
SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl")
MAX_PICKLE_BYTES = 1 << 30
# Pickles that hold only metadata are capped far lower: Lightning's sharded meta.pt (loops, callbacks,
# no weights) and the one-tensor stream of each DCP chunk (a few hundred bytes when torch writes it).
MAX_META_PICKLE_BYTES = 64 << 20
MAX_CHUNK_PICKLE_BYTES = 1 << 20
MAX_TREE_NODES = 5_000_000
MAX_INFLATE_RATIO = 64  # pickles deflate 3-10x; more is a bomb
MAX_PATH_CHARS = 4096  # dotted names longer than this are not real checkpoint keys

_CODE_OF_TORCH = {name: code for code, name in _TORCH_NAMES.items()}
_CODE_OF_TORCH.update({"float": "F32", "double": "F64", "half": "F16", "long": "I64", "int": "I32", "short": "I16"})


def dtype_code(torch_name: str) -> str | None:
    """The safetensors code for a torch dtype name, or None when safetensors has none (complex128, qint8 ...)."""
    return _CODE_OF_TORCH.get(torch_name)


# ---------------------------------------------------------------------------------------------- zip directory


@dataclass(frozen=True)
class ZipMember:
    """One entry of a zip archive; offsets are absolute in the file that holds the archive."""

    name: str
    header_offset: int
    compressed_size: int
    size: int
    method: int
    archive_end: int = -1  # absolute end of the archive holding it (-1: unknown); its data must end before


_zip_fail = CannotRead("torch.save file", "The file is truncated or not a torch checkpoint: re-download or re-save it.")


def read_members(fd: int, source: str, base: int = 0, length: int | None = None) -> dict[str, ZipMember]:
    """The central directory of the zip archive stored at [base, base+length) of an open file."""
    if length is None:
        length = os.fstat(fd).st_size - base
    if length < 22:
        raise _zip_fail(source, f"{length} bytes is too short for a zip archive")
    tail_len = 22
    tail = read_at(fd, tail_len, base + length - tail_len)
    pos = 0 if tail[:4] == b"PK\x05\x06" else -1
    if pos < 0:  # an archive comment: search the last 64 KiB
        tail_len = min(length, 22 + 65535)
        tail = read_at(fd, tail_len, base + length - tail_len)
        pos = tail.rfind(b"PK\x05\x06", 0, len(tail) - 18)  # a whole 22-byte record must follow
        if pos < 0:
            raise _zip_fail(source, "no zip end-of-directory record")
    eocd_at = length - tail_len + pos  # relative to base
    (_, disk, _, _, n_entries, cd_size, cd_offset, _) = struct.unpack("<4sHHHHIIH", tail[pos : pos + 22])
    end_of_cd = eocd_at
    # A zip64 end record (torch writes one even for small files) sits right before a 20-byte locator.
    locator = read_at(fd, 20, base + eocd_at - 20) if eocd_at >= 20 + 56 else b""
    if locator[:4] == b"PK\x06\x07":
        record = read_at(fd, 56, base + eocd_at - 20 - 56)
        if record[:4] != b"PK\x06\x06":
            (z64_at,) = struct.unpack("<Q", locator[8:16])
            if z64_at + 56 > length:
                raise _zip_fail(source, "a damaged zip64 end-of-directory record")
            record = read_at(fd, 56, base + z64_at)
            if record[:4] != b"PK\x06\x06":
                raise _zip_fail(source, "a damaged zip64 end-of-directory record")
            end_of_cd = z64_at
        else:
            end_of_cd = eocd_at - 20 - 56
        n_entries, cd_size, cd_offset = struct.unpack("<QQQ", record[32:56])
    elif n_entries == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        raise _zip_fail(source, "a zip64 archive without its locator")
    # Data written before the archive (a stream appended to a file) shifts every offset by `delta`.
    cd_at = end_of_cd - cd_size
    if cd_at < 0 or cd_size > length:
        raise _zip_fail(source, "the zip directory lies outside the archive")
    delta = cd_at - cd_offset
    raw = read_at(fd, cd_size, base + cd_at)
    members: dict[str, ZipMember] = {}
    at = 0
    for _ in range(n_entries):
        if raw[at : at + 4] != b"PK\x01\x02" or at + 46 > len(raw):
            raise _zip_fail(source, "a damaged zip directory entry")
        (method, csize, usize, nlen, xlen, clen, lho) = struct.unpack("<6xH8xIIHHH8xI", raw[at + 4 : at + 46])
        name = raw[at + 46 : at + 46 + nlen].decode("utf-8", "replace")
        extra = raw[at + 46 + nlen : at + 46 + nlen + xlen]
        if 0xFFFFFFFF in (csize, usize, lho):
            usize, csize, lho = _zip64_extra(extra, usize, csize, lho, source)
        offset = base + lho + delta
        if lho + delta < 0 or lho + delta + 30 + csize > length:
            raise _zip_fail(source, f"zip entry {name!r} lies outside the archive")
        members[name] = ZipMember(name, offset, csize, usize, method, base + length)
        at += 46 + nlen + xlen + clen
    return members


def _zip64_extra(extra: bytes, usize: int, csize: int, lho: int, source: str) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[at : at + 4])
        body = extra[at + 4 : at + 4 + size]
        if tag == 1:
            values = list(struct.unpack(f"<{len(body) // 8}Q", body[: len(body) // 8 * 8]))
            if usize == 0xFFFFFFFF:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF:
                csize = values.pop(0)
            if lho == 0xFFFFFFFF:
                lho = values.pop(0)
            return usize, csize, lho
        at += 4 + size
    raise _zip_fail(source, "a zip64 entry without its size record")


def member_data_offset(fd: int, source: str, member: ZipMember) -> int:
    """Absolute offset of a member's data (after its local header)."""
    header = read_at(fd, 30, member.header_offset)
    if header[:4] != ZIP_MAGIC:
        raise _zip_fail(source, f"the local header of {member.name!r} is damaged")
    nlen, xlen = struct.unpack("<HH", header[26:30])
    start = member.header_offset + 30 + nlen + xlen
    if member.archive_end >= 0 and start + member.compressed_size > member.archive_end:
        raise _zip_fail(source, f"the data of zip entry {member.name!r} runs past the end of the archive")
    return start


# ---------------------------------------------------------------------------------------------- archives


@dataclass
class TorchArchive:
    """One torch.save archive: its members, the inert object tree, and where each storage's bytes are."""

    source: str  # the file, for messages
    prefix: str  # '<archive name>/' in front of every member
    members: dict[str, ZipMember]
    pickle: PickleResult
    _data_offsets: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def root(self) -> Any:
        return self.pickle.root

    def storage_range(self, fd: int, key: str) -> tuple[int, int]:
        """(absolute offset, byte size) of storage `key`'s data."""
        got = self._data_offsets.get(key)
        member = self.members.get(f"{self.prefix}data/{key}")
        if member is None:
            raise CheckpointError(
                f"Cannot read torch.save file {self.source}: its pickle refers to storage {key!r} but the archive has no "
                f"entry {self.prefix}data/{key}. The file is damaged: re-download or re-save it.",
                file=self.source,
            )
        if member.method != 0:
            raise CheckpointError(
                f"Cannot read storage {key!r} of {self.source}: it is compressed in the zip. torch.save never compresses; "
                "re-save the file with torch.save (or re-zip it without compression).",
                file=self.source,
            )
        if got is None:
            got = member_data_offset(fd, self.source, member)
            self._data_offsets[key] = got
        return got, member.size


def open_archive(
    fd: int, source: str, base: int = 0, length: int | None = None, *, max_pickle_bytes: int = MAX_PICKLE_BYTES
) -> TorchArchive:
    """Parse the torch.save archive at [base, base+length) of an open file, without executing its pickle.

    `max_pickle_bytes` caps data.pkl (inflated): archives that should hold only metadata pass a lower cap.
    """
    members = read_members(fd, source, base, length)
    pkl_names = [n for n in members if n == "data.pkl" or n.endswith("/data.pkl")]
    if not pkl_names:
        raise CheckpointError(
            f"Cannot read {source}: it is a zip file but not a torch.save checkpoint (no data.pkl entry).", file=source
        )
    pkl_name = min(pkl_names, key=len)
    prefix = pkl_name[: -len("data.pkl")]
    byteorder = members.get(prefix + "byteorder")
    if byteorder is not None and byteorder.size <= 16:
        order = _member_bytes(fd, source, byteorder)
        if order.strip() not in (b"little", b""):
            raise CheckpointError(
                f"Cannot read {source}: it was saved on a {order.decode('ascii', 'replace')}-endian machine; the workbench "
                "reads little-endian checkpoints only. Re-save it on a little-endian machine.",
                file=source,
            )
    member = members[pkl_name]
    if member.size > max_pickle_bytes:
        raise _zip_fail(source, f"data.pkl claims {member.size} bytes, above the {max_pickle_bytes}-byte limit for this kind of pickle")
    # The objects it builds are bounded by the bytes on disk (a deflated pickle may inflate 64:1; see pickle/bounds.py).
    result = load_inert(_member_bytes(fd, source, member), source=source, stored=member.compressed_size)
    return TorchArchive(source, prefix, members, result)


def _member_bytes(fd: int, source: str, member: ZipMember) -> bytes:
    start = member_data_offset(fd, source, member)
    raw = read_at(fd, member.compressed_size, start)
    if member.method == 0:
        return raw
    if member.method == 8:
        if member.size > MAX_INFLATE_RATIO * member.compressed_size + (1 << 20):
            raise _zip_fail(
                source, f"entry {member.name!r} claims to inflate {member.compressed_size} bytes into {member.size} "
                "(a decompression bomb, not a pickle)"
            )
        try:
            return zlib.decompressobj(-15).decompress(raw, member.size)
        except zlib.error as exc:
            raise _zip_fail(source, f"entry {member.name!r} does not decompress ({exc})") from None
    raise _zip_fail(source, f"entry {member.name!r} uses zip compression method {member.method}")


# ---------------------------------------------------------------------------------------------- object tree


@dataclass
class TreeContents:
    """What an object tree holds, by dotted path: tensors, tensor-likes we cannot read, and plain leaves."""

    tensors: list[tuple[str, TensorRef]] = field(default_factory=list)
    unsupported: list[tuple[str, UnsupportedTensor]] = field(default_factory=list)
    leaves: list[tuple[str, Any]] = field(default_factory=list)
    truncated: bool = False


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield _key_text(key), value
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield str(i), value
    elif isinstance(obj, Placeholder):
        yield from ((_key_text(k), v) for k, v in obj.wb_items.items())
        yield from ((str(i), v) for i, v in enumerate(obj.wb_list))
        state = obj.wb_state
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            for part in state:
                if part:
                    yield from ((_key_text(k), v) for k, v in part.items())
        elif isinstance(state, dict):
            yield from ((_key_text(k), v) for k, v in state.items())
        elif state is not None:
            yield "state", state
        if not obj.wb_items and not obj.wb_list and state is None:
            yield from ((str(i), v) for i, v in enumerate(obj.wb_args))


def _key_text(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, (int, float, bool)) or key is None:
        return str(key) if not isinstance(key, int) or key.bit_length() <= 256 else _short_repr(key)
    return _short_repr(key, 200)


def walk_tree(root: Any, prefix: str = "") -> TreeContents:
    """Every tensor and leaf under `root`, named by dotted path; each container is visited once."""
    out = TreeContents()
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(prefix, root)]
    nodes = 0
    while stack:
        path, obj = stack.pop()
        nodes += 1
        if nodes > MAX_TREE_NODES:
            out.truncated = True
            break
        if len(path) > MAX_PATH_CHARS:  # a crafted chain of nesting would cost O(depth**2) in names
            out.truncated = True
            continue
        if isinstance(obj, TensorRef):
            out.tensors.append((path, obj))
        elif isinstance(obj, UnsupportedTensor):
            out.unsupported.append((path, obj))
        elif isinstance(obj, (dict, list, tuple, Placeholder)):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            children = list(_children(obj))
            if not children:
                out.leaves.append((path, obj))
            for key, value in reversed(children):
                stack.append((f"{path}.{key}" if path else key, value))
        else:
            out.leaves.append((path, obj))
    return out


# ---------------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorPlace:
    """Where one catalogued tensor's elements are: a strided view of a storage at `data_offset`."""

    ref: TensorRef
    data_offset: int  # absolute offset of the storage's first byte
    itemsize: int

    @property
    def contiguous(self) -> bool:
        return is_row_major(self.ref.shape, self.ref.stride)

    @property
    def begin(self) -> int:
        return self.data_offset + self.ref.storage_offset * self.itemsize


def is_row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when `stride` lays `shape` out densely in C order (size-1 dims may have any stride)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size == 0:
            return True
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def strided_span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Number of elements from the first to the last element a strided view touches (0 when empty)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def gather_strided(span: bytes, shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> bytes:
    """The row-major bytes of a strided view over `span` (which starts at the view's first element)."""
    import numpy as np

    items = np.frombuffer(span, dtype=np.dtype(f"V{itemsize}"))
    view = np.lib.stride_tricks.as_strided(items, shape=shape, strides=tuple(s * itemsize for s in stride), writeable=False)
    return np.ascontiguousarray(view).tobytes()


def read_place(fd: int, place: TensorPlace, nbytes: int) -> bytes:
    """A tensor's row-major bytes: one pread when contiguous, else the strided span gathered."""
    if place.contiguous:
        return read_at(fd, nbytes, place.begin)
    span = strided_span(place.ref.shape, place.ref.stride)
    raw = read_at(fd, span * place.itemsize, place.begin)
    return gather_strided(raw, place.ref.shape, place.ref.stride, place.itemsize)


def place_tensor(fd: int, archive: TorchArchive, name: str, ref: TensorRef, source: str) -> TensorPlace:
    """Check a tensor against its storage entry (bounds, dtype) and return where its bytes are."""
    code = dtype_code(ref.dtype)
    if code is None or DTYPE_BITS[code] % 8:
        raise CheckpointError(
            f"Cannot list tensor {name!r} of {source}: dtype torch.{ref.dtype} has no safetensors equivalent.",
            file=source,
            tensor=name,
        )
    itemsize = DTYPE_BITS[code] // 8
    problem = (
        shape_problem(ref.shape, DTYPE_BITS[code]) or index_problem(ref.stride, "stride")
        or index_problem((ref.storage_offset, ref.storage.numel), "storage offset or size")
    )
    if problem:
        raise CheckpointError(
            f"Cannot list tensor {name!r} of {source}: {problem}. The file is damaged or crafted: re-save it from a trusted copy.",
            file=source,
            tensor=name,
        )
    data_offset, entry_size = archive.storage_range(fd, ref.storage.key)
    storage_bytes = ref.storage.numel * (1 if ref.storage.untyped else _storage_itemsize(ref.storage.dtype))
    if len(ref.shape) != len(ref.stride):
        raise CheckpointError(
            f"Cannot list tensor {name!r} of {source}: size {list(ref.shape)} and stride {list(ref.stride)} differ in rank. "
            "The file is damaged.",
            file=source,
            tensor=name,
        )
    end = (ref.storage_offset + strided_span(ref.shape, ref.stride)) * itemsize
    if storage_bytes > entry_size or (strided_span(ref.shape, ref.stride) and end > storage_bytes):
        raise CheckpointError(
            f"Cannot list tensor {name!r} of {source}: it reaches byte {end} of storage {ref.storage.key!r}, which holds "
            f"{min(storage_bytes, entry_size)} bytes. The file is damaged or truncated: re-download or re-save it.",
            file=source,
            tensor=name,
        )
    nbytes = _prod(ref.shape) * itemsize
    file_end = archive.members[f"{archive.prefix}data/{ref.storage.key}"].archive_end
    if nbytes > entry_size and nbytes > file_end:
        raise RepeatedElements(
            f"Cannot list tensor {name!r} of {source}: it is a view of {nbytes} bytes over a storage of {entry_size} "
            "(its strides repeat elements, as expand() makes), so reading it would allocate more than the whole file "
            "holds. Save it with .contiguous() or .clone() if it is needed.",
            file=source,
            tensor=name,
        )
    return TensorPlace(ref, data_offset, itemsize)


class RepeatedElements(CheckpointError):
    """A view whose strides repeat storage elements is larger than its whole file: listing it is refused."""


def _storage_itemsize(torch_name: str) -> int:
    code = dtype_code(torch_name)
    if code is not None:
        return DTYPE_BITS[code] // 8
    return {"complex128": 16, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1}.get(torch_name, 1)


class TorchZipReader:
    """Reads catalogued tensors of one torch.save file with counted preads; strided views are gathered."""

    def __init__(self, path: Path, places: dict[str, TensorPlace], archive: TorchArchive) -> None:
        self.path = path
        self.places = places
        self.archive = archive
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _file(self) -> int:
        with self._lock:
            if self._fd is None:
                try:
                    self._fd = open_for_read(self.path)
                except OSError as exc:
                    raise CheckpointError(f"Cannot open {self.path}: {exc.strerror}. Was the checkpoint moved or deleted?", file=str(self.path)) from None
            return self._fd

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's row-major bytes, `info.nbytes` long."""
        place = self.places[info.name]
        try:
            return read_place(self._file(), place, info.nbytes)
        except EOFError:
            raise CheckpointError(
                f"Cannot read tensor {info.name!r} from {self.path}: the file ended early (it changed after it was opened). "
                "Re-open the checkpoint.",
                file=str(self.path),
                tensor=info.name,
            ) from None

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """The raw byte range when the tensor is a contiguous run of its storage, else None."""
        place = self.places[info.name]
        if not place.contiguous:
            return None
        return (self.path.resolve(), place.begin, place.begin + info.nbytes)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------- files


def sniff(path: Path) -> bytes:
    """The first bytes of a file ('' when unreadable)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(64)
    except OSError:
        return b""


def detect(path: Path) -> bool:
    """True for a torch.save zip, a legacy torch.save pickle, or a file with a torch suffix."""
    if not path.is_file():
        return False
    head = sniff(path)
    if head.startswith(LEGACY_MAGIC):
        return True
    if head.startswith(ZIP_MAGIC):
        nlen = struct.unpack("<H", head[26:28])[0] if len(head) >= 30 else 0
        return head[30 : 30 + nlen].endswith(b"data.pkl") or path.suffix in SUFFIXES
    # A damaged file with a torch suffix is claimed so that opening it explains what is wrong with it,
    # unless it is really safetensors under another name.
    return path.suffix in SUFFIXES and not (len(head) > 8 and head[8:9] == b"{")


def _refuse_non_zip(path: Path, head: bytes) -> None:
    source = str(path)
    if head.startswith(LEGACY_MAGIC) or head[:2] == b"\x80\x02":
        raise CheckpointError(
            f"Cannot open {source}: it is a legacy (pre-1.6, non-zip) torch.save file, whose tensors cannot be located "
            "without running its pickle. Convert it once in a trusted environment: "
            "torch.save(torch.load(path, weights_only=True), new_path).",
            file=source,
        )
    if not head.startswith(ZIP_MAGIC):
        raise CheckpointError(
            f"Cannot open {source}: it is not a torch.save zip file (it starts with {head[:8]!r}). "
            "Check the path; re-download or re-save the file if it should be a checkpoint.",
            file=source,
        )


@dataclass
class TorchFile:
    """A parsed torch.save file: the object tree, its tensors by name, and what would need trust to load."""

    path: Path
    archive: TorchArchive
    contents: TreeContents
    places: dict[str, TensorPlace]
    skipped: list[str]  # tensors that cannot be listed, with the reason

    @property
    def root(self) -> Any:
        return self.archive.root

    @property
    def unsafe_globals(self) -> list[str]:
        return self.archive.pickle.unsafe_globals


def inspect_file(path: str | os.PathLike, *, max_pickle_bytes: int = MAX_PICKLE_BYTES) -> TorchFile:
    """Parse a torch.save file's directory and pickle (inertly) and place every tensor; reads no tensor data."""
    p = Path(path)
    source = str(p)
    _refuse_non_zip(p, sniff(p))
    try:
        fd = open_for_read(p)
    except OSError as exc:
        raise CheckpointError(f"Cannot open {source}: {exc.strerror}. Check the path and permissions.", file=source) from None
    try:
        archive, contents, places, skipped = inspect_open(fd, source, max_pickle_bytes=max_pickle_bytes)
    finally:
        os.close(fd)
    return TorchFile(p, archive, contents, places, skipped)


def inspect_open(
    fd: Any, source: str, *, length: int | None = None, max_pickle_bytes: int = MAX_PICKLE_BYTES, before_places: Any = None
) -> tuple[TorchArchive, TreeContents, dict[str, TensorPlace], list[str]]:
    """`inspect_file` on an open file or a range handle (`iostats.read_at`): the archive, its object tree,
    tensor places and skipped tensors. `before_places(archive)` runs once the directory is known (a remote
    handle fetches every member's local header there, in parallel)."""
    try:
        archive = open_archive(fd, source, length=length, max_pickle_bytes=max_pickle_bytes)
        if before_places is not None:
            before_places(archive)
        contents = walk_tree(archive.root)
        places: dict[str, TensorPlace] = {}
        skipped: list[str] = []
        for name, ref in contents.tensors:
            if name in places:
                skipped.append(f"{name!r}: a second object has the same dotted name")
                continue
            try:
                places[name] = place_tensor(fd, archive, name or "tensor", ref, source)
            except RepeatedElements:
                skipped.append(f"{name!r}: a view that repeats storage elements is larger than the file")
                continue
            except CheckpointError as err:
                if dtype_code(ref.dtype) is None:
                    skipped.append(f"{name!r}: torch.{ref.dtype} has no safetensors dtype")
                    continue
                raise err
    except EOFError:
        raise _zip_fail(source, "the file ends inside the archive") from None
    return archive, contents, places, skipped


def catalog_of(tf: TorchFile, *, size: int | None = None) -> Catalog:
    """The Catalog of a parsed torch.save file (format 'torch'); `size` for a file that is not on disk."""
    tensors: dict[str, TensorInfo] = {}
    rel = tf.path.name
    by_storage: dict[str, list[str]] = {}
    reader_places: dict[str, TensorPlace] = {}
    for name, place in sorted(tf.places.items(), key=lambda kv: (kv[1].begin, kv[0])):
        ref = place.ref
        code = dtype_code(ref.dtype)
        assert code is not None
        shown = name or "tensor"
        nbytes = (DTYPE_BITS[code] * _prod(ref.shape) + 7) // 8
        if place.contiguous:
            begin, end = place.begin, place.begin + nbytes
        else:
            begin, end = place.data_offset, place.data_offset + tf.archive.members[f"{tf.archive.prefix}data/{ref.storage.key}"].size
        tensors[shown] = TensorInfo(shown, code, ref.shape, rel, begin, end)
        reader_places[shown] = place
        by_storage.setdefault(ref.storage.key, []).append(shown)
    storage_col = {}
    shared_col = {}
    for key, names in by_storage.items():
        for name in names:
            storage_col[name] = key
            shared_col[name] = ", ".join(n for n in names if n != name)
    warnings: list[str] = []
    metadata: dict[str, str] = {}
    unsafe = tf.unsafe_globals
    metadata["weights_only"] = "no" if unsafe else "yes"
    if unsafe:
        metadata["unsafe_globals"] = ", ".join(unsafe)
        warnings.append(
            f"{tf.path.name} needs untrusted code to load with torch: torch.load(weights_only=True) refuses its globals "
            f"{', '.join(unsafe[:5])}{' ...' if len(unsafe) > 5 else ''}. The workbench listed it without running any of them."
        )
    if tf.contents.unsupported:
        kinds = sorted({u.kind for _, u in tf.contents.unsupported})
        warnings.append(
            f"{len(tf.contents.unsupported)} tensor-like objects cannot be read in place and are not listed "
            f"({', '.join(kinds)}; e.g. {tf.contents.unsupported[0][0]!r})."
        )
    if tf.skipped:
        warnings.append(f"{len(tf.skipped)} tensors are not listed: {'; '.join(tf.skipped[:3])}{' ...' if len(tf.skipped) > 3 else ''}.")
    if tf.contents.truncated:
        warnings.append(
            f"The object tree of {tf.path.name} has more than {MAX_TREE_NODES} nodes or names longer than {MAX_PATH_CHARS} "
            "characters; those parts were not listed."
        )
    root = tf.root
    if isinstance(root, dict) and "pytorch-lightning_version" in root:
        metadata["lightning_version"] = str(root["pytorch-lightning_version"])
    size = tf.path.stat().st_size if size is None else size
    pkl = tf.archive.members[tf.archive.prefix + "data.pkl"]
    files = {rel: FileInfo(rel, size, pkl.compressed_size, len(tensors))}
    return Catalog(
        root=tf.path,
        format="torch",
        tensors=tensors,
        files=files,
        metadata=metadata,
        warnings=warnings,
        reader=TorchZipReader(tf.path, reader_places, tf.archive),
        columns={"storage": storage_col, "shared_with": shared_col},
    )


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def open_path(path: Path, *, max_pickle_bytes: int = MAX_PICKLE_BYTES) -> Catalog:
    """Open a torch.save file as a Catalog without executing its pickle."""
    return catalog_of(inspect_file(path, max_pickle_bytes=max_pickle_bytes))
