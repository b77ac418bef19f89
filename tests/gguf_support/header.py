"""A quick reader of a GGUF file's header (metadata and tensor list), for tests that look at big vocabularies.

gguf-py's `GGUFReader` makes a numpy view per string, so it takes ~20 s for a file with Qwen2's 151k tokens on
the test VM; this reads the same header in well under a second with plain `struct`. Written from the format's
description (little-endian; key/value pairs, then tensor infos), not from either implementation. Tests that need
tensor data or a first-class reader of the file still use `GGUFReader`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# value type code -> struct format of one scalar (8 string, 9 array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFHeader:
    """metadata: key -> value (str, int, float, bool or list of those); tensors: (name, type name, dims) in file order."""

    metadata: dict[str, Any]
    tensors: list[tuple[str, str, tuple[int, ...]]]


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return self.data[self.at - n : self.at].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS:  # one unpack for the whole array
                values = struct.unpack_from(f"<{count}{_SCALARS[item]}", self.data, self.at)
                self.at += struct.calcsize(f"<{count}{_SCALARS[item]}")
                return list(values)
            return [self.value(item) for _ in range(count)]
        return self.take(_SCALARS[kind])


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor list of the GGUF file at `path` (the header only: tensor data is not read)."""
    from gguf import GGMLQuantizationType

    data = Path(path).read_bytes()
    cursor = _Cursor(data)
    if data[:4] != b"GGUF":
        raise ValueError(f"Cannot read GGUF header: no GGUF magic ({path}). Pass a .gguf file.")
    cursor.at = 4
    cursor.take("I")  # version
    n_tensors, n_kv = cursor.take("Q"), cursor.take("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("I"))
    tensors = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
        kind = GGMLQuantizationType(cursor.take("I")).name
        cursor.take("Q")  # offset in the data section
        tensors.append((name, kind, dims))
    return GGUFHeader(metadata, tensors)
