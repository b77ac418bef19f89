"""Value statistics of tensors, computed on demand in bounded chunks.

A tensor is read a slice of elements at a time straight from its byte range, so the memory held is a
chunk (plus its float64 copy), never the whole tensor and never the whole checkpoint. Used by
`Checkpoint.stats`, `Checkpoint.diff(values=True)` and `Checkpoint.plot_histogram`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..catalog import Catalog
from ..dtypes import DTYPE_BITS, to_torch
from ..errors import CheckpointError
from ..iostats import open_for_read, read_into

# 4M elements: 16 MiB of F32 read at a time, 32 MiB once widened to float64.
DEFAULT_CHUNK_ELEMENTS = 1 << 22

ReadHook = Callable[[int], None]
"""Called with the number of bytes just read, after each chunk. A reader shows progress with it, and
stops a read early by raising from it (the exception propagates out of the read; files are closed)."""


def _check_chunkable(catalog: Catalog, name: str) -> None:
    code = catalog[name].dtype
    if DTYPE_BITS[code] % 8:
        raise CheckpointError(
            f"Cannot compute values of tensor {name!r}: its dtype {code} packs several values per byte, which the "
            "workbench does not unpack. Read its raw bytes with catalog.read_bytes() instead.",
            tensor=name,
        )
    if code == "C64":
        raise CheckpointError(
            f"Cannot compute value statistics of tensor {name!r}: it is complex (C64). Load it with .load() and "
            "take .real / .abs() first.",
            tensor=name,
        )


def read_located(fd: int, view: memoryview, offset: int, path: str | os.PathLike[str], name: str) -> None:
    """Fill `view` with bytes of tensor `name` from its file `path` (open as `fd`) at `offset`.

    A file shorter than its catalog says changed after it was opened: that is a CheckpointError naming the
    tensor and the file, not a bare EOFError.
    """
    try:
        read_into(fd, view, offset)
    except EOFError:
        raise CheckpointError(
            f"Cannot read tensor {name!r} from {path}: the file ended early (it changed after it was opened). "
            "Re-open the checkpoint.",
            file=str(path),
            tensor=name,
        ) from None


def iter_chunks(
    catalog: Catalog, name: str, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, on_read: ReadHook | None = None
) -> Iterator[Any]:
    """Yield the tensor's values as consecutive 1-D torch tensors of at most `chunk_elements` each.

    Each yielded tensor views a buffer the next step reuses: use (or copy) it before advancing.
    `on_read(nbytes)` is called after each chunk is read, before it is yielded.
    """
    import torch

    if chunk_elements < 1:
        raise CheckpointError(f"Cannot read tensor {name!r} in chunks of {chunk_elements} elements: use a positive chunk size.")
    info = catalog[name]
    values = getattr(catalog.reader, "dequantized_chunks", None)  # a GGUF Q4_K tensor: its values, not its block bytes
    chunks = values(info, chunk_elements) if values is not None else None
    if chunks is not None:
        for chunk, nbytes in chunks:
            if on_read is not None:
                on_read(nbytes)
            yield torch.from_numpy(chunk)
        return
    _check_chunkable(catalog, name)
    dtype = to_torch(info.dtype)
    item = DTYPE_BITS[info.dtype] // 8
    total = info.numel
    if total == 0:
        return
    where = catalog.locate(name)
    if where is None:  # bytes not raw on disk (e.g. inside a pickle): one read of this tensor only
        data = bytearray(catalog.read_bytes(name))
        for start in range(0, total, chunk_elements):
            count = min(chunk_elements, total - start)
            if on_read is not None:
                on_read(count * item)
            yield torch.frombuffer(data, dtype=dtype, count=count, offset=start * item)
        return
    path, begin, _end = where
    buffer = bytearray(min(chunk_elements, total) * item)
    fd = open_for_read(path)
    try:
        for start in range(0, total, chunk_elements):
            count = min(chunk_elements, total - start)
            view = memoryview(buffer)[: count * item]
            read_located(fd, view, begin + start * item, path, name)
            if on_read is not None:
                on_read(count * item)
            yield torch.frombuffer(buffer, dtype=dtype, count=count)
    finally:
        os.close(fd)


@dataclass
class RunningStats:
    """Min, max, mean and unbiased std of the finite values seen so far, plus NaN/Inf counts.

    Chunks are merged with the pairwise (Chan et al.) update, so the result does not depend on the
    chunk size beyond float64 rounding.
    """

    count: int = 0  # finite values
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.nan
    max: float = math.nan
    nan: int = 0
    inf: int = 0

    def add(self, chunk: Any) -> None:
        """Fold one chunk (any real torch dtype) into the running figures."""
        import torch

        values = chunk.to(torch.float64)
        if values.is_floating_point():
            nan_mask = torch.isnan(values)
            inf_mask = torch.isinf(values)
            n_nan = int(nan_mask.sum())
            n_inf = int(inf_mask.sum())
            if n_nan or n_inf:
                self.nan += n_nan
                self.inf += n_inf
                values = values[~(nan_mask | inf_mask)]
        n = values.numel()
        if n == 0:
            return
        c_mean = float(values.mean())
        c_m2 = float(((values - c_mean) ** 2).sum())
        c_min = float(values.min())
        c_max = float(values.max())
        total = self.count + n
        delta = c_mean - self.mean
        self.mean += delta * n / total
        self.m2 += c_m2 + delta * delta * self.count * n / total
        self.min = c_min if self.count == 0 else min(self.min, c_min)
        self.max = c_max if self.count == 0 else max(self.max, c_max)
        self.count = total

    @property
    def std(self) -> float:
        """Unbiased standard deviation (like torch.std), NaN with fewer than two finite values."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else math.nan

    def as_row(self) -> dict[str, Any]:
        """The figures as one table row."""
        return {
            "min": self.min,
            "max": self.max,
            "mean": self.mean if self.count else math.nan,
            "std": self.std,
            "nan": self.nan,
            "inf": self.inf,
        }


def tensor_stats(
    catalog: Catalog, name: str, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, on_read: ReadHook | None = None
) -> dict[str, Any]:
    """min, max, mean, std (over finite values) and nan, inf counts of one tensor, read chunk by chunk."""
    running = RunningStats()
    for chunk in iter_chunks(catalog, name, chunk_elements, on_read):
        running.add(chunk)
    return running.as_row()


def histogram(
    catalog: Catalog,
    name: str,
    bins: int = 100,
    value_range: tuple[float, float] | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    on_read: ReadHook | None = None,
) -> tuple[Any, Any]:
    """Counts and bin edges (numpy arrays) of a tensor's finite values, accumulated chunk by chunk.

    Without `value_range` a first pass finds min and max, so the tensor is read twice (`histogram_bytes`).
    """
    import numpy as np
    import torch

    if value_range is None:
        figures = tensor_stats(catalog, name, chunk_elements, on_read)
        low, high = figures["min"], figures["max"]
        if math.isnan(low):
            low, high = 0.0, 1.0
    else:
        low, high = value_range
    if low == high:
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, bins + 1)
    counts = np.zeros(bins, dtype=np.int64)
    for chunk in iter_chunks(catalog, name, chunk_elements, on_read):
        values = chunk.to(torch.float64)
        values = values[torch.isfinite(values)].numpy()
        part, _ = np.histogram(values, bins=edges)
        counts += part
    return counts, edges


def histogram_bytes(catalog: Catalog, name: str, value_range: tuple[float, float] | None = None) -> int:
    """Bytes `histogram` reads: the tensor twice without a value range (min/max pass, then counts), else once."""
    nbytes = catalog[name].nbytes
    return nbytes if value_range is not None else 2 * nbytes
