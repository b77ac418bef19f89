"""Streaming safetensors writer and HF index writer.

The whole layout (every tensor's dtype, shape and offset) is decided before the first byte is written,
so the header goes first and tensor data can then arrive in any order, in pieces, or be copied by the
kernel straight from a source file. Nothing is visible under the final name until every declared byte
has been written and synced: a crash leaves only a `.partial` file, never a plausible-looking one.
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import operator
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import DTYPE_BITS
from ..errors import PlanError
from ..files import PARTIAL_SUFFIX, atomic_write, claim_temp, fsync_dir, open_regular, replace_into, temp_path  # noqa: F401 (re-exported)
from ..formats.safetensors_folder import INDEX_NAME  # the commit marker of a sharded output
from ..iostats import IO
from ..names import is_unicode_text
from .base import FileLayout, OutputFormat
from .direct_io import DirectWrites, reopen_direct

# Reference writer order: larger element types first (keeps every tensor aligned), then by name.
_DTYPE_RANK = [
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
]
_RANK = {code: i for i, code in enumerate(_DTYPE_RANK)}
DEFAULT_METADATA = {"format": "pt"}
PAGE = 4096  # the page a data start is placed within (fixed, so the bytes are the same on every machine)


def tensor_meta(tensor: Any) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype code and shape of a torch tensor.

    torch packs two F4 values per element (`float4_e2m1fn_x2`); safetensors counts the 4-bit values.
    """
    from ..dtypes import from_torch

    code = from_torch(tensor.dtype)
    shape = tuple(tensor.shape)
    if code == "F4" and shape:
        shape = (*shape[:-1], shape[-1] * 2)
    return code, shape


def reference_order(tensors: Iterable[TensorInfo]) -> list[TensorInfo]:
    """The order the reference writer stores tensors in: dtype rank descending, then name."""
    by_rank: dict[int, list[TensorInfo]] = {}
    for t in tensors:  # one name sort per dtype rank: no key tuple per tensor (100k-tensor shards)
        by_rank.setdefault(_RANK.get(t.dtype, 0), []).append(t)
    ordered: list[TensorInfo] = []
    for rank in sorted(by_rank, reverse=True):
        ordered += sorted(by_rank[rank], key=_name)
    return ordered


_name = operator.attrgetter("name")


def layout_file(
    file: str,
    tensors: Sequence[TensorInfo],
    metadata: Mapping[str, str] | None = None,
    *,
    order: str = "reference",
    data_residue: int | Callable[[dict[str, int]], int | None] | None = None,
) -> FileLayout:
    """Place `tensors` in one file: header bytes and absolute offsets, identical to the reference writer.

    `order='reference'` sorts like `safetensors.save_file` (so equal inputs give equal bytes);
    `order='given'` keeps the caller's order. `data_residue` (a multiple of 8 below `PAGE`) pads the header
    with more trailing spaces, as the format allows, until the data starts at that offset within a page:
    kernel copies from a source run at the same offset within its page move whole pages (see
    `planning.page_align`). None keeps the reference writer's minimal padding. A function as `data_residue` is
    given each tensor's offset from the data start (name -> bytes) and returns the residue (or None): the
    planner chooses it from where the tensors fall, with the tensors ordered and the header spelled out once.
    """
    if data_residue is not None and not callable(data_residue):
        _check_residue(data_residue)
    ordered = reference_order(tensors) if order == "reference" else list(tensors)
    _check_names(file, ordered)
    meta = dict(DEFAULT_METADATA if metadata is None else metadata)
    # Raw UTF-8 like the reference writer (which escapes only quotes, backslashes and control characters).
    try:
        text, sizes, offset = _header_text(file, ordered, meta)
        body = text.encode("utf-8")
    except UnicodeEncodeError:
        bad = next((t.name for t in ordered if not is_unicode_text(t.name)), None)
        what = f"tensor name {bad!r}" if bad is not None else "the metadata"
        raise PlanError(f"Cannot lay out {file}: {what} is not valid Unicode text (lone surrogate). Fix it.", tensor=bad) from None
    body += b" " * (-len(body) % 8)
    if callable(data_residue):
        starts = list(itertools.accumulate(sizes, initial=0))  # each tensor's offset from the data start
        data_residue = data_residue(dict(zip(map(_name, ordered), starts, strict=False)))
        if data_residue is not None:
            _check_residue(data_residue)
    if data_residue is not None:
        body += b" " * ((data_residue - 8 - len(body)) % PAGE)
    header = len(body).to_bytes(8, "little") + body
    start = len(header)
    placed = []
    append = placed.append
    at = start
    for t, size in zip(ordered, sizes, strict=True):
        shape = t.shape
        append(TensorInfo(t.name, t.dtype, shape if type(shape) is tuple else tuple(shape), file, at, at + size))
        at += size
    return FileLayout(file, header, tuple(placed), start + offset)


def _check_residue(data_residue: int) -> None:
    if data_residue % 8 or not 0 <= data_residue < PAGE:
        raise ValueError(f"data_residue must be a multiple of 8 in [0, {PAGE}), not {data_residue}")


def _check_names(file: str, ordered: Sequence[TensorInfo]) -> None:
    """Raise for the first tensor whose name repeats an earlier one or is the reserved `__metadata__` (or, before
    it, one whose dtype safetensors cannot store: problems are reported in file order)."""
    names = {t.name for t in ordered}
    if len(names) == len(ordered) and "__metadata__" not in names:
        return
    seen: set[str] = set()
    for t in ordered:
        if t.name in seen or t.name == "__metadata__":
            raise PlanError(f"Cannot lay out {file}: tensor name {t.name!r} appears twice or is reserved. Rename it.", tensor=t.name)
        seen.add(t.name)
        _header_text(file, [t], {})  # raises for a dtype it cannot store


def _header_text(file: str, ordered: Sequence[TensorInfo], meta: Mapping[str, str]) -> tuple[str, list[int], int]:
    """The header JSON exactly as `json.dumps(..., separators=(",", ":"), ensure_ascii=False)` writes it, each
    tensor's byte size, and the data size. Spelled out per tensor (with one shape text per distinct dtype and
    shape) because building a dict per tensor for json.dumps dominated the layout of 100k-tensor files."""
    parts = [json.dumps({"__metadata__": meta}, separators=(",", ":"), ensure_ascii=False)[1:-1]] if meta else []
    kinds: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}
    sizes = []
    offset = 0
    for t in ordered:
        shape = t.shape if type(t.shape) is tuple else tuple(t.shape)
        kind = kinds.get((t.dtype, shape))
        if kind is None:
            bits = t.numel * DTYPE_BITS[t.dtype] if t.dtype in DTYPE_BITS else 1
            if bits % 8:
                cause = f"unknown dtype {t.dtype!r}" if t.dtype not in DTYPE_BITS else f"{t.numel} elements of {t.dtype} do not fill whole bytes"
                raise PlanError(f"Cannot lay out {file}: tensor {t.name!r} has {cause}, which safetensors cannot store.", tensor=t.name)
            dims = ",".join(str(int(d)) for d in shape)
            kind = kinds[(t.dtype, shape)] = (bits // 8, f':{{"dtype":{_json_text(t.dtype)},"shape":[{dims}],"data_offsets":[')
        size, prefix = kind
        parts.append(f"{_json_text(t.name)}{prefix}{offset},{offset + size}]}}")
        sizes.append(size)
        offset += size
    return "{" + ",".join(parts) + "}", sizes, offset


_json_text = json.encoder.encode_basestring  # a JSON string literal, non-ASCII kept as it is (what ensure_ascii=False writes)


def preallocate(fd: int, size: int) -> None:
    """Reserve a file's full size up front.

    Allocating the blocks (rather than `ftruncate`, which leaves holes) makes a full disk fail now,
    not mid-run, and lets the file system lay the file out in one piece. (An earlier measurement here
    said filling holes was 3-5x slower; repeated with the machine's memory state controlled, the two
    were equal.) Filesystems without fallocate get a sparse file instead.
    """
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


# Largest single write(): the kernel sizes the page-cache folios a write allocates by the call's length, and
# large folios (1 MiB and up) cost up to 10x more system time to allocate here than small ones (512 MiB in 12 MiB
# calls: 0.9-1.1 s; in 256 KiB calls: 0.07-0.10 s, as a kernel copy, whose splice writes 64 KiB at a time). On a VM
# that hands free memory back to its host, high-order blocks are the ones handed back.
WRITE_CALL_MAX = 256 << 10
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16  # buffers one preadv may fill
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
WRITEBACK_MIN = 8 << 20  # kernel copies at least this large start their writeback at once
COPY_CALL_MAX = 8 << 20  # a long kernel copy goes in pieces this large, each one's writeback started after it


@functools.cache
def _libc_sync_file_range() -> Any:
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return function


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a file range's dirty pages to disk now, without waiting for them.

    Data written early is already on its way when the commit's fsync comes (for 1 GiB written by a cast,
    that fsync went from 0.4 s to 0.01 s here). Pages stay cached. A hint: a no-op where `sync_file_range`
    (Linux) is missing; its result is ignored.
    """
    function = _libc_sync_file_range()
    if function is not None:
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


_UNOPENED = object()


class _ReadCursor:
    """Fills buffers with consecutive stretches of one output run from the source runs that tile it."""

    def __init__(self, writer: SafetensorsWriter, reads: Sequence[tuple[int, int, int, int]], run_offset: int) -> None:
        self._writer = writer
        self._reads = reads
        self._run_offset = run_offset
        self._index = 0  # the read holding the next byte asked for (stretches are asked for in order)

    def fill(self, view: memoryview, file_offset: int) -> None:
        """Put the run's bytes from absolute `file_offset` into `view` (its whole length)."""
        reads, index = self._reads, self._index
        at = file_offset - self._run_offset
        while reads[index][2] + reads[index][3] <= at:
            index += 1
        filled, wanted = 0, view.nbytes
        while filled < wanted:
            fd, src_offset, start, length = reads[index]
            skip = at + filled - start
            source = src_offset + skip
            take = min(length - skip, wanted - filled)
            while take < wanted - filled and index + 1 < len(reads):  # the next read continues this one in the source
                nxt = reads[index + 1]
                if nxt[0] != fd or nxt[1] != src_offset + length:
                    break
                index += 1
                src_offset, length = nxt[1], nxt[3]
                take = min(take + length, wanted - filled)
            self._writer._read_scattered(fd, source, [view[filled : filled + take]])
            filled += take
            if reads[index][2] + reads[index][3] <= at + filled:
                index += 1
        self._index = min(index, len(reads) - 1)


class SafetensorsWriter:
    """Writes one safetensors file laid out in advance; data may arrive in any order and in pieces.

    Use as a context manager: leaving it with an exception removes the partial file; `commit()` checks
    that every declared byte was written, syncs, and renames to the final name.
    """

    _buffer: memoryview | None = None  # copies that are not page-congruent go through it (WRITE_CALL_MAX bytes)
    _direct: int | None | object = _UNOPENED  # the O_DIRECT descriptor (`assemble_span`), opened when first asked

    def __init__(self, folder: str | os.PathLike, layout: FileLayout, *, joined: bool = False, sparse: bool = False) -> None:
        self.folder = Path(folder)
        self.layout = layout
        self.final_path = self.folder / layout.file
        self.partial_path = temp_path(self.final_path)
        self._by_name = layout.by_name()
        self._written: dict[str, int] = dict.fromkeys(self._by_name, 0)
        if joined:  # a shared file (`OutputFormat.join_writer`): made whole before the ranks started, header included
            self._fd = open_regular(self.partial_path, os.O_WRONLY)
            return
        self._fd = claim_temp(self.partial_path)  # exclusive, no-follow: nothing planted there is written through
        try:
            if sparse:  # a remote destination's spool file uploaded part by part: blocks only where bytes are written
                os.ftruncate(self._fd, layout.size)
            else:
                preallocate(self._fd, layout.size)
            self._pwrite(layout.header, 0)
        except BaseException:
            self.abort()
            raise

    def _slot(self, name: str, at: int, length: int) -> TensorInfo:
        info = self._by_name.get(name)
        if info is None:
            raise PlanError(f"Cannot write tensor {name!r} to {self.layout.file}: it is not in the planned layout.", file=self.layout.file, tensor=name)
        if at < 0 or at + length > info.nbytes:
            raise PlanError(
                f"Cannot write tensor {name!r} to {self.layout.file}: {length} bytes at offset {at} overflow its declared "
                f"{info.nbytes} bytes ({info.dtype} {list(info.shape)}). The data disagrees with the planned metadata.",
                file=self.layout.file,
                tensor=name,
            )
        return info

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        assert self._fd is not None
        view = memoryview(data).cast("B")
        total = len(view)
        done = 0
        while done < total:  # in calls of WRITE_CALL_MAX bytes: see its comment
            done += os.pwrite(self._fd, view[done : done + WRITE_CALL_MAX], offset + done)
        IO.add_written(total)

    def write(self, name: str, data: bytes | bytearray | memoryview, at: int = 0) -> None:
        """Write `data` as bytes [at, at+len) of tensor `name`."""
        length = memoryview(data).nbytes
        info = self._slot(name, at, length)
        self._pwrite(data, info.begin + at)
        self._written[name] += length

    def start_writeback(self, name: str, at: int, length: int) -> None:
        """Start writing bytes [at, at+length) of tensor `name` to disk now, so `commit()` has less to sync."""
        info = self._slot(name, at, length)
        if self._fd is not None:
            start_writeback(self._fd, info.begin + at, length)

    def write_tensor(self, name: str, tensor: Any) -> None:
        """Write a whole torch tensor, refusing one whose dtype or shape differs from the layout."""
        info = self._slot(name, 0, 0)
        dtype, shape = tensor_meta(tensor)
        if dtype != info.dtype or shape != info.shape:
            raise PlanError(
                f"Cannot write tensor {name!r} to {self.layout.file}: it is {dtype} {list(shape)} but the plan "
                f"declared {info.dtype} {list(info.shape)}. The mapper's inference and its apply disagree.",
                file=self.layout.file,
                tensor=name,
            )
        tensor = tensor.detach().cpu().contiguous()
        if tensor.numel():
            import torch

            self.write(name, tensor.reshape(-1).view(torch.uint8).numpy().data)

    def copy_from(self, name: str, src_fd: int, src_offset: int, length: int, at: int = 0) -> None:
        """Copy `length` bytes from an open source file straight into tensor `name` at `at` (kernel copy)."""
        info = self._slot(name, at, length)
        assert self._fd is not None
        dst = info.begin + at
        done = 0
        try:
            while done < length:
                n = os.copy_file_range(src_fd, self._fd, length - done, src_offset + done, dst + done)
                if n == 0:
                    raise PlanError(
                        f"Cannot copy tensor {name!r}: the source file ended early. It changed during the conversion.",
                        tensor=name,
                    )
                done += n
        except OSError:  # filesystems without copy_file_range: fall back to read + write
            self._copy_through_buffer(src_fd, src_offset + done, dst + done, length - done, tensor=name)
        IO.add_written(length)
        self._written[name] += length

    def copy_span(self, src_fd: int, src_offset: int, file_offset: int, parts: Sequence[tuple[str, int, int]]) -> None:
        """Kernel-copy one contiguous run of source bytes that fills several planned pieces at once.

        `parts` are (tensor, offset within it, length) in file order and must tile the destination
        range that starts at absolute `file_offset`; coalescing adjacent pieces into one copy is what
        makes checkpoints of many small tensors fast.
        """
        total = self._span(file_offset, parts, "copy")
        assert self._fd is not None
        done = 0
        hint = total >= WRITEBACK_MIN
        if (src_offset - file_offset) % PAGE:
            # Source and destination pages do not line up: a kernel copy then costs more system time than reading
            # and writing through a small buffer (1 GiB pass-through into one file, 75 % of it not congruent:
            # 0.41 -> 0.36 s of system CPU, 5 alternating pairs; congruent runs stay kernel copies).
            self._copy_through_buffer(src_fd, src_offset, file_offset, total, hint=hint)
            done = total
        try:
            while done < total:
                n = os.copy_file_range(src_fd, self._fd, min(total - done, COPY_CALL_MAX), src_offset + done, file_offset + done)
                if n == 0:
                    raise PlanError(f"Cannot copy into {self.layout.file}: the source file ended early. It changed during the conversion.")
                if hint:  # each piece on its way to disk at once: the commit's fsync finds little left to write
                    start_writeback(self._fd, file_offset + done, n)
                done += n
        except OSError:  # filesystems without copy_file_range: fall back to read + write
            self._copy_through_buffer(src_fd, src_offset + done, file_offset + done, total - done, hint=hint)
        IO.add_written(total)
        self._count(parts)

    def gather_span(self, file_offset: int, reads: Sequence[tuple[int, int, int, int]], parts: Sequence[tuple[str, int, int]]) -> None:
        """Assemble at most WRITE_CALL_MAX bytes from scattered source runs in the writer's buffer, write them at once.

        `reads` are (source fd, source offset, offset in the assembled bytes, length) and `parts` (tensor, offset
        within it, length) in file order, tiling the destination from absolute `file_offset`. Reads adjacent in the
        source become one scattering `preadv`: a fused tensor of tiny pieces taken from far apart in the source
        costs a few calls per window instead of a copy per piece (`engine.copier`). The buffer is the one
        `copy_span` already uses, so nothing more is held.
        """
        total = self._span(file_offset, parts, "write")
        if total > WRITE_CALL_MAX or sum(length for *_, length in reads) != total:
            raise PlanError(f"Cannot write into {self.layout.file}: the pieces of one gathered write do not add up to its bytes.",
                            file=self.layout.file)
        buffer = self._scratch()
        ordered = sorted(reads)
        start = 0
        while start < len(ordered):
            fd, offset, _, _ = ordered[start]
            end, position = start, offset
            while end < len(ordered) and end - start < _IOV_MAX and ordered[end][0] == fd and ordered[end][1] == position:
                position += ordered[end][3]
                end += 1
            self._read_scattered(fd, offset, [buffer[at : at + length] for _, _, at, length in ordered[start:end]])
            start = end
        self._pwrite(buffer[:total], file_offset)
        self._count(parts)

    def assemble_span(self, direct: DirectWrites, file_offset: int, reads: Sequence[tuple[int, int, int, int]],
                      parts: Sequence[tuple[str, int, int]]) -> None:
        """Write a long contiguous run of output, gathered from source runs, with direct writes for its whole pages.

        `reads` are (source fd, source offset, offset in the run, length) in run order and `parts` (tensor, offset
        within it, length) in file order, both tiling the run from absolute `file_offset`. The run's whole pages are
        assembled `direct.block` bytes at a time in `direct`'s buffers and written past the page cache
        (`output.direct_io`); the partial pages at either end are written through the buffered descriptor. Only
        for files that `takes_direct_writes()`.
        """
        fd = self._direct_fd()
        assert fd is not None
        total = self._span(file_offset, parts, "copy")
        if sum(length for *_, length in reads) != total:
            raise PlanError(f"Cannot write into {self.layout.file}: the pieces of one copy do not add up to its bytes.",
                            file=self.layout.file)
        end = file_offset + total
        body = -(-file_offset // PAGE) * PAGE  # first whole page
        body_end = max(body, end // PAGE * PAGE)
        cursor = _ReadCursor(self, reads, file_offset)
        if body > file_offset:
            head = min(body, end) - file_offset
            cursor.fill(self._scratch()[:head], file_offset)
            self._pwrite(self._scratch()[:head], file_offset)
        position = body
        while position < body_end:
            length = min(direct.block, body_end - position)
            buffer = direct.buffer()
            with memoryview(buffer) as view:
                cursor.fill(view[:length], position)
            direct.submit(fd, buffer, position, length)
            IO.add_written(length)
            position += length
        if end > body_end >= body:
            cursor.fill(self._scratch()[: end - body_end], body_end)
            self._pwrite(self._scratch()[: end - body_end], body_end)
        self._count(parts)

    def takes_direct_writes(self) -> bool:
        """Whether whole pages of this file can be written with O_DIRECT (the filesystem allows it, not turned off)."""
        return self._direct_fd() is not None

    def _direct_fd(self) -> int | None:
        """This file's O_DIRECT descriptor, opened on first use; None when the filesystem refuses direct writes."""
        if self._direct is _UNOPENED:
            assert self._fd is not None
            self._direct = reopen_direct(self._fd)
        return self._direct  # type: ignore[return-value]

    def _close_direct(self) -> None:
        if isinstance(self._direct, int):
            os.close(self._direct)
        self._direct = _UNOPENED

    def _read_scattered(self, fd: int, offset: int, views: list[memoryview]) -> None:
        """Fill `views` in turn from consecutive source bytes at `offset` (short reads continued)."""
        first = 0
        while first < len(views):
            got = os.preadv(fd, views[first:] if first else views, offset)
            if got == 0:
                raise PlanError(f"Cannot copy into {self.layout.file}: the source file ended early. It changed during the conversion.")
            offset += got
            while first < len(views) and got >= views[first].nbytes:
                got -= views[first].nbytes
                first += 1
            if got:
                views[first] = views[first][got:]

    def write_span(self, file_offset: int, data: bytes | bytearray | memoryview, parts: Sequence[tuple[str, int, int]]) -> None:
        """Write `data`, bytes that fill several planned pieces at once, from absolute `file_offset`.

        `parts` are (tensor, offset within it, length) in file order; they must tile exactly the bytes of
        `data` (small casts converted together are written with one call, see `planning.runs.batch_casts`).
        """
        if self._span(file_offset, parts, "write") != memoryview(data).nbytes:
            raise PlanError(f"Cannot write into {self.layout.file}: the pieces of one write do not add up to its bytes.",
                            file=self.layout.file)
        self._pwrite(data, file_offset)
        self._count(parts)

    def _count(self, parts: Sequence[tuple[str, int, int]]) -> None:
        """Record the pieces one call wrote (what `missing` and the commit check)."""
        written = self._written
        for name, _, length in parts:
            written[name] += length

    def _span(self, file_offset: int, parts: Sequence[tuple[str, int, int]], what: str) -> int:
        """Bytes of `parts` after checking that they tile the file from `file_offset` without a gap."""
        position = file_offset
        slots = self._by_name
        for name, at, length in parts:
            info = slots.get(name)
            if info is not None and info.begin + at == position and at >= 0 and at + length <= info.end - info.begin:
                position += length  # the usual answer, checked inline: this runs once per piece (100k small tensors)
                continue
            info = self._slot(name, at, length)  # raises the precise error for a name or range outside the layout
            if info.begin + at != position:
                raise PlanError(
                    f"Cannot {what} into {self.layout.file}: the pieces of one {what} are not contiguous at tensor {name!r}.",
                    file=self.layout.file,
                    tensor=name,
                )
            position += length
        return position - file_offset

    def _scratch(self) -> memoryview:
        """The writer's one WRITE_CALL_MAX-byte buffer, made on first use (unaligned copies, gathered writes)."""
        if self._buffer is None:
            self._buffer = memoryview(bytearray(WRITE_CALL_MAX))
        return self._buffer

    def _copy_through_buffer(self, src_fd: int, src_offset: int, file_offset: int, length: int, tensor: str | None = None,
                             *, hint: bool = False) -> None:
        """Copy `length` bytes by reading and writing WRITE_CALL_MAX bytes at a time through one reused buffer;
        with `hint`, every COPY_CALL_MAX bytes written start their writeback."""
        assert self._fd is not None
        buffer = self._scratch()
        done = hinted = 0
        while done < length:
            got = os.preadv(src_fd, [buffer[: min(WRITE_CALL_MAX, length - done)]], src_offset + done)
            if got == 0:
                what = f"tensor {tensor!r}" if tensor is not None else f"into {self.layout.file}"
                raise PlanError(f"Cannot copy {what}: the source file ended early. It changed during the conversion.", tensor=tensor)
            written = 0
            while written < got:
                written += os.pwrite(self._fd, buffer[written:got], file_offset + done + written)
            done += got
            if hint and (done - hinted >= COPY_CALL_MAX or done == length):
                start_writeback(self._fd, file_offset + hinted, done - hinted)
                hinted = done

    def missing(self) -> dict[str, int]:
        """Tensors not yet fully written, with the bytes still owed."""
        owed = {}
        by_name = self._by_name
        for name, written in self._written.items():  # once per tensor at every commit
            slot = by_name[name]
            size = slot.end - slot.begin  # a planned slot holds exactly the tensor's bytes, in every output format
            if written != size:
                owed[name] = size - written
        return owed

    def commit(self, *, sync_dir: bool = True) -> Path:
        """Check completeness, fsync, rename to the final name; returns the final path."""
        missing = self.missing()
        if missing:
            name, owed = next(iter(missing.items()))
            self.abort()
            raise PlanError(
                f"Cannot finish {self.layout.file}: {len(missing)} tensors were not completely written "
                f"(e.g. {name!r}, {owed} bytes short). Nothing was kept.",
                file=self.layout.file,
                tensor=name,
            )
        assert self._fd is not None
        self._close_direct()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        replace_into(self.partial_path, self.final_path)
        if sync_dir:
            fsync_dir(self.folder)
        return self.final_path

    def release(self) -> None:
        """Sync and close a joined shared file without renaming it (its finish renames it once every rank is done)."""
        if self._fd is None:
            return
        self._close_direct()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None

    def abort(self) -> None:
        """Close and remove the partial file."""
        self._close_direct()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.partial_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_index(
    folder: str | os.PathLike,
    weight_map: Mapping[str, str],
    total_size: int,
    *,
    name: str = INDEX_NAME,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write the HF index (sorted keys, `metadata.total_size`) atomically; it is the commit marker."""
    folder = Path(folder)
    meta = {"total_size": int(total_size)}
    if metadata:
        meta.update(metadata)
    body = json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, indent=2, sort_keys=False) + "\n"
    return atomic_write(folder / name, body)


def shard_file_name(k: int, n: int) -> str:
    """HF shard naming: `model-0000k-of-0000n.safetensors`, or `model.safetensors` when n == 1."""
    return "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> Path:
    """Write a dict of torch tensors to one safetensors file through the streaming writer."""
    path = Path(path)
    infos = [TensorInfo(n, *tensor_meta(t)) for n, t in tensors.items()]
    layout = layout_file(path.name, infos, metadata)
    with SafetensorsWriter(path.parent, layout) as writer:
        for name, tensor in tensors.items():
            writer.write_tensor(name, tensor)
        return writer.commit()


_OWNED = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


class SafetensorsOutput(OutputFormat):
    """HF safetensors: `model.safetensors`, or `model-0000k-of-0000N.safetensors` shards committed by
    `model.safetensors.index.json`; headers carry the source's `__metadata__` where it is unambiguous."""

    name = "safetensors"
    title = "safetensors"
    label = ""
    keeps_header_metadata = True
    pads_header = True
    plans_runs = True

    def file_name(self, k: int, n: int) -> str:
        return shard_file_name(k + 1, n)

    def owns(self, name: str) -> bool:
        """`model.safetensors`, `model-0000k-of-0000N.safetensors` and the index."""
        return name == INDEX_NAME or _OWNED.fullmatch(name) is not None

    def layout_file(
        self, name: str, tensors: Sequence[TensorInfo], metadata: Mapping[str, str] | None = None, *,
        data_residue: int | Callable[[dict[str, int]], int | None] | None = None,
    ) -> FileLayout:
        return layout_file(name, tensors, metadata, data_residue=data_residue)

    def open_writer(self, folder: str | os.PathLike, layout: FileLayout) -> SafetensorsWriter:
        return SafetensorsWriter(folder, layout)

    shares_files = True
    streams_parts = True

    def sparse_writer(self, folder: str | os.PathLike, layout: FileLayout) -> SafetensorsWriter:
        return SafetensorsWriter(folder, layout, sparse=True)

    def create_shared(self, folder: str | os.PathLike, layout: FileLayout) -> None:
        SafetensorsWriter(folder, layout).release()

    def join_writer(self, folder: str | os.PathLike, layout: FileLayout) -> SafetensorsWriter:
        return SafetensorsWriter(folder, layout, joined=True)

    def commit_shared(self, folder: str | os.PathLike, layout: FileLayout) -> None:
        final = Path(folder) / layout.file
        replace_into(temp_path(final), final)

    def index(self, layouts: Sequence[FileLayout]) -> dict | None:
        if len(layouts) < 2:
            return None
        weight_map = {t.name: layout.file for layout in layouts for t in layout.tensors}
        total = sum(layout.size - len(layout.header) for layout in layouts)
        return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}

    def commit_files(self, layouts: Sequence[FileLayout], objects: bool) -> list[str]:
        return [] if len(layouts) < 2 else [INDEX_NAME]

    def commit(self, dest: Path, layouts: Sequence[FileLayout], reader: Any, *, objects: bool) -> bool:
        index = self.index(layouts)
        if index is None:
            return False
        write_index(dest, index["weight_map"], index["metadata"]["total_size"])
        return True
