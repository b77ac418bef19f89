"""Row jobs: an operation the engine can run a few rows at a time, with numpy, straight from the source's raw bytes.

Some operations make each output row from the same rows of their inputs (a conversion along rows, a permutation
within fixed blocks of rows, inputs stacked one after another). Such an op may offer `rows(group, ahead)`: a
`RowJob` describing the bound `group` (`ahead`: the ops a `Sequential` applies before it in the same group, which the
job may take into its chunks, or refuse by returning None). The planner asks `row_job(group)` of any group: a job
whose inputs lie raw on disk becomes a `rows` step holding `held_bytes(chunk_bytes)`; the engine (`engine.rows`)
reads each input a chunk of whole rows at a time, hands it to the job's converter and writes the bytes it returns at
their place in the output. Neither asks what the job makes: the kernels stay with the op that offers it.

A `Function` offers rows when its callable carries a `rows` attribute (`rows(function, group, ahead) -> RowJob | None`)
and its module is already imported (binding imported it for `infer`): asking never imports a user's module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..catalog import TensorInfo
from .compose import Sequential

# A job's converter: (input index, first row of the chunk, the chunk's raw bytes (whole rows), the bytes of the
# input's `whole` tensors) -> (the output bytes as a numpy uint8 array, values that overflowed, the largest of them).
Converter = Callable[[int, int, Any, Sequence[Any]], tuple[Any, int, float]]


class RowJob(Protocol):
    """What the planner and the engine need of a group converted row chunk by row chunk (see the module text)."""

    inputs: tuple[TensorInfo, ...]  # read by rows, in order, each into the next rows of the output
    output: TensorInfo
    overflow_dtype: str  # the dtype overflow counts are reported for (`on_overflow`)
    value_dtype: str | None  # the output's element dtype when rows are values (a check reports how far), else None
    libraries: tuple[str, ...]  # modules the converter imports beyond numpy (imported before the memory baseline)
    # what importing them adds to a process's RSS (measured); ml_dtypes alone is counted by planning.rss from its
    # calibration (`rss_calibration.ML_DTYPES_BYTES`, measured by scripts/calibrate_rss.py), so such a job states 0
    library_bytes: int
    library_detail: str  # how the plan's RSS table names them

    @property
    def rows(self) -> int:
        """Rows of one input."""

    @property
    def in_row(self) -> int:
        """Bytes of one input row as stored."""

    @property
    def out_row(self) -> int:
        """Bytes one row becomes in the output."""

    def whole(self, k: int) -> tuple[TensorInfo, ...]:
        """Tensors read whole beside input `k` (e.g. its scales), handed to the converter with each chunk."""

    def budget(self, chunk_bytes: int) -> int:
        """The bytes one chunk may hold under a plan's `chunk_bytes`."""

    def chunk_rows(self, budget: int) -> int:
        """Rows per chunk holding at most `budget` bytes (at least the smallest unit of rows)."""

    def held(self, rows: int) -> int:
        """Bytes held while converting `rows` rows."""

    def held_bytes(self, chunk_bytes: int) -> int:
        """What the plan counts for the step: `held` of one chunk under `budget(chunk_bytes)`."""

    def converter(self, rows: int) -> Converter:
        """A converter for chunks of at most `rows` rows (its buffers made once, reused for every chunk)."""


def row_job(group: Any) -> RowJob | None:
    """The row job `group`'s op offers, or None. A `Sequential` offers what its last op offers with the others ahead."""
    op = group.op
    while isinstance(op, Sequential) and len(op.mappers) == 1:
        op = op.mappers[0]
    ahead: tuple[Any, ...] = ()
    if isinstance(op, Sequential):
        *first, op = op.mappers
        ahead = tuple(first)
    offer = getattr(op, "rows", None)
    return offer(group, ahead) if callable(offer) else None


def offered_rows(fn: str) -> Callable[..., RowJob | None] | None:
    """The `rows` attribute of the callable `fn` ('package.module:name') names, when its module is imported."""
    module_name, _, attribute = fn.partition(":")
    target: Any = sys.modules.get(module_name)
    for part in attribute.split("."):
        target = getattr(target, part, None)
    return getattr(target, "rows", None)


__all__ = ["Converter", "RowJob", "offered_rows", "row_job"]
