"""Reading the bytes of a group's outputs straight from the source, whole or any byte range of them.

A byte-level group (rename, concat or split along dim 0 ...) has a recipe: each output is a run of
input byte slices. So any byte range of an output, such as the rows one rank owns, maps to a few
source byte ranges and is read alone, directly into the destination's memory when it can be.
Inputs whose bytes are not raw on disk (pickled, chunked) are read whole once per group.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..dtypes import to_torch
from ..engine.memory import HeldBytes
from ..engine.sources import SourceFiles
from ..iostats import read_into
from ..mapper.groups import Group


def pieces_in_range(group: Group, output: str, begin: int, end: int) -> Iterator[tuple[TensorInfo, int, int, int]]:
    """(input, offset in the input, offset in the output, length) of the source bytes making bytes
    [begin, end) of a byte-level group's `output`."""
    inputs = group.inputs
    by_name = {inputs[0].name: inputs[0]} if len(inputs) == 1 else {t.name: t for t in inputs}
    position = 0
    for piece in group.recipe[output]:  # type: ignore[index]
        if position >= end:
            break
        low, high = max(begin, position), min(end, position + piece.length)
        if low < high:
            yield by_name[piece.source], piece.begin + low - position, low, high - low
        position += piece.length


class GroupReader:
    """Reads source bytes for groups of one catalog; counts the buffers it holds in `held`."""

    def __init__(self, catalog: Catalog, held: HeldBytes) -> None:
        self.catalog = catalog
        self.held = held
        self.files = SourceFiles()
        self._whole: dict[str, bytearray] = {}

    def _located(self, info: TensorInfo) -> tuple[int, int] | None:
        reader = self.catalog.reader
        where = reader.locate(info) if reader is not None else None
        if where is None:
            return None
        return self.files.fd(where[0]), where[1]

    def whole(self, info: TensorInfo) -> bytearray:
        """An input's bytes, read once per group and held until `release()`."""
        data = self._whole.get(info.name)
        if data is None:
            where = self._located(info)
            if where is None:
                data = bytearray(self.catalog.read_bytes(info.name))
            else:
                data = bytearray(info.nbytes)
                if info.nbytes:
                    read_into(where[0], memoryview(data), where[1])
            self._whole[info.name] = data
            self.held.hold(len(data))
        return data

    def read_range(self, group: Group, output: str, begin: int, end: int, into: memoryview) -> None:
        """Bytes [begin, end) of `output` (a byte-level group's) into `into`, reading only what they need."""
        for info, source_offset, at, length in pieces_in_range(group, output, begin, end):
            target = into[at - begin : at - begin + length]
            where = self._located(info)
            if where is not None:
                read_into(where[0], target, where[1] + source_offset)
            else:
                target[:] = memoryview(self.whole(info))[source_offset : source_offset + length]

    def tensors(self, group: Group) -> dict[str, Any]:
        """Every input of a group as a torch tensor over its bytes (held until `release()`)."""
        import torch

        out = {}
        for info in group.inputs:
            dtype = to_torch(info.dtype)
            if info.numel == 0:
                out[info.name] = torch.empty(info.shape, dtype=dtype)
            else:
                out[info.name] = torch.frombuffer(self.whole(info), dtype=dtype).reshape(info.shape)
        return out

    def release(self) -> None:
        """Drop the whole inputs read for the current group."""
        self.held.release(sum(len(d) for d in self._whole.values()))
        self._whole.clear()

    def close(self) -> None:
        """Release buffers and close the source files."""
        self.release()
        self.files.close()
