"""Averaging several checkpoints (model soups, EMA-style weighted means): mergekit's `linear` merge.

`average(["a", "b", "c"], weights)` is `merge("linear", ...)` (workbench.mapper.merge): it names the sources of a
multi-source checkpoint (workbench.formats.multi: the first keeps its tensor names, the others are read as
`NAME::tensor`) and binds lazily, so it can be written before any source is opened. Each output tensor is one
group of N inputs, so the plan's peak memory is one group (plus the float32 accumulator), never a whole model.
Floating tensors are accumulated in float32 in source order (`acc += wi·xi`, fused), divided by `Σ wi` and
written in the inputs' dtype, bit for bit as mergekit's linear merge; integer buffers must be equal and are
copied. Sources left out of the average are dropped.

The functions below the preset are those of mappers exported before averaging became a merge (their files name
them, e.g. 'workbench.mapper.presets.averaging:weighted_mean'); they keep working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...catalog import Catalog, TensorInfo
from ...dtypes import is_float
from ...errors import MapperError
from ..merge.models import MergeModels, merge

__all__ = ["average", "merge"]


def _names(sources: Any) -> list[str]:
    """The source names: given, the keys of a mapping name -> path, or those of a multi-source checkpoint."""
    catalog = getattr(sources, "catalog", sources)
    if isinstance(catalog, Catalog):
        if getattr(catalog, "sources", None):
            return list(catalog.sources)  # type: ignore[attr-defined]
        raise MapperError(f"Cannot average {catalog.root}: it is one checkpoint. Open the checkpoints to average together, "
                          "e.g. wb.open_checkpoint({'a': 'ck1/', 'b': 'ck2/', 'c': 'ck3/'}).")
    if isinstance(sources, Mapping):
        return [str(k) for k in sources]
    if isinstance(sources, Sequence) and not isinstance(sources, str) and all(isinstance(s, str) for s in sources):
        return list(sources)
    raise MapperError(
        f"Cannot average {type(sources).__name__}: pass the source names (['a', 'b']), a mapping name -> path, or a "
        "checkpoint opened from such a mapping."
    )


def average(sources: Any, weights: Sequence[float] | None = None, *, like: Any = None) -> MergeModels:
    """A mapper writing the (weighted) mean of the same-named tensors of every source: mergekit's `linear` merge.

    `sources`: source names (`["a", "b"]`, usable before any source is opened), a mapping name -> path, or a
    multi-source checkpoint. `weights`: one per source (default: uniform), divided by their sum, e.g. an EMA's
    decayed weights or a soup's. `like=` (a checkpoint) is accepted for older code and not needed.
    """
    names = _names(sources)
    if len(names) < 2:
        raise MapperError(f"Cannot average sources {names}: need at least two.")
    if like is not None:
        known = list(getattr(getattr(like, "catalog", like), "sources", None) or [])
        unknown = [n for n in names if known and n not in known]
        if unknown:
            raise MapperError(f"Cannot average sources {names}: unknown {unknown!r}. The checkpoint has sources {known}.")
    if weights is None:
        return merge("linear", names, parameters={"weight": 1.0})
    if len(weights) != len(names) or any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in weights) \
            or sum(weights) <= 0:
        raise MapperError(f"Cannot average with weights {list(weights)}: give one non-negative number per source "
                          f"({len(names)}), not all zero.")
    return merge("linear", names, model_parameters={n: {"weight": float(w)} for n, w in zip(names, weights, strict=True)})


def weighted_mean(*tensors: Any, weights: Sequence[float]) -> Any:
    """`Σ wi·xi` accumulated in float32 in order, returned in the first tensor's dtype."""
    import torch

    acc = tensors[0].to(torch.float32) * weights[0]
    for tensor, weight in zip(tensors[1:], weights[1:], strict=True):
        acc += tensor.to(torch.float32) * weight
    return acc.to(tensors[0].dtype)


def equal_copy(*tensors: Any, weights: Sequence[float]) -> Any:
    """The first tensor, when every source holds the same values (non-float tensors cannot be averaged)."""
    import torch

    for tensor in tensors[1:]:
        if not torch.equal(tensor, tensors[0]):
            raise MapperError("Cannot average a non-floating tensor whose values differ between sources. Drop it or "
                              "pick one source's copy with a Rename.")
    return tensors[0]


def infer_mean(*infos: TensorInfo, weights: Sequence[float]) -> list[tuple[str, tuple[int, ...]]]:
    """The first input's metadata; every source must hold the tensor with the same shape and kind."""
    first = infos[0]
    for other in infos[1:]:
        if tuple(other.shape) != tuple(first.shape) or is_float(other.dtype) != is_float(first.dtype):
            raise MapperError(f"Cannot average {first.name!r}: {other.name!r} is {other.dtype} {list(other.shape)}, "
                              f"{first.name!r} is {first.dtype} {list(first.shape)}. Average checkpoints of one model.",
                              tensor=first.name)
    return [(first.dtype, first.shape)]


def infer_missing(info: TensorInfo, *, first: str) -> Any:
    """A tensor that only a later source holds cannot be averaged: a plan problem."""
    raise MapperError(f"Cannot average {info.name!r}: source {first!r} has no such tensor. Average checkpoints of one "
                      "model, or drop it first.", tensor=info.name)


def missing(tensor: Any, *, first: str) -> Any:
    """Never runs (the plan reports the problem)."""
    raise MapperError(f"Cannot average: source {first!r} lacks this tensor.")
