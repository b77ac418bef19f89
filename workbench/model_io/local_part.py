"""Which part of a tensor this rank holds, and which bytes of a row-major file that part is.

A plain tensor is held whole. A DTensor (FSDP2, tensor parallel) is held as one block of its global
elements; when the block spans every dimension but the first (`Shard(0)`-style placements), it is a
run of whole rows, i.e. one contiguous byte range of the row-major tensor, which can be read alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..dtypes import dtype_bits, nbytes_of
from ..errors import MapperError
from ..module_state import is_dtensor


@dataclass(frozen=True)
class LocalPart:
    """The block [offset, offset + shape) of a tensor of `global_shape` that this rank holds."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """True when the block is the whole tensor."""
        return self.shape == self.global_shape

    @property
    def rows(self) -> tuple[int, int] | None:
        """(first row, end row) when the block is whole rows of the global tensor, else None."""
        if not self.global_shape:
            return (0, 1) if self.whole else None
        if self.shape[1:] != self.global_shape[1:]:
            return None
        return self.offset[0], self.offset[0] + self.shape[0]

    @property
    def numel(self) -> int:
        """Elements in the block."""
        return math.prod(self.shape)

    def byte_range(self, dtype: str) -> tuple[int, int] | None:
        """The block's bytes [begin, end) within the row-major tensor, when they are contiguous."""
        rows = self.rows
        if rows is None:
            return None
        if not self.global_shape:
            return 0, nbytes_of(dtype, 1)
        row_elems = math.prod(self.global_shape[1:])
        if (row_elems * dtype_bits(dtype)) % 8:  # rows of a sub-byte dtype that do not end on a byte
            return None
        row_bytes = nbytes_of(dtype, row_elems)
        return rows[0] * row_bytes, rows[1] * row_bytes

    def take(self, full: Any) -> Any:
        """This block of a full tensor (a view)."""
        if self.whole:
            return full
        index = tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape, strict=True))
        return full[index]


def whole_part(shape: tuple[int, ...]) -> LocalPart:
    """The part of a tensor held whole."""
    return LocalPart(tuple(0 for _ in shape), tuple(shape), tuple(shape))


def local_part(tensor: Any, key: str = "") -> LocalPart:
    """The block of `tensor`'s global elements held by this rank."""
    shape = tuple(int(s) for s in tensor.shape)
    if not is_dtensor(tensor):
        return whole_part(shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(placement.is_partial() for placement in tensor.placements):
        raise MapperError(
            f"Cannot place {key!r}: it has a Partial placement ({tensor.placements}), so no rank holds its values. "
            "Redistribute it to Shard or Replicate first.",
            tensor=key,
        )
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    part = LocalPart(tuple(int(o) for o in offset), tuple(int(s) for s in local_shape), shape)
    held = tuple(tensor.to_local().shape)
    if held != part.shape:
        raise MapperError(
            f"Cannot place {key!r}: its placements {tensor.placements} give this rank a {list(part.shape)} block but the "
            f"local tensor is {list(held)} (padded or custom sharding). Load it with the framework's own loader.",
            tensor=key,
        )
    return part


def local_tensor(tensor: Any) -> Any:
    """The tensor this rank stores for `tensor` (the local shard of a DTensor, else itself), detached."""
    return (tensor.to_local() if is_dtensor(tensor) else tensor).detach()
