"""Read-only descriptors for the files of one checkpoint, opened on first use and shared by threads.

Every reader keeps its files open between tensor reads (opening a shard per tensor would cost a
syscall pair per tensor on 100k-tensor checkpoints); this is the one place that does it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..errors import CheckpointError
from ..iostats import open_for_read


class FilePool:
    """Counted, cached `open_for_read` descriptors keyed by path relative to `root`.

    `root` may be a folder (files are `root / rel`) or a single file (every `rel` names it).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._single_file = not root.is_dir()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def path(self, rel: str) -> Path:
        """Absolute path of one file of the checkpoint."""
        return self.root if self._single_file else self.root / rel

    def fd(self, rel: str) -> int:
        """The open descriptor of `rel`, opening (and counting) it the first time."""
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                path = self.path(rel)
                try:
                    fd = open_for_read(path)
                except OSError as exc:
                    raise CheckpointError(
                        f"Cannot open {path}: {exc.strerror}. Was the checkpoint moved or deleted?", file=str(path)
                    ) from None
                self._fds[rel] = fd
            return fd

    def close(self) -> None:
        """Close every descriptor; later reads reopen (and count) their files again."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass
