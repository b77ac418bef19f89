"""Single safetensors files: strict header parsing and validation, and byte-range reads.

The header is validated completely before any of it is used: a file that the reference reader would
refuse is refused here with a message naming the file, the tensor and the fault.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter, itemgetter
from pathlib import Path

from ..catalog import FileInfo, TensorInfo
from ..collector import gc_paused  # a 100k-tensor header makes ~1M acyclic objects: see there
from ..display import format_shape
from ..dtypes import DTYPE_BITS
from ..errors import CannotRead, CheckpointError
from ..iostats import open_for_read, read_at
from ..names import is_unicode_text
from .file_pool import FilePool
from .json_errors import json_problem
from .shape_bounds import INDEX_LIMIT, LIMIT, shape_problem

# The reference implementation refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100_000_000
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated safetensors header: tensors in data order, metadata, sizes."""

    tensors: list[TensorInfo]
    metadata: dict[str, str]
    header_bytes: int  # 8 + N
    file_size: int


_fail = CannotRead("safetensors file", "The file is corrupt or not a safetensors file: re-download or re-export it.")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _may_repeat_keys(raw: bytes, header: dict) -> bool:
    """False when the raw text cannot hold a repeated key (every entry key appears once per tensor).

    The counts are of raw text, so they stand for decoded keys only when the header has no escape at
    all: `"dt\\u0079pe"` decodes to `dtype` without containing it.
    """
    if b"\\" in raw:
        return True
    n_tensors = len(header) - ("__metadata__" in header)
    if raw.count(b'"__metadata__"') != ("__metadata__" in header):
        return True
    return any(raw.count(key) != n_tensors for key in (b'"data_offsets"', b'"dtype"', b'"shape"'))


def _refuse_lone_surrogates(path: str, header: dict) -> None:
    """Refuse names and metadata holding a lone UTF-16 surrogate (a `\\ud800` escape): JSON's escapes allow
    it, but it is no Unicode character, so no file name, terminal or output header can hold it (the reference
    reader refuses it too)."""
    metadata = header.get("__metadata__")
    for name in header:
        if not is_unicode_text(name):
            raise _fail(path, f"the tensor name {name!r} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                              "which is not a Unicode character")
    if isinstance(metadata, dict):
        for key, value in metadata.items():
            if not is_unicode_text(key) or (isinstance(value, str) and not is_unicode_text(value)):
                raise _fail(path, f"__metadata__ entry {key!r} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                  "escape), which is not a Unicode character")


def read_header(path: str | os.PathLike, *, rel: str | None = None, fd: int | None = None) -> SafetensorsHeader:
    """Parse and validate the header of one safetensors file, reading only the header bytes.

    `rel` is the name recorded in each TensorInfo.file (defaults to the file name).
    """
    spath = os.fspath(path)
    own_fd = fd is None
    try:
        if own_fd:
            try:
                fd = open_for_read(spath)
            except OSError as exc:
                raise CheckpointError(
                    f"Cannot open safetensors file {spath}: {exc.strerror}. Check the path and permissions.", file=spath
                ) from None
        file_size = os.fstat(fd).st_size
        if file_size < 8:
            raise _fail(spath, f"the file is {file_size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", read_at(fd, 8, 0))
        if n > MAX_HEADER_BYTES:
            raise _fail(spath, f"the header length field says {n} bytes, above the {MAX_HEADER_BYTES} byte limit")
        if 8 + n > file_size:
            raise _fail(spath, f"the header length field says {n} bytes but the file has only {file_size - 8} after it (truncated file?)")
        raw = read_at(fd, n, 8)
    finally:
        if own_fd and fd is not None:
            os.close(fd)
    tensors, metadata = parse_header_bytes(raw, spath, rel if rel is not None else os.path.basename(spath), 8 + n, file_size)
    return SafetensorsHeader(tensors, metadata, 8 + n, file_size)


def parse_header_bytes(
    raw: bytes, path: str, rel: str, data_start: int, file_size: int
) -> tuple[list[TensorInfo], dict[str, str]]:
    """Validate header JSON bytes; return tensors sorted by data offset, with absolute file offsets."""
    with gc_paused():
        return _parse_header_bytes(raw, path, rel, data_start, file_size)


# The header as writers lay it out (the reference, this workbench, huggingface_hub): `{"__metadata__":{...},"name":
# {"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},...}` without whitespace (then spaces as padding). Read
# entry by entry, straight into the table, without the tree json.loads builds: 10^6 tensors make ~600 bytes of
# dicts, lists and ints each that way (1 GB for a 70 MB header). Names with escapes, dimensions of more than 20
# digits, other key orders or whitespace go the general way, whose messages name every fault.
_INT = rb"(?:0|[1-9][0-9]{0,19})"  # JSON's integers (no leading zero), of at most 20 digits
_ENTRY = re.compile(
    rb'"([^"\\\x00-\x1f]*+)":\{"dtype":"([A-Za-z0-9_]{1,16})","shape":\[((?:' + _INT + rb"(?:," + _INT + rb')*)?)\],'
    rb'"data_offsets":\[(' + _INT + rb"),(" + _INT + rb')\]\}([,}])'
)
_STRING = rb'"(?:[^"\\\x00-\x1f]++|\\.)*+"'
_METADATA = re.compile(rb'"__metadata__":(\{(?:' + _STRING + rb":" + _STRING + rb",?)*+\})([,}])")


def _fast_entries(raw: bytes, rel: str, data_start: int) -> tuple[list[TensorInfo], dict | None] | None:
    """The header's tensors (in header order, offsets absolute) and raw metadata object, when it is laid out the
    common way (see `_ENTRY`); None when it is not (the caller then parses it as JSON). Values are not validated:
    `_fast_table` does that. Each TensorInfo is made straight from the match: no intermediate row per tensor."""
    if not raw.startswith(b"{"):
        return None
    pos, end = 1, len(raw.rstrip(b" "))
    if end < 2 or raw[end - 1] != 0x7D:  # '}'
        return None
    metadata = None
    if raw.startswith(b'"__metadata__"', 1):
        m = _METADATA.match(raw, 1)
        if m is None:
            return None
        try:
            metadata = json.loads(m.group(1), object_pairs_hook=_no_duplicates)
        except ValueError:  # not JSON (a trailing comma, a bad escape) or a repeated key (_DuplicateKey)
            return None
        pos = m.end()
        if m.group(2) == b"}":
            return ([], metadata) if pos == end else None
    elif raw.startswith(b"}", 1):
        return ([], None) if end == 2 else None
    tensors: list[TensorInfo] = []
    append = tensors.append
    match = _ENTRY.match
    shapes: dict[bytes, tuple[int, ...]] = {}  # one tuple per distinct shape: most tensors share a few
    dtypes: dict[bytes, str] = {}
    while True:
        m = match(raw, pos)
        if m is None:
            return None
        name, dtype, dims, begin, stop, after = m.groups()
        shape = shapes.get(dims)
        if shape is None:
            shape = shapes[dims] = tuple(int(d) for d in dims.split(b",")) if dims else ()
        code = dtypes.get(dtype)
        if code is None:
            code = dtypes[dtype] = dtype.decode("ascii")
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if text == "__metadata__":
            return None
        append(TensorInfo(text, code, shape, rel, data_start + int(begin), data_start + int(stop)))
        pos = m.end()
        if after == b"}":
            return (tensors, metadata) if pos == end else None


def _parse_header_bytes(
    raw: bytes, path: str, rel: str, data_start: int, file_size: int
) -> tuple[list[TensorInfo], dict[str, str]]:
    fast = _fast_entries(raw, rel, data_start)
    if fast is not None and _fast_table(fast[0], data_start, file_size):
        return fast[0], _metadata(path, fast[1])
    del fast
    return _parse_json_header(raw, path, rel, data_start, file_size)


def _metadata(path: str, metadata: object) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _fail(path, "__metadata__ must be an object mapping strings to strings")
    if any(not is_unicode_text(k) or not is_unicode_text(v) for k, v in metadata.items()):
        _refuse_lone_surrogates(path, {"__metadata__": metadata})
    return metadata


def _fast_table(tensors: list[TensorInfo], data_start: int, file_size: int) -> bool:
    """Sort `tensors` (from `_fast_entries`) into data order and check them; False when anything is off (a
    repeated name, an unknown dtype, an overflowing shape, offsets that do not tile the buffer), for the general
    parse to name. Every check of the general parse is made, on ints of at most 20 digits."""
    names = sorted([t.name for t in tensors])  # 8-12 bytes per name; a set would take 40
    if any(a == b for a, b in zip(names, islice(names, 1, None), strict=False)):
        return False
    del names
    previous = (0, 0)
    for t in tensors:
        if (t.begin, t.end) < previous:
            tensors.sort(key=attrgetter("begin", "end"))  # stable: empty tensors sharing an offset keep header order
            break
        previous = (t.begin, t.end)
    bits_of = DTYPE_BITS
    expected = data_start
    checked: dict[tuple[int, ...], int] = {}  # shape -> numel, once per distinct shape
    for t in tensors:
        bits = bits_of.get(t.dtype)
        numel = checked.get(t.shape)
        if numel is None:
            if shape_problem(t.shape, 8):
                return False
            numel = checked[t.shape] = math.prod(t.shape)
        if bits is None or numel * bits >= LIMIT or t.begin != expected or (numel * bits) % 8 or (numel * bits) // 8 != t.end - t.begin:
            return False
        expected = t.end
    return expected == file_size


def _parse_json_header(
    raw: bytes, path: str, rel: str, data_start: int, file_size: int
) -> tuple[list[TensorInfo], dict[str, str]]:
    # JSON may start with whitespace; the reference reader accepts it, so do we.
    if not raw.lstrip(b" \t\r\n").startswith(b"{"):
        raise _fail(path, "the header does not start with '{' (it is not a JSON object)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(path, "the header is not valid UTF-8") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _fail(path, f"the header is not valid JSON ({json_problem(exc)})") from None
    if not isinstance(header, dict):
        raise _fail(path, "the header is not a JSON object")
    # A duplicate key silently overwrites in json.loads; cheap counts spot it, a slow parse names it.
    if _may_repeat_keys(raw, header):
        try:
            json.loads(text, object_pairs_hook=_no_duplicates)
        except _DuplicateKey as dup:
            top = dup.key in header
            where = "" if top else " inside an entry"
            tensor = dup.key if top and dup.key != "__metadata__" else None
            raise _fail(path, f"the header repeats the key {dup.key!r}{where}", tensor=tensor) from None

    if b"\\u" in raw:
        _refuse_lone_surrogates(path, header)
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _fail(path, "__metadata__ must be an object mapping strings to strings")

    # Hot loops: a header may list 100k tensors, so checks are inlined rather than written with all().
    bits_of = DTYPE_BITS
    entries: list[tuple[int, int, str, str, tuple[int, ...], int]] = []
    for name, entry in header.items():
        if type(entry) is not dict:
            raise _fail(path, "the entry is not an object", name)
        dtype = entry.get("dtype")
        bits = bits_of.get(dtype) if type(dtype) is str else None
        if bits is None:
            raise _fail(path, f"unknown dtype {dtype!r}", name, f"Known dtypes: {', '.join(DTYPE_BITS)}.")
        shape = entry.get("shape")
        if type(shape) is not list:
            raise _fail(path, f"shape must be a list of non-negative integers, got {format_shape(shape)}", name)
        # Count the non-zero dimensions apart: a 0 must not hide a count that overflows (see shape_bounds).
        count = 1
        zero = False
        for d in shape:
            if type(d) is not int or d < 0:
                raise _fail(path, f"shape must be a list of non-negative integers, got {format_shape(shape)}", name)
            if d:
                if d >= INDEX_LIMIT:  # not a torch size: shape_problem says so
                    count = LIMIT
                    break
                count *= d
                if count >= LIMIT:
                    break
            else:
                zero = True
        if count >= LIMIT or (not zero and count * bits >= LIMIT):
            raise _fail(path, shape_problem(shape, bits) or f"shape {format_shape(shape)} overflows 64 bits", name)
        numel = 0 if zero else count
        offsets = entry.get("data_offsets")
        if type(offsets) is not list or len(offsets) != 2:
            raise _fail(path, f"data_offsets must be [begin, end] with 0 <= begin <= end, got {format_shape(offsets)}", name)
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or begin < 0 or begin > end or end >= LIMIT:
            raise _fail(path, f"data_offsets must be [begin, end] with 0 <= begin <= end < 2**64, got {format_shape(offsets)}", name)
        entries.append((begin, end, name, dtype, tuple(shape), numel * bits))

    entries.sort(key=itemgetter(0, 1))  # stable: empty tensors sharing an offset keep header order
    buffer_size = file_size - data_start
    expected = 0
    tensors: list[TensorInfo] = []
    append = tensors.append
    for begin, end, name, dtype, shape, bits in entries:
        if begin != expected:
            cause = "overlaps the previous tensor" if begin < expected else f"leaves a gap of {begin - expected} bytes before it"
            raise _fail(path, f"data_offsets [{begin}, {end}] {cause}", name)
        if bits % 8:
            raise _fail(path, f"{bits // DTYPE_BITS[dtype]} elements of {dtype} do not fill whole bytes", name)
        if bits // 8 != end - begin:
            raise _fail(
                path, f"shape {list(shape)} of {dtype} needs {bits // 8} bytes but data_offsets span {end - begin}", name
            )
        if end > buffer_size:
            raise _fail(path, f"data_offsets end at {end} but the data buffer has {buffer_size} bytes (truncated file?)", name)
        append(TensorInfo(name, dtype, shape, rel, data_start + begin, data_start + end))
        expected = end
    if expected != buffer_size:
        raise _fail(path, f"the tensors cover {expected} bytes of a {buffer_size}-byte data buffer (trailing or missing data)")
    return tensors, metadata


def looks_like_safetensors(path: Path) -> bool:
    """Cheap sniff: a header length that fits the file and a header that starts with '{'."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
            size = os.fstat(fh.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and 8 + n <= size


class FileReader:
    """Reads tensor byte ranges from the files of one checkpoint, keeping their descriptors open."""

    # Every tensor's bytes lie raw at [begin, end) of its `file`: `locate(info)` is always (the file's path, begin, end),
    # so planners and the engine may skip asking it per tensor.
    raw_in_place = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}
        self.files = FilePool(root)
        self._fd = self.files.fd

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The bytes of one tensor; nothing else of its file is read."""
        try:
            return read_at(self._fd(info.file), info.end - info.begin, info.begin)
        except EOFError:
            raise CheckpointError(
                f"Cannot read tensor {info.name!r} from {info.file}: the file ended early (it changed or was truncated "
                "after it was opened). Re-open the checkpoint.",
                file=info.file,
                tensor=info.name,
            ) from None

    # Where a tensor's bytes start in its file (`locate`'s offset without its path), asked per tensor by
    # `planning.page_align`: its `begin`, read without a Python call.
    raw_offset = staticmethod(attrgetter("begin"))

    def locate(self, info: TensorInfo) -> tuple[Path, int, int]:
        """Safetensors data is always raw and contiguous: the file and the absolute byte range."""
        path = self._paths.get(info.file)
        if path is None:  # cached: planners and the engine ask once per tensor, 100k times for big checkpoints
            path = self._paths[info.file] = self.files.path(info.file)
        return (path, info.begin, info.end)

    def close(self) -> None:
        self.files.close()


def file_info(rel: str, header: SafetensorsHeader) -> FileInfo:
    """The FileInfo row of one parsed file."""
    return FileInfo(rel, header.file_size, header.header_bytes, len(header.tensors))
