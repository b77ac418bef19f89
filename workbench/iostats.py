"""Counts of the file I/O the package does, so tests and run reports can prove what was touched.

Every read of checkpoint bytes goes through `read_at`, every open through `open_for_read`; the
counters are per process and cheap. `IO.snapshot()` / `IO.reset()` bracket a measured region.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass, field

from .files import describe


@dataclass
class IOCounters:
    """Bytes read and written and files opened since the last reset."""

    bytes_read: int = 0
    bytes_written: int = 0
    files_opened: set[str] = field(default_factory=set)
    read_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = 0
            self.bytes_written = 0
            self.read_calls = 0
            self.files_opened = set()

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "files_opened": sorted(self.files_opened),
                "read_calls": self.read_calls,
            }

    def add_read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.read_calls += 1

    def add_written(self, n: int) -> None:
        with self._lock:
            self.bytes_written += n

    def add_open(self, path: str) -> None:
        with self._lock:
            self.files_opened.add(os.path.abspath(path))


IO = IOCounters()


def file_kind(path: str | os.PathLike) -> str | None:
    """None for a regular file (links followed), else what is there: 'missing', 'a directory', 'a FIFO' ..."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return _kind_of_mode(mode)


def _kind_of_mode(mode: int) -> str | None:
    """None for a regular file, else what it is ('a FIFO', 'a directory' ...), as files.describe says it."""
    return None if stat.S_ISREG(mode) else describe(mode)


def open_for_read(path: str | os.PathLike) -> int:
    """Open a regular file read-only and count it; returns a raw file descriptor.

    Checkpoint paths come from untrusted folders and indexes: a FIFO would block the open (and a read)
    forever and a directory fails only at the first read, so the open does not wait (O_NONBLOCK, which
    regular files ignore) and anything but a regular file raises OSError "not a regular file (a FIFO)".
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    kind = _kind_of_mode(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise OSError(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))
    IO.add_open(os.fspath(path))
    return fd


def read_at(fd: int, length: int, offset: int) -> bytes:
    """Read exactly `length` bytes at `offset` (pread loop); short files raise EOFError.

    `fd` may also be a range handle (anything with `read_at(length, offset)`, e.g. a remote file): readers
    that parse a layout with `read_at` then work on byte ranges without knowing where they come from.
    """
    if length == 0:
        return b""
    if type(fd) is not int:
        return fd.read_at(length, offset)
    data = os.pread(fd, length, offset)
    if len(data) < length:
        parts = [data]
        got = len(data)
        while got < length:
            chunk = os.pread(fd, length - got, offset + got)
            if not chunk:
                raise EOFError(f"wanted {length} bytes at offset {offset}, file ended after {got}")
            parts.append(chunk)
            got += len(chunk)
        data = b"".join(parts)
    IO.add_read(length)
    return data


def read_into(fd: int, buffer: memoryview, offset: int, *, counted: bool = True) -> None:
    """Fill `buffer` from the file at `offset` without an intermediate copy (added to the bytes read unless not
    `counted`: a caller that may read the same bytes again counts them once itself)."""
    length = len(buffer)
    got = 0
    while got < length:
        n = os.preadv(fd, [buffer[got:]], offset + got)
        if n == 0:
            raise EOFError(f"wanted {length} bytes at offset {offset}, file ended after {got}")
        got += n
    if counted:
        IO.add_read(length)
