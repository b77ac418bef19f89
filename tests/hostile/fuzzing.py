"""Byte mutation driven by hypothesis, and the contract every reader must keep on whatever it is given.

The contract (`check_reader`): opening a checkpoint and reading each of its tensors either succeeds with
self-consistent results or raises a `WorkbenchError` subclass; nothing else escapes. No file outside the
checkpoint folder is opened, no read asks for bytes past the end of a file, the bytes read stay within
a small multiple of the checkpoint's size, and so does the memory allocated (tracemalloc peak).
"""

from __future__ import annotations

import functools
import os
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from workbench.errors import WorkbenchError
from workbench.explore.verify import verify
from workbench.formats import open_catalog
from workbench.iostats import IO

# Allocation budget: a reader may hold a few copies of the checkpoint (raw bytes, an assembled tensor and
# its copy) plus a fixed interpreter overhead, never what a length field claims. Unpickled objects cost
# more than their bytes: one EMPTY_SET opcode byte becomes a 216-byte set, so the factor allows that.
ALLOC_FACTOR = 256
ALLOC_SLACK = 8 << 20
# Bytes read: opening reads headers and directories (a zip's tail may be searched twice), reading one
# tensor reads its bytes and, for DCP, its chunk's small zip directory: each stays within a few file sizes.
READ_FACTOR = 4

INTERESTING_INTS = (0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1)
INTERESTING_TEXT = (
    b"../", b"/etc/passwd", b"..\\", b"\x00", b"-1", b"1e999", b"18446744073709551616", b"null", b"[]", b"{}",
    b'"', b"\\u0000", b"NaN", b"true", b"99999999999", b"F64", b"BOOL", b"__metadata__",
    b"[4611686018427387904, 4611686018427387904, 0]", b"\\u005f_metadata__", b"dt\\u0079pe", b"sh\\u0061pe",
)
# Families of issue 12: a memo slot paid for by bytes after STOP, integers of thousands of digits, keys
# repeated through JSON escapes. Their edits are whole constructs, which byte-level edits rarely build.
PADDING = 2 << 20  # bytes appended after the end: deflate ~57:1, as the reported bomb did
HUGE_DIGITS = b"9" * 5000
HUGE_LONG4 = b"\x8b" + (3000).to_bytes(4, "little") + b"\x01" * 3000 + b"0"  # LONG4 of 3000 bytes, then POP
JSON_KEYS = (b'"dtype": ', b'"shape": ', b'"data_offsets": ', b'"__metadata__": ', b'"weight_map": ')


@functools.cache
def _padding(size: int) -> bytes:
    import numpy as np

    return (np.random.default_rng(0).random(size) < 0.008).astype(np.uint8).tobytes()


def _escaped(key: bytes) -> bytes:
    """`"dtype": ` -> `"\\u0064type": `: the same key once decoded."""
    return b'"\\u%04x' % key[1] + key[2:]
# Pickle opcodes that build, call or look things up: inserting them steers mutations into the unpickler's paths.
PICKLE_OPS = (b"c", b"\x93", b"R", b"b", b"s", b"u", b"a", b"e", b"t", b"\x85", b"\x86", b"\x87", b"h", b"j", b"g", b"p",
              b"\x94", b"(", b"0", b"2", b"Q", b"\x81", b"\x82", b"\x92", b"}", b"]", b")", b"N", b".")


@st.composite
def mutations(draw: st.DrawFn, size: int) -> list[tuple]:
    """A short list of edits to a payload of `size` bytes (hypothesis shrinks it to the fewest that matter)."""
    n = draw(st.integers(1, 6))
    pos = st.integers(0, max(size, 1))
    kinds = st.sampled_from(
        ("flip", "byte", "int", "text", "op", "insert", "delete", "splice", "truncate", "memo-bomb", "pad", "bigint", "dupkey")
    )
    edits = []
    for _ in range(n):
        kind = draw(kinds)
        if kind == "flip":
            edits.append((kind, draw(pos), draw(st.integers(0, 7))))
        elif kind == "byte":
            edits.append((kind, draw(pos), draw(st.integers(0, 255))))
        elif kind == "int":
            edits.append((kind, draw(pos), draw(st.sampled_from(INTERESTING_INTS)), draw(st.sampled_from((1, 2, 4, 8)))))
        elif kind == "text":
            edits.append((kind, draw(pos), draw(st.sampled_from(INTERESTING_TEXT))))
        elif kind == "op":
            edits.append((kind, draw(pos), draw(st.sampled_from(PICKLE_OPS))))
        elif kind == "insert":
            edits.append((kind, draw(pos), draw(st.binary(min_size=1, max_size=16))))
        elif kind in ("delete", "splice"):
            edits.append((kind, draw(pos), draw(st.integers(1, 64)), draw(pos)))
        elif kind == "bigint":
            edits.append((kind, draw(pos), draw(st.booleans())))
        elif kind == "dupkey":
            edits.append((kind, draw(pos), draw(st.sampled_from(JSON_KEYS))))
        else:
            edits.append((kind, draw(pos)))
    return edits


def apply_mutations(data: bytes, edits: list[tuple]) -> bytes:
    """Apply `mutations()` edits in order; positions wrap around the current length."""
    out = bytearray(data)
    for kind, where, *args in edits:
        at = where % (len(out) + 1)
        if kind == "flip" and at < len(out):
            out[at] ^= 1 << args[0]
        elif kind == "byte" and at < len(out):
            out[at] = args[0]
        elif kind == "int":
            value, width = args
            blob = (value % (1 << (8 * width))).to_bytes(width, "little")
            out[at : at + width] = blob
        elif kind == "text":
            out[at : at + len(args[0])] = args[0]
        elif kind in ("op", "insert"):
            out[at:at] = args[0]
        elif kind == "delete":
            del out[at : at + args[0]]
        elif kind == "splice":
            src = args[1] % (len(out) + 1)
            out[at:at] = out[src : src + args[0]]
        elif kind == "truncate":
            del out[at:]
        elif kind == "memo-bomb":  # after PROTO: push, memo slot near the final size, pop; then padding after STOP
            index = len(out) + 6 + PADDING - 100
            out[2:2] = b"]r" + index.to_bytes(4, "little") + b"0"
            out += _padding(PADDING)
        elif kind == "pad":
            out += _padding(4096)
        elif kind == "bigint":  # digits where a number may stand, or a LONG4 right after PROTO
            if args[0]:
                out[at:at] = HUGE_DIGITS
            else:
                out[2:2] = HUGE_LONG4
        elif kind == "dupkey":  # repeat a JSON key through an escape, before its first plain spelling
            found = bytes(out).find(args[0], at % (len(out) + 1))
            found = found if found >= 0 else bytes(out).find(args[0])
            if found >= 0:
                out[found:found] = _escaped(args[0]) + b"null, "
    return bytes(out)


class OutOfFileRead(BaseException):  # noqa: N818 - a BaseException so that no reader's `except Exception` hides it
    """A reader asked for bytes past the end of a file (a length it did not check)."""


@contextmanager
def reads_stay_inside_files():
    """Make every pread/preadv beyond the end of its file raise `OutOfFileRead` instead of reading."""
    real_pread, real_preadv = os.pread, os.preadv

    def check(fd: int, length: int, offset: int) -> None:
        size = os.fstat(fd).st_size
        if offset < 0 or length < 0 or offset + length > size:
            raise OutOfFileRead(f"read of {length} bytes at offset {offset} of a {size}-byte file")

    def pread(fd: int, length: int, offset: int) -> bytes:
        check(fd, length, offset)
        return real_pread(fd, length, offset)

    def preadv(fd: int, buffers, offset: int, *flags) -> int:
        check(fd, sum(memoryview(b).nbytes for b in buffers), offset)
        return real_preadv(fd, buffers, offset, *flags)

    os.pread, os.preadv = pread, preadv
    try:
        yield
    finally:
        os.pread, os.preadv = real_pread, real_preadv


@dataclass
class Outcome:
    """What the readers did with one input."""

    accepted: bool
    error: str = ""
    tensors: int = 0
    peak_bytes: int = 0


def _tree_size(root: Path) -> int:
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _inside(path: str, root: Path) -> bool:
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) == real_root


class _Reads:
    """Collects the files opened across IO resets and bounds the bytes read by each measured step."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.opened: set[str] = set()
        IO.reset()

    def step(self, what: str) -> None:
        snap = IO.snapshot()
        IO.reset()
        self.opened.update(snap["files_opened"])
        assert snap["bytes_read"] <= READ_FACTOR * self.size, f"{what} read {snap['bytes_read']} bytes of a {self.size}-byte checkpoint"


def _read_everything(catalog, reads: _Reads) -> None:
    for name, info in catalog.tensors.items():
        data = catalog.read_bytes(name)
        reads.step(f"reading {name!r}")
        assert len(data) == info.nbytes, f"{name}: read {len(data)} bytes, the catalog says {info.nbytes}"
        where = catalog.locate(name)
        if where is not None:
            file, begin, end = where
            assert 0 <= begin <= end <= os.path.getsize(file) and end - begin == info.nbytes, (name, where)


class _Memory:
    """Peak of traced memory (Python objects and the C allocations made through Python's allocators) while the
    block runs. Tracing starts here when it is off, and stops on exit: tracing everything else (hypothesis drawing
    inputs, pytest) slowed the fuzz tests several-fold, and more the longer a module ran. Blocks allocated before
    the start are not traced, so freeing one cannot hide an allocation: the peak is never below that of tracing
    all along."""

    def __enter__(self) -> _Memory:
        self.started = not tracemalloc.is_tracing()
        if self.started:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self.baseline = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.traced_peak = tracemalloc.get_traced_memory()[1] - self.baseline
        if self.started:
            tracemalloc.stop()


def check_reader(path: Path, root: Path) -> Outcome:
    """Open `path`, read every tensor, verify it; assert the reader contract (see the module docstring).

    `root` is the folder the checkpoint lives in: nothing outside it may be opened. Memory is traced during the
    call only (see `_Memory`), unless the caller traces already.
    """
    size = _tree_size(root)
    reads = _Reads(size)
    outcome = Outcome(accepted=False)
    opened = False
    with _Memory() as memory, reads_stay_inside_files():
        try:
            catalog = open_catalog(path)
            opened = True
            reads.step("opening")
            try:
                _read_everything(catalog, reads)
            finally:
                if catalog.reader is not None:
                    catalog.reader.close()
            outcome.accepted, outcome.tensors = True, len(catalog)
        except WorkbenchError as exc:
            outcome.error = str(exc)
            assert outcome.error.startswith("Cannot "), f"the message does not say what failed: {outcome.error!r}"
        finally:
            reads.step("the failed open")
        report = verify(path)
        reads.step("verify")
    outcome.peak_bytes = memory.traced_peak
    outside = sorted(f for f in reads.opened if not _inside(f, root))
    assert not outside, f"opened files outside the checkpoint folder: {outside}"
    assert opened or not report.ok, "verify passed a checkpoint that cannot be opened"
    budget = ALLOC_FACTOR * size + ALLOC_SLACK
    assert memory.traced_peak <= budget, f"allocated {memory.traced_peak} bytes (tracemalloc) for a {size}-byte checkpoint"
    return outcome
