"""A catalog over the planned data slots of files the workbench wrote, for `--verify` of formats it does not read."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..catalog import Catalog, TensorInfo


class _SlotReader:
    """Reads the data slots of GGUF files the workbench wrote (checked against their own headers first)."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest

    def locate(self, info: TensorInfo) -> tuple[Path, int, int]:
        return self.dest / info.file, info.begin, info.end

    def read_bytes(self, info: TensorInfo) -> bytes:
        from ..iostats import open_for_read, read_at

        fd = open_for_read(self.dest / info.file)
        try:
            return read_at(fd, info.nbytes, info.begin)
        finally:
            os.close(fd)

    def close(self) -> None:
        return None


def slot_catalog(dest: Path, format: str, slots: Iterable[TensorInfo]) -> Catalog:
    """A catalog whose tensors are `slots` (file, begin, end as planned) in the files under `dest`."""
    return Catalog(root=dest, format=format, tensors={t.name: t for t in slots}, reader=_SlotReader(dest))


__all__ = ["slot_catalog"]
