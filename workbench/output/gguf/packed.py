"""GGUF array values kept as the bytes the file holds, not as Python lists.

A 128k-152k token vocabulary is a few MiB in a GGUF header but, as lists of str and int objects held by a
`GGUFWriter` until the header is packed, several times that in the process (and more once the allocator has
scattered them among the parsed tokenizer.json). `PackedArray` holds one array already packed the way the `gguf`
package's writer packs it (little-endian: item type, count, then each item: a string as u64 length + UTF-8 bytes,
an int32 / float32 as 4 bytes), so the plan keeps only those bytes and the header is their concatenation.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

ARRAY, INT32, FLOAT32, STRING = 9, 5, 6, 8  # gguf.GGUFValueType values


@dataclass(frozen=True)
class PackedArray:
    """One GGUF array value as file bytes: `sub_type` (a GGUFValueType), `count` items, `data` the packed items."""

    sub_type: int
    count: int
    data: bytes

    def packed(self) -> bytes:
        """The value as a GGUF key/value pair holds it after the key: ARRAY, item type, count, items."""
        return struct.pack("<IIQ", ARRAY, self.sub_type, self.count) + self.data

    def __len__(self) -> int:
        return self.count


def strings(items: Iterable[str | bytes]) -> PackedArray:
    """A GGUF array of strings (str encoded as UTF-8, bytes as they are)."""
    out = bytearray()
    count = 0
    length = struct.Struct("<Q").pack
    for item in items:
        raw = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        out += length(len(raw))
        out += raw
        count += 1
    return PackedArray(STRING, count, bytes(out))


def int32s(values: Sequence[int]) -> PackedArray:
    """A GGUF array of int32 (token types)."""
    return PackedArray(INT32, len(values), struct.pack(f"<{len(values)}i", *(int(v) for v in values)))


def float32s(values: Sequence[float]) -> PackedArray:
    """A GGUF array of float32 (token scores)."""
    return PackedArray(FLOAT32, len(values), struct.pack(f"<{len(values)}f", *values))


def add_packed(writer: Any, key: str, value: PackedArray) -> None:
    """Put a packed array into a `gguf.GGUFWriter`'s key/values, in order, as its `add_array` would (an empty
    array is left out, as the writer leaves it out)."""
    if value.count:
        writer.kv_data[0][key] = value


__all__ = ["PackedArray", "add_packed", "float32s", "int32s", "strings"]
