"""Source files the engine reads, opened lazily through the counted `open_for_read`.

Only files a step actually needs are opened, so the run's opened-file set equals the plan's.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError
from ..iostats import open_for_read


class SourceFiles:
    """Open read descriptors keyed by absolute path; `close()` releases them all."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._by_given: dict[str | os.PathLike, int] = {}  # the path as given (a reader's cached Path): no fspath per call

    def fd(self, path: str | os.PathLike) -> int:
        """The descriptor of `path`, opening it on first use."""
        fd = self._by_given.get(path)
        if fd is not None:
            return fd
        key = os.fspath(path)
        fd = self._fds.get(key)
        if fd is None:
            try:
                fd = open_for_read(key)
            except OSError as exc:
                raise CheckpointError(
                    f"Cannot open source file {key}: {exc.strerror}. Was the checkpoint moved or deleted during the conversion?",
                    file=key,
                ) from None
            self._fds[key] = fd
        self._by_given[path] = fd
        return fd

    def close(self) -> None:
        """Close every descriptor."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._by_given.clear()
