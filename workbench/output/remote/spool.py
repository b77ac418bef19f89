"""The local spool of a remote destination: where output files are written before they are uploaded.

Each rank (each node) writes its files into its own spool folder; a file leaves the spool once its upload
finished. `SpoolGate` keeps the bytes in the spool within `--spool-size`: before a rank opens a new file it
waits until the files still waiting for upload leave room for it. Files being written are never waited on
(their steps are running), so the bound is `max(spool size, bytes of the files open at once)`, which is what
`plan.spool_bytes` states.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import tempfile
import threading
from pathlib import Path

SPOOL_DIR_ENV = "WORKBENCH_SPOOL_DIR"
DEFAULT_SPOOL_SIZE = 4 << 30


def spool_folder(url: str, spool_dir: str | None = None) -> Path:
    """The local spool folder for a conversion into `url`: `spool_dir`, else `$WORKBENCH_SPOOL_DIR`, else the
    temporary folder; a subfolder named after the URL, so two conversions into different places never share."""
    root = spool_dir or os.environ.get(SPOOL_DIR_ENV) or os.path.join(tempfile.gettempdir(), "workbench-spool")
    tag = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return Path(os.path.abspath(root)) / tag


_PUNCH_HOLE = 0x02 | 0x01  # <linux/falloc.h>: FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_PROBE_BYTES = 1 << 16  # written, then its first half punched: larger than any file system's block
_fallocate = None


def punch(fd: int, offset: int, length: int) -> int:
    """Free the disk blocks of bytes [offset, offset+length) of an open file (they read back as zeros, the size stays):
    0, or the errno (EOPNOTSUPP on a file system that cannot punch holes: vfat, ramfs, some network mounts)."""
    global _fallocate
    if _fallocate is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        call = getattr(libc, "fallocate", None)
        if call is None:  # not Linux
            return errno.EOPNOTSUPP
        call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        _fallocate = call
    return 0 if _fallocate(fd, _PUNCH_HOLE, offset, length) == 0 else ctypes.get_errno()


def can_punch_holes(folder: str | os.PathLike) -> bool:
    """Whether files in `folder` (created later if missing: its nearest existing parent is asked, the same file
    system) can free a range's blocks: tried on a small scratch file there, deleted at once. An unwritable
    folder answers True, so the run names the real problem when it creates its files."""
    probe_in = Path(folder)
    while not probe_in.is_dir() and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    try:
        fd, name = tempfile.mkstemp(prefix=".workbench-probe-", dir=probe_in)
    except OSError:
        return True
    try:
        os.pwrite(fd, b"\0" * _PROBE_BYTES, 0)
        return punch(fd, 0, _PROBE_BYTES // 2) == 0
    finally:
        os.close(fd)
        os.unlink(name)


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    """The SHA-256 of a finished spool file (read back from the page cache right after it was written)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class SpoolGate:
    """Bytes held in one process's spool: files open for writing plus files waiting for (or in) upload."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open = 0  # files being written
        self._waiting = 0  # finished files not yet uploaded
        self.peak = 0  # the most bytes held at once
        self._cond = threading.Condition()

    def open(self, size: int, cancelled: threading.Event | None = None) -> None:
        """Account for a file about to be written; waits while finished files awaiting upload leave no room."""
        with self._cond:
            while self._waiting and self._open + self._waiting + size > self.limit:
                if cancelled is not None and cancelled.is_set():
                    return
                self._cond.wait(0.1)
            self._open += size
            self.peak = max(self.peak, self._open + self._waiting)

    def finished(self, size: int) -> None:
        """The file is complete: it now waits for its upload."""
        with self._cond:
            self._open -= size
            self._waiting += size

    def released(self, size: int, *, was_open: bool = False) -> None:
        """The file left the spool (uploaded and deleted, or aborted)."""
        with self._cond:
            if was_open:
                self._open -= size
            else:
                self._waiting -= size
            self._cond.notify_all()
