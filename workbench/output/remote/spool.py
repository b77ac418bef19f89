"""The local spool of a remote destination: where output files are written before they are uploaded.

Each rank (each node) writes its files into its own spool folder; a file leaves the spool once its upload
finished. `SpoolGate` keeps the bytes in the spool within `--spool-size`: before a rank opens a new file it
waits until the files still waiting for upload leave room for it. Files being written are never waited on
(their steps are running), so the bound is `max(spool size, bytes of the files open at once)`, which is what
`plan.spool_bytes` states.
"""

from __future__ import annotations

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
