"""Value statistics of tensors, computed on demand in bounded chunks.

A tensor is read a slice of elements at a time straight from its byte range, so the memory held is a
chunk (plus its float64 copy), never the whole tensor and never the whole checkpoint. Used by
`Checkpoint.stats`, `Checkpoint.diff(values=True)` and `Checkpoint.plot_histogram`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


# Values widened to float64 and folded at a time: 512 KiB, so the passes over them stay in the CPU's cache.
BLOCK_ELEMENTS = 1 << 16


def widened_blocks(chunk: Any, scratch: Any = None) -> Iterator[Any]:
    """`chunk`'s values (a 1-D torch tensor of any real dtype) as float64 numpy arrays of at most
    `BLOCK_ELEMENTS`, each a copy the caller may overwrite (`scratch`, a float64 array, is reused when given).

    Only single-threaded numpy loops touch the values: torch's and BLAS's thread pools, on a machine whose
    cores are busy, made a read of value stats 10-30 times slower than the file's read speed.
    """
    import numpy as np
    import torch

    flat = chunk.reshape(-1)
    n = flat.numel()
    if scratch is None or scratch.shape[0] < min(n, BLOCK_ELEMENTS):
        scratch = np.empty(min(n, BLOCK_ELEMENTS), dtype=np.float64)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are the high half of a float32's
        source, widen = flat.view(torch.int16).numpy(), _widen_bf16
    elif flat.dtype in _numpy_native():
        source, widen = flat.numpy(), _widen_native
    else:  # FP8 and other dtypes numpy lacks: torch widens them (rare; may use its threads)
        source, widen = flat, _widen_torch
    for start in range(0, n, BLOCK_ELEMENTS):
        part = source[start : start + BLOCK_ELEMENTS]
        values = scratch[: part.shape[0]]
        widen(part, values)
        yield values


def _widen_native(part: Any, out: Any) -> None:
    import numpy as np

    np.copyto(out, part, casting="unsafe")


def _widen_bf16(part: Any, out: Any) -> None:
    import numpy as np

    bits = part.astype(np.uint16).astype(np.uint32) << 16
    np.copyto(out, bits.view(np.float32))


def _widen_torch(part: Any, out: Any) -> None:
    import torch

    torch.from_numpy(out).copy_(part)


@functools.cache
def _numpy_native() -> frozenset:
    """The torch dtypes numpy holds as they are (built on first use: importing this module stays torch-free)."""
    import torch

    return frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                      torch.uint8, torch.bool})


@dataclass
class RunningStats:
    """Min, max, mean and unbiased std of the finite values seen so far, plus NaN/Inf counts.

    Blocks are merged with the pairwise (Chan et al.) update, so the result does not depend on the
    chunk size beyond float64 rounding. A block is widened once to float64 and passed over a few times
    (sum, min, max, centre and square, sum); only a block whose sum is not finite (a NaN or Inf in it)
    takes the slower masked path. That keeps the figures near the speed the file is read
    (`benchmarks/bench_stats.py`).
    """

    count: int = 0  # finite values
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.nan
    max: float = math.nan
    nan: int = 0
    inf: int = 0
    _scratch: Any = field(default=None, repr=False, compare=False)

    def add(self, chunk: Any) -> None:
        """Fold one chunk (a 1-D torch tensor of any real dtype) into the running figures."""
        for values in widened_blocks(chunk, self._scratch):
            self._scratch = values.base if values.base is not None else values
            self.add_block(values)

    def add_block(self, values: Any) -> None:
        """Fold a float64 numpy array into the figures; the array is overwritten."""
        import numpy as np

        total = float(values.sum())
        if not math.isfinite(total):  # a NaN or Inf among them (or a sum that overflowed float64)
            nan_mask = np.isnan(values)
            inf_mask = np.isinf(values)
            self.nan += int(nan_mask.sum())
            self.inf += int(inf_mask.sum())
            values = values[~(nan_mask | inf_mask)]
            total = float(values.sum())
        n = values.shape[0]
        if n == 0:
            return
        c_min, c_max = float(values.min()), float(values.max())
        c_mean = total / n
        np.subtract(values, c_mean, out=values)
        np.square(values, out=values)
        self._merge(n, c_mean, float(values.sum()), c_min, c_max)

    def _merge(self, n: int, c_mean: float, c_m2: float, c_min: float, c_max: float) -> None:
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


def finite_range(
    catalog: Catalog, name: str, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, on_read: ReadHook | None = None
) -> tuple[float, float]:
    """(min, max) of a tensor's finite values, read chunk by chunk: the first pass of `histogram` (a min and
    a max per block, no mean or spread); (nan, nan) when it has no finite value."""
    import numpy as np

    low = high = math.nan
    scratch = None
    for chunk in iter_chunks(catalog, name, chunk_elements, on_read):
        for values in widened_blocks(chunk, scratch):
            scratch = values.base if values.base is not None else values
            b_low, b_high = float(values.min()), float(values.max())
            if not (math.isfinite(b_low) and math.isfinite(b_high)):
                values = values[np.isfinite(values)]
                if values.shape[0] == 0:
                    continue
                b_low, b_high = float(values.min()), float(values.max())
            low = b_low if math.isnan(low) else min(low, b_low)
            high = b_high if math.isnan(high) else max(high, b_high)
    return low, high


def histogram(
    catalog: Catalog,
    name: str,
    bins: int = 100,
    value_range: tuple[float, float] | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    on_read: ReadHook | None = None,
) -> tuple[Any, Any]:
    """Counts and bin edges (numpy arrays) of a tensor's finite values, accumulated chunk by chunk.

    Without `value_range` a first pass finds min and max (`finite_range`), so the tensor is read twice
    (`histogram_bytes`). Bins are equal-width; values outside `value_range` are left out and the last bin
    holds its right edge, as in `numpy.histogram`; a value within a rounding error of an inner edge may be
    counted in the bin on either side of it.
    """
    import numpy as np

    if value_range is None:
        low, high = finite_range(catalog, name, chunk_elements, on_read)
        if math.isnan(low):
            low, high = 0.0, 1.0
    else:
        low, high = value_range
    if low == high:
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, bins + 1)
    counts = np.zeros(bins, dtype=np.int64)
    scale = bins / (high - low)
    scratch = None
    index = np.empty(0, dtype=np.intp)
    for chunk in iter_chunks(catalog, name, chunk_elements, on_read):
        for values in widened_blocks(chunk, scratch):
            scratch = values.base if values.base is not None else values
            if not (float(values.min()) >= low and float(values.max()) <= high):  # NaN, Inf or out of range
                values = values[(values >= low) & (values <= high)]
            n = values.shape[0]
            if index.shape[0] < n:
                index = np.empty(n, dtype=np.intp)
            np.subtract(values, low, out=values)
            np.multiply(values, scale, out=values)
            where = index[:n]
            where[...] = values  # truncation: the bin of each value (all are >= 0)
            np.minimum(where, bins - 1, out=where)  # the right edge belongs to the last bin
            counts += np.bincount(where, minlength=bins)
    return counts, edges


def histogram_bytes(catalog: Catalog, name: str, value_range: tuple[float, float] | None = None) -> int:
    """Bytes `histogram` reads: the tensor twice without a value range (min/max pass, then counts), else once."""
    nbytes = catalog[name].nbytes
    return nbytes if value_range is not None else 2 * nbytes
