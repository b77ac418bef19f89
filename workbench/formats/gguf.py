"""GGUF files (llama.cpp, Ollama) and their split sets as catalogs, from the header alone.

A GGUF file is: magic `GGUF`, version, tensor count, key/value count, the key/values, one record per tensor
(name, dims innermost first, GGML type id, offset into the data), padding to the alignment, then the data.
The header is parsed here rather than by gguf-py's `GGUFReader`, which builds a numpy view per array item
(hundreds of thousands for a vocabulary) and checks no length against the file: every count, length,
dimension and offset is checked against the bytes the file holds before anything is allocated or read,
arrays are walked without being decoded (only their first items are kept), and long strings are skipped.
The type table (elements and bytes per block) is read from the installed `gguf` package.

Catalog conventions: each tensor's shape is its logical shape in PyTorch order (GGUF dims reversed) when its
type has a safetensors dtype (F32, F16, BF16, F64, I8..I64: `ck.load` returns the values). A block-quantised
tensor (Q4_K, Q8_0, ...) is listed as its raw bytes, `U8` of shape (rows..., blocks x bytes per block), as the
workbench's GGUF writer lays them out, so bytes copy and plans count exactly; the `gguf_type`, `logical_shape`
and `block` columns say what they hold, and `gguf.quants.dequantize` turns them into values.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..catalog import Catalog, FileInfo, TensorInfo
from ..errors import CannotRead, CheckpointError
from ..iostats import open_for_read, read_at
from .safetensors import FileReader

SUFFIX = ".gguf"
MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts; llama.cpp reads 2 and 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
MAX_NAME_BYTES = 65_536  # keys and tensor names (llama.cpp's tensor names are at most 64 bytes)
MAX_KEPT_STRING = 1 << 20  # string values longer than this are summarised, not read (chat templates are ~10 KB)
MAX_DEPTH = 3  # arrays of arrays of arrays at most
# Strings and arrays walked item by item across the whole header: a real vocabulary and its merges hold ~1M
# (Gemma 3: 262k tokens); a crafted count of empty strings in a sparse file would otherwise walk for hours.
MAX_WALKED = 1 << 24
MAX_TENSORS = 1 << 20
FIRST_ITEMS = 8  # array items kept for the metadata table
CHUNK = 1 << 22  # header bytes read at a time
SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")

# GGUF value type ids -> (name, struct format of a scalar or None)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
    5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
STRING, ARRAY = 8, 9
# GGML types whose elements are a safetensors dtype: their tensors are listed with their values' dtype
PLAIN_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64", "I8": "I8", "I16": "I16", "I32": "I32", "I64": "I64"}

_fail = CannotRead("GGUF file", "The file is corrupt, truncated or not a GGUF file: re-download it or convert it again.")


@functools.cache
def ggml_types() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, elements per block, bytes per block), from the installed `gguf` package's constants.

    `import gguf` costs 0.4-0.7 s here (its writer, tensor mapping and numpy); its `constants.py` alone, which imports
    only `enum`, 0.1 s: unless the package is already imported, that one module is loaded on its own."""
    module = sys.modules.get("gguf.constants")
    if module is None:
        spec = importlib.util.find_spec("gguf")
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            raise CheckpointError("Cannot read GGUF files: the `gguf` package (llama.cpp's container library) is not installed. "
                                  "Install it: pip install 'workbench[gguf]' (or pip install gguf).")
        found = importlib.util.spec_from_file_location("workbench_gguf_constants", os.path.join(list(where)[0], "constants.py"))
        if found is None or found.loader is None:
            raise CheckpointError("Cannot read GGUF files: the installed gguf package has no constants.py. Reinstall it: pip install -U gguf.")
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
    return {int(kind): (kind.name, block, size) for kind, (block, size) in module.GGML_QUANT_SIZES.items()}


@dataclass(frozen=True)
class GgufValue:
    """One key/value of a GGUF header: its type ('UINT32', 'STRING', 'ARRAY[STRING]' ...), its value (scalars and
    strings up to 1 MiB) or its first items (arrays), the item count of arrays, and where an array's items start."""

    key: str
    type: str
    value: Any
    count: int = 1
    offset: int = 0  # arrays: file offset of the first item
    item_type: int = -1  # arrays: the value type id of the items

    def shown(self) -> str:
        """The value for a table: scalars as text, arrays as their type, length and first items."""
        if self.item_type >= 0:
            more = ", ..." if self.count > len(self.value) else ""
            return f"[{self.count} × {VALUE_TYPES[self.item_type][0]}] " + "[" + ", ".join(map(repr, self.value)) + more + "]"
        return str(self.value)


@dataclass
class GgufHeader:
    """A parsed, checked GGUF header: version, key/values in file order, tensors (catalog infos) and per-tensor facts."""

    version: int
    values: dict[str, GgufValue]
    tensors: list[TensorInfo]
    kinds: dict[str, tuple[str, tuple[int, ...], int, int]]  # name -> (GGML type, logical shape, block elements, block bytes)
    data_start: int
    file_size: int
    alignment: int = DEFAULT_ALIGNMENT
    walked: int = field(default=0, repr=False)


class _Cursor:
    """Sequential reads of a header through `read_at`, every length checked against the file size first."""

    def __init__(self, fd: int, size: int, where: str) -> None:
        self.fd, self.size, self.where = fd, size, where
        self.pos = 0
        self.base = 0
        self.buf = b""
        self.walked = 0

    def need(self, n: int, what: str) -> int:
        """Make [pos, pos+n) available; returns its offset in `buf`."""
        if n > self.size - self.pos:
            raise _fail(self.where, f"{what} needs {n} bytes at offset {self.pos}, but the file has only {self.size - self.pos} "
                                    "left (truncated file, or a length field that is not one)")
        at = self.pos - self.base
        if at + n > len(self.buf):
            length = min(max(n, CHUNK), self.size - self.pos)
            self.buf = read_at(self.fd, length, self.pos)
            self.base = self.pos
            at = 0
        return at

    def unpack(self, fmt: str, n: int, what: str) -> Any:
        at = self.need(n, what)
        self.pos += n
        return struct.unpack_from(fmt, self.buf, at)[0]

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def raw(self, n: int, what: str) -> bytes:
        at = self.need(n, what)
        self.pos += n
        return self.buf[at:at + n]

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            self.need(n, what)  # raises
        self.pos += n

    def text(self, what: str, limit: int) -> str:
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise _fail(self.where, f"{what} is {n} bytes long, above the {limit}-byte limit for it")
        try:
            return self.raw(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(self.where, f"{what} at offset {self.pos - n} is not valid UTF-8") from None

    def walk(self, count: int, what: str) -> None:
        self.walked += count
        if self.walked > MAX_WALKED:
            raise _fail(self.where, f"{what} makes the header list more than {MAX_WALKED} strings or arrays, far beyond any real "
                                    "vocabulary")


def _min_size(item_type: int) -> int:
    """The fewest bytes one item of `item_type` takes."""
    fmt = VALUE_TYPES[item_type][1]
    return struct.calcsize(fmt) if fmt else (8 if item_type == STRING else 12)


def _value(cur: _Cursor, key: str, kind: int, depth: int = 0) -> tuple[Any, str, int, int, int]:
    """(value or first items, type name, count, first item offset, item type) of one value at the cursor."""
    spec = VALUE_TYPES.get(kind)
    if spec is None:
        raise _fail(cur.where, f"the key {key!r} has value type {kind}, which GGUF does not define (0-12)")
    name, fmt = spec
    if fmt is not None:
        return cur.unpack(fmt, struct.calcsize(fmt), f"the value of {key!r}"), name, 1, 0, -1
    if kind == STRING:
        n = cur.u64(f"the length of the string value of {key!r}")
        if n > MAX_KEPT_STRING:
            cur.skip(n, f"the string value of {key!r}")
            return f"<string of {n} bytes>", name, 1, 0, -1
        try:
            return cur.raw(n, f"the string value of {key!r}").decode("utf-8"), name, 1, 0, -1
        except UnicodeDecodeError:
            return "<bytes that are not UTF-8>", name, 1, 0, -1
    if depth >= MAX_DEPTH:
        raise _fail(cur.where, f"the key {key!r} nests arrays more than {MAX_DEPTH} deep")
    item_type = cur.u32(f"the item type of array {key!r}")
    if item_type not in VALUE_TYPES:
        raise _fail(cur.where, f"the array {key!r} has item type {item_type}, which GGUF does not define (0-12)")
    count = cur.u64(f"the length of array {key!r}")
    least = _min_size(item_type)
    if count > (cur.size - cur.pos) // least:
        raise _fail(cur.where, f"the array {key!r} claims {count} items of at least {least} bytes, more than the "
                               f"{cur.size - cur.pos} bytes left in the file")
    start = cur.pos
    first: list[Any] = []
    item_fmt = VALUE_TYPES[item_type][1]
    if item_fmt is not None:
        shown = min(count, FIRST_ITEMS)
        if shown:
            at = cur.need(least * shown, f"the items of {key!r}")
            first = list(struct.unpack_from("<" + item_fmt[1] * shown, cur.buf, at))
        cur.skip(least * count, f"the items of {key!r}")
    else:
        cur.walk(count, f"the array {key!r} of {count} items")
        for k in range(count):
            if item_type == STRING:
                if k == FIRST_ITEMS:
                    _skip_strings(cur, count - k, key)
                    break
                n = cur.u64(f"the length of item {k} of {key!r}")
                if n <= 256:
                    first.append(cur.raw(n, f"item {k} of {key!r}").decode("utf-8", "replace"))
                else:
                    cur.skip(n, f"item {k} of {key!r}")
                    first.append(f"<{n} bytes>")
            else:
                item = _value(cur, key, ARRAY, depth + 1)
                if k < FIRST_ITEMS:
                    first.append(f"{item[1]} of {item[2]}")
    return first, f"ARRAY[{VALUE_TYPES[item_type][0]}]", count, start, item_type


_U64 = struct.Struct("<Q").unpack_from


def _skip_strings(cur: _Cursor, count: int, key: str) -> None:
    """Step over `count` strings at the cursor (a vocabulary: the hot loop of opening a GGUF file), reading only
    their lengths; each is checked against the file's end."""
    buf, base, pos, size = cur.buf, cur.base, cur.pos, cur.size
    stop = base + len(buf) - 8  # the last position whose length field lies in the buffer
    for _ in range(count):
        if pos > stop:
            cur.pos = pos
            cur.need(8, f"the length of a string of {key!r}")
            buf, base = cur.buf, cur.base
            stop = base + len(buf) - 8
        pos += 8 + _U64(buf, pos - base)[0]
        if pos > size:
            raise _fail(cur.where, f"a string of the array {key!r} ends at byte {pos}, past the end of the {size}-byte file")
    cur.pos = pos


def read_header(path: str | os.PathLike, *, rel: str | None = None) -> GgufHeader:
    """Parse and check one GGUF file's header (see the module docstring); `rel` is recorded as each tensor's file."""
    spath = os.fspath(path)
    try:
        fd = open_for_read(spath)
    except OSError as exc:
        raise CheckpointError(f"Cannot open GGUF file {spath}: {exc.strerror}. Check the path and permissions.", file=spath) from None
    try:
        return _parse(_Cursor(fd, os.fstat(fd).st_size, spath), rel if rel is not None else os.path.basename(spath))
    finally:
        os.close(fd)


def _parse(cur: _Cursor, rel: str) -> GgufHeader:
    where = cur.where
    if cur.size < 24:
        raise _fail(where, f"the file is {cur.size} bytes, shorter than a GGUF header (24 bytes)")
    if cur.raw(4, "the magic") != MAGIC:
        raise _fail(where, "it does not start with the GGUF magic bytes")
    version = cur.u32("the version")
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise _fail(where, "it is a big-endian GGUF", fix="Convert it to little-endian with gguf-py's gguf_convert_endian.py.")
        raise _fail(where, f"it is GGUF version {version}; the workbench reads versions 2 and 3",
                    fix="Convert it again with a current llama.cpp.")
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the key/value count")
    left = cur.size - cur.pos
    if n_kv > left // 13:  # a key of 0 bytes: its length (8), type (4) and a 1-byte value
        raise _fail(where, f"the header claims {n_kv} key/values, more than the {left} bytes left in the file can hold")
    if n_tensors > MAX_TENSORS or n_tensors > left // 24:  # name length, dim count, type, offset
        raise _fail(where, f"the header claims {n_tensors} tensors, more than the file can hold (or than the limit of {MAX_TENSORS})")
    values: dict[str, GgufValue] = {}
    for _ in range(n_kv):
        key = cur.text("a key", MAX_NAME_BYTES)
        if key in values:
            raise _fail(where, f"the key {key!r} appears twice")
        kind = cur.u32(f"the value type of {key!r}")
        value, type_name, count, offset, item_type = _value(cur, key, kind)
        values[key] = GgufValue(key, type_name, value, count, offset, item_type)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in values:
        entry = values["general.alignment"]
        if entry.type != "UINT32" or entry.value <= 0 or entry.value & (entry.value - 1):
            raise _fail(where, f"general.alignment is {entry.value!r} ({entry.type}), not a power of two as a UINT32")
        alignment = entry.value
    types = ggml_types()
    records = []
    for _ in range(n_tensors):
        name = cur.text("a tensor name", MAX_NAME_BYTES)
        n_dims = cur.u32(f"the dimension count of {name!r}")
        if n_dims > MAX_DIMS:
            raise _fail(where, f"{n_dims} dimensions; GGUF tensors have at most {MAX_DIMS}", name)
        at = cur.need(8 * n_dims, f"the dimensions of {name!r}")
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, at)
        cur.pos += 8 * n_dims
        type_id = cur.u32(f"the type of {name!r}")
        offset = cur.u64(f"the data offset of {name!r}")
        records.append((name, dims, type_id, offset))
    data_start = cur.pos + (-cur.pos % alignment)
    tensors, kinds = _tensors(where, rel, records, types, data_start, cur.size, alignment)
    return GgufHeader(version, values, tensors, kinds, data_start, cur.size, alignment, cur.walked)


def _tensors(where: str, rel: str, records: list, types: dict, data_start: int, size: int, alignment: int) -> tuple[list, dict]:
    """Check each record (type, dims, offset) and make its TensorInfo; refuse overlapping data."""
    seen: set[str] = set()
    infos: list[TensorInfo] = []
    kinds: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, dims, type_id, offset in records:
        if name in seen:
            raise _fail(where, "the name appears twice", name)
        seen.add(name)
        if type_id not in types:
            known = ", ".join(sorted(n for n, _, _ in types.values()))
            raise _fail(where, f"GGML type id {type_id} is not one the installed gguf package knows ({known})", name,
                        fix="Upgrade the gguf package (pip install -U gguf), or re-download the file if it is corrupt.")
        kind, block, type_size = types[type_id]
        if any(d >= 1 << 63 for d in dims):
            raise _fail(where, f"dimension {max(dims)} is not below 2**63", name)
        numel = math.prod(dims)
        if numel >= 1 << 63:
            raise _fail(where, f"dimensions {list(dims)} overflow 64 bits ({numel} elements)", name)
        if block > 1 and (not dims or dims[0] % block):
            raise _fail(where, f"its rows of {dims[0]} elements are not whole {kind} blocks of {block}", name)
        nbytes = numel // block * type_size
        if offset % alignment:
            raise _fail(where, f"its data offset {offset} is not a multiple of the alignment {alignment}", name)
        begin = data_start + offset
        if offset > size or nbytes > size - begin:
            raise _fail(where, f"its {nbytes} bytes at offset {begin} end past the end of the {size}-byte file (truncated file?)", name)
        logical = tuple(reversed(dims))
        plain = PLAIN_TYPES.get(kind)
        if plain is not None:
            shape = logical
        else:
            shape = (*logical[:-1], logical[-1] // block * type_size) if logical else (type_size,)
        infos.append(TensorInfo(name, plain or "U8", shape, rel, begin, begin + nbytes))
        kinds[name] = (kind, logical, block, type_size)
    ordered = sorted(infos, key=lambda t: (t.begin, t.end))
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after.begin < before.end:
            raise _fail(where, f"its data [{after.begin}, {after.end}) overlaps that of {before.name!r} [{before.begin}, {before.end})",
                        after.name)
    return ordered, kinds


class GgufFileReader(FileReader):
    """Tensor bytes as the safetensors reader reads them (GGUF data lies raw at [begin, end)), plus the header's arrays
    read on demand (the tokenizer table)."""

    def __init__(self, root: Path, headers: dict[str, GgufHeader]) -> None:
        super().__init__(root)
        self.headers = headers

    def key_values(self) -> list[GgufValue]:
        """The key/values of the first file (a split set's model keys live there), in file order."""
        return list(next(iter(self.headers.values())).values.values())

    def array(self, key: str) -> list[Any]:
        """Every item of the array `key` of the first file (strings decoded, invalid UTF-8 replaced)."""
        rel, header = next(iter(self.headers.items()))
        entry = header.values.get(key)
        if entry is None or entry.item_type < 0:
            return []
        fmt = VALUE_TYPES[entry.item_type][1]
        if entry.item_type == ARRAY:
            return list(entry.value)
        fd = self.files.fd(rel)
        if fmt is not None:
            size = struct.calcsize(fmt)
            raw = read_at(fd, size * entry.count, entry.offset)
            return list(struct.unpack(f"<{entry.count}{fmt[1]}", raw))
        cur = _Cursor(fd, header.file_size, str(self.files.path(rel)))
        cur.pos = cur.base = entry.offset
        out = []
        for k in range(entry.count):
            out.append(cur.raw(cur.u64(f"item {k} of {key!r}"), f"item {k} of {key!r}").decode("utf-8", "replace"))
        return out

    def kind_of(self, info: TensorInfo) -> tuple[str, tuple[int, ...], int, int]:
        """(GGML type, logical shape, elements per block, bytes per block) of one tensor."""
        return self.headers[info.file].kinds[info.name]

    def dequantized_chunks(self, info: TensorInfo, chunk_elements: int) -> Iterator[Any] | None:
        """A block-quantised tensor's values as (float32 numpy array, bytes read) of whole rows (about `chunk_elements`
        values each, at least one row), dequantised by `gguf.quants.dequantize`; None for tensors whose bytes are their
        values."""
        kind, logical, block, size = self.kind_of(info)
        if kind in PLAIN_TYPES:
            return None
        return self._dequantized(info, kind, logical, block, size, chunk_elements)

    def _dequantized(self, info: TensorInfo, kind: str, logical: tuple[int, ...], block: int, size: int, chunk_elements: int) -> Iterator[Any]:
        import gguf
        import numpy as np

        row_elements = logical[-1] if logical else 0
        row_bytes = row_elements // block * size
        rows = math.prod(logical[:-1]) if row_elements else 0
        step = max(1, chunk_elements // max(row_elements, 1))
        fd = self.files.fd(info.file)
        for first in range(0, rows, step):
            count = min(step, rows - first)
            raw = np.frombuffer(read_at(fd, count * row_bytes, info.begin + first * row_bytes), dtype=np.uint8)
            try:
                values = gguf.quants.dequantize(raw.reshape(count, row_bytes), gguf.GGMLQuantizationType[kind])
            except NotImplementedError:
                raise CheckpointError(f"Cannot read the values of tensor {info.name!r}: the installed gguf package cannot "
                                      f"dequantise {kind}. Upgrade it (pip install -U gguf), or look at its raw bytes with "
                                      "read_bytes.", file=info.file, tensor=info.name) from None
            yield np.ascontiguousarray(values, dtype=np.float32).reshape(-1), count * row_bytes

    def tokenizer_table(self) -> dict[str, list[Any]]:
        """The vocabulary as columns: id, token, score, type (llama.cpp's token types: 1 normal, 2 unknown, 3 control,
        4 user-defined, 5 unused, 6 byte); {} when the file has no `tokenizer.ggml.tokens`."""
        tokens = self.array("tokenizer.ggml.tokens")
        if not tokens:
            return {}
        scores = self.array("tokenizer.ggml.scores")
        kinds = self.array("tokenizer.ggml.token_type")
        n = len(tokens)
        return {"id": list(range(n)), "token": tokens,
                "score": scores if len(scores) == n else [None] * n,
                "type": [TOKEN_TYPES.get(k, str(k)) for k in kinds] if len(kinds) == n else [None] * n}


TOKEN_TYPES = {1: "normal", 2: "unknown", 3: "control", 4: "user_defined", 5: "unused", 6: "byte"}


def _split_files(path: Path) -> list[Path]:
    """The files of the split set `path` belongs to (itself alone when it is not named as a split)."""
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None:
        return [path]
    prefix, count = match.group(1), int(match.group(3))
    files = [path.parent / f"{prefix}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"Cannot open GGUF split set {path.parent / prefix}: {len(missing)} of its {count} files are missing "
                              f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}). Download every split.", file=str(path))
    return files


def _folder_files(folder: Path) -> list[Path]:
    found = sorted(p for p in folder.glob("*" + SUFFIX) if p.is_file())
    if len(found) == 1:
        return found
    sets = {m.group(1) + m.group(3) for p in found if (m := SPLIT_NAME.fullmatch(p.name))}
    if len(sets) == 1 and all(SPLIT_NAME.fullmatch(p.name) for p in found):
        return _split_files(found[0])
    names = ", ".join(p.name for p in found[:6])
    raise CheckpointError(f"Cannot open {folder} as one GGUF model: it holds {len(found)} .gguf files that are not one split set "
                          f"({names}{', ...' if len(found) > 6 else ''}). Open one file.", file=str(folder))


def _check_split(files: list[Path], headers: dict[str, GgufHeader]) -> None:
    """Each file of a split set says it is split k of N, and the set holds the tensors the first says it has."""
    count = len(files)
    for k, path in enumerate(files):
        values = headers[path.name].values
        no, total = values.get("split.no"), values.get("split.count")
        if no is None or total is None or no.value != k or total.value != count:
            said = f"split.no={no.value if no else None}, split.count={total.value if total else None}"
            raise CheckpointError(f"Cannot open GGUF split set: {path} is named split {k + 1} of {count} but its header says {said}. "
                                  "The files come from different conversions: download the set again.", file=str(path))
    claimed = headers[files[0].name].values.get("split.tensors.count")
    held = sum(len(h.tensors) for h in headers.values())
    if claimed is not None and claimed.value != held:
        raise CheckpointError(f"Cannot open GGUF split set {files[0]}: split.tensors.count says {claimed.value} tensors, the "
                              f"{count} files hold {held}. Download the set again.", file=str(files[0]))


def detect(path: Path) -> bool:
    """A `.gguf` file, or a folder holding `.gguf` files and no safetensors."""
    if path.is_file():
        return path.suffix == SUFFIX
    return path.is_dir() and any(p.suffix == SUFFIX for p in path.glob("*" + SUFFIX))


def open_path(path: Path) -> Catalog:
    """A GGUF file, a split set (any of its files, or its folder) or a folder holding one GGUF file."""
    files = _folder_files(path) if path.is_dir() else _split_files(path)
    single = len(files) == 1 and not path.is_dir()
    root = files[0] if single else files[0].parent
    headers = {f.name: read_header(f, rel=f.name) for f in files}
    if len(files) > 1:
        _check_split(files, headers)
    tensors: dict[str, TensorInfo] = {}
    columns: dict[str, dict[str, object]] = {"gguf_type": {}, "logical_shape": {}, "block": {}, "stored_as": {}}
    for rel, header in headers.items():
        for info in header.tensors:
            if info.name in tensors:
                raise CheckpointError(f"Cannot open GGUF split set {root}: tensor {info.name!r} is in {tensors[info.name].file} and "
                                      f"{rel}. Download the set again.", file=rel, tensor=info.name)
            tensors[info.name] = info
            kind, logical, block, size = header.kinds[info.name]
            columns["gguf_type"][info.name] = kind
            columns["logical_shape"][info.name] = logical
            columns["block"][info.name] = (block, size)
            columns["stored_as"][info.name] = "values" if kind in PLAIN_TYPES else "raw blocks"
    first = next(iter(headers.values()))
    metadata = {v.key: v.shown() for v in first.values.values()}
    files_info = {rel: FileInfo(rel, h.file_size, h.data_start, len(h.tensors)) for rel, h in headers.items()}
    return Catalog(root=root, format="gguf", tensors=tensors, files=files_info, metadata=metadata,
                   reader=GgufFileReader(root, headers), columns=columns, shown_columns=("gguf_type", "logical_shape"))
