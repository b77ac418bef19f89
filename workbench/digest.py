"""A tensor's identity as bytes: the SHA-256 of its row-major data, read in bounded chunks.

Shared by the checksum sidecars (`explore.checksums`) and the engine's re-reading of its outputs
(`engine.output_check`), so both agree on what "the same tensor" means whatever the format.
"""

from __future__ import annotations

import hashlib
import os

from .catalog import Catalog
from .errors import CheckpointError
from .iostats import open_for_read, read_at

CHUNK_BYTES = 16 << 20


def tensor_sha256(catalog: Catalog, name: str, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The hex SHA-256 of one tensor's row-major bytes, read at most `chunk_bytes` at a time when possible."""
    digest = hashlib.sha256()
    where = catalog.locate(name)
    if where is None:
        digest.update(catalog.read_bytes(name))
        return digest.hexdigest()
    path, begin, end = where
    try:
        fd = open_for_read(path)
    except OSError as exc:
        raise CheckpointError(f"Cannot hash tensor {name!r}: {path} cannot be opened ({exc.strerror}).", file=str(path), tensor=name) from None
    try:
        for offset in range(begin, end, chunk_bytes):
            try:
                digest.update(read_at(fd, min(chunk_bytes, end - offset), offset))
            except EOFError:
                raise CheckpointError(
                    f"Cannot hash tensor {name!r}: {path} ended early (it was truncated while being read).", file=str(path), tensor=name
                ) from None
    finally:
        os.close(fd)
    return digest.hexdigest()
