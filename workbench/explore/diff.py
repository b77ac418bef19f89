"""Compare two checkpoints: which tensors were added, removed, or changed in dtype, shape or values.

Metadata differences come from headers alone. With `values=True`, tensors present on both sides with
the same shape are compared chunk by chunk: equal bytes settle a chunk without arithmetic, otherwise
the largest absolute difference (in float64) is kept. Memory stays at two chunks.
"""

from __future__ import annotations

import math
from typing import Any

from ..catalog import Catalog
from .stats import DEFAULT_CHUNK_ELEMENTS, ReadHook, iter_chunks

STATUSES = ("added", "removed", "dtype changed", "shape changed", "values changed", "same")
COLUMNS = ["status", "dtype", "other_dtype", "shape", "other_shape"]


def max_abs_difference(
    a: Catalog,
    b: Catalog,
    name: str,
    other_name: str | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    on_read: ReadHook | None = None,
) -> float:
    """Largest |a - b| over one tensor present in both catalogs with the same number of elements.

    0.0 when equal (NaN where both sides hold NaN counts as equal); NaN when one side holds NaN where
    the other does not.
    """
    import torch

    other_name = name if other_name is None else other_name
    same_dtype = a[name].dtype == b[other_name].dtype
    worst = 0.0
    for left, right in zip(
        iter_chunks(a, name, chunk_elements, on_read), iter_chunks(b, other_name, chunk_elements, on_read), strict=True
    ):
        if same_dtype and torch.equal(left.view(torch.uint8), right.view(torch.uint8)):
            continue
        x = left.to(torch.float64)
        y = right.to(torch.float64)
        both_nan = torch.isnan(x) & torch.isnan(y)
        same_inf = torch.isinf(x) & (x == y)
        gap = (x - y).abs()
        gap[both_nan | same_inf] = 0.0
        if bool(torch.isnan(gap).any()):
            return math.nan
        worst = max(worst, float(gap.max()))
    return worst


def diff_catalogs(
    a: Catalog,
    b: Catalog,
    *,
    values: bool = False,
    include_same: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    on_read: ReadHook | None = None,
) -> Any:
    """A DataFrame indexed by tensor name: status, both dtypes and shapes (and max_abs_diff with values).

    Rows follow `a`'s order, then tensors only in `b`. 'shape changed' wins over 'dtype changed' when
    both differ; with `values=True`, a dtype change of an equal shape still reports max_abs_diff.
    `on_read` sees every chunk read on either side (`values_bytes` is their total).
    """
    import pandas as pd

    rows: list[tuple] = []
    for name, info in a.items():
        other = b.tensors.get(name)
        if other is None:
            rows.append((name, "removed", info.dtype, None, info.shape, None, math.nan))
            continue
        gap = math.nan
        if info.shape != other.shape:
            status = "shape changed"
        elif info.dtype != other.dtype:
            status = "dtype changed"
            if values:
                gap = max_abs_difference(a, b, name, chunk_elements=chunk_elements, on_read=on_read)
        elif values:
            gap = max_abs_difference(a, b, name, chunk_elements=chunk_elements, on_read=on_read)
            status = "same" if gap == 0.0 else "values changed"
        else:
            status = "same"
        if status != "same" or include_same:
            rows.append((name, status, info.dtype, other.dtype, info.shape, other.shape, gap))
    for name, other in b.items():
        if name not in a.tensors:
            rows.append((name, "added", None, other.dtype, None, other.shape, math.nan))
    columns = ["name", *COLUMNS, "max_abs_diff"]
    frame = pd.DataFrame.from_records(rows, columns=columns).set_index("name")
    frame["status"] = pd.Categorical(frame["status"], categories=STATUSES)
    if not values:
        frame = frame.drop(columns="max_abs_diff")
    return frame


def values_bytes(a: Catalog, b: Catalog) -> int:
    """Bytes `diff_catalogs(a, b, values=True)` reads: both sides of every tensor present in both with one shape."""
    total = 0
    for name, info in a.items():
        other = b.tensors.get(name)
        if other is not None and other.shape == info.shape:
            total += info.nbytes + other.nbytes
    return total
