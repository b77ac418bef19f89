"""Averaging several checkpoints (model soups, EMA-style weighted means) tensor by tensor.

The sources are those of a multi-source catalog (workbench.formats.multi): the first keeps its tensor
names, the others are read as `NAME::tensor`. Each output tensor is one group whose inputs are the N
tensors of that name, so the plan's peak memory is one group of N inputs (plus the fp32 accumulator),
never a whole model. Sources of the checkpoint that are not averaged are dropped. Floating tensors are accumulated in float32 in source order
(`acc = w0·x0; acc += wi·xi`) and written in the first source's dtype (a conversion's dtype policy
then applies as usual); other tensors (integer buffers, step counters) must be equal in every source
and are copied from the first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ...catalog import Catalog, TensorInfo
from ...dtypes import is_float
from ...errors import MapperError
from ..base import Mapper
from ..compose import Parallel
from ..function import Function
from ..ops import Drop

_HERE = "workbench.mapper.presets.averaging"


def _sources(sources: Any) -> tuple[list[str], Catalog | None]:
    """(source names, joined catalog when it can be found) from names, a mapping of paths, or a multi catalog."""
    catalog = getattr(sources, "catalog", sources)
    if isinstance(catalog, Catalog):
        if getattr(catalog, "sources", None):
            return list(catalog.sources), catalog  # type: ignore[attr-defined]
        raise MapperError(f"Cannot average {catalog.root}: it is one checkpoint. Open the checkpoints to average together, "
                          "e.g. wb.open_checkpoint({'a': 'ck1/', 'b': 'ck2/', 'c': 'ck3/'}).")
    if isinstance(sources, Mapping):
        from ...formats.multi import open_sources

        joined = open_sources({str(k): os.fspath(v) for k, v in sources.items()})
        return list(joined.sources), joined
    if isinstance(sources, Sequence) and not isinstance(sources, str):
        return [str(s) for s in sources], None
    raise MapperError(
        f"Cannot average {type(sources).__name__}: pass the source names (with like=the multi-source checkpoint), "
        "a mapping name -> path, or a checkpoint opened from such a mapping."
    )


def average(sources: Any, weights: Sequence[float] | None = None, *, like: Any = None) -> Mapper:
    """A mapper writing the (weighted) mean of the same-named tensors of every source.

    `sources`: a multi-source checkpoint/catalog, a mapping name -> path, or a list of source names together with
    `like=` that checkpoint (the first source names the outputs). `weights`: one per source, normalised to sum 1
    (default: uniform), e.g. an EMA's decayed weights or a soup's.
    """
    names, catalog = _sources(sources)
    if like is not None:
        catalog = getattr(like, "catalog", like)
    if catalog is None or not getattr(catalog, "sources", None):
        raise MapperError("Cannot average: the sources' tensor names are unknown. Pass like=wb.open_checkpoint({...}) "
                          "(the multi-source checkpoint these names belong to).")
    known = list(catalog.sources)  # type: ignore[attr-defined]
    unknown = [n for n in names if n not in known]
    if len(names) < 2 or unknown:
        raise MapperError(f"Cannot average sources {names}: {'unknown ' + repr(unknown) if unknown else 'need at least two'}. "
                          f"The checkpoint has sources {known}.")
    if weights is None:
        weights = [1.0] * len(names)
    if len(weights) != len(names) or any(not isinstance(w, (int, float)) or w < 0 for w in weights) or sum(weights) <= 0:
        raise MapperError(f"Cannot average with weights {list(weights)}: give one non-negative number per source "
                          f"({len(names)}), not all zero.")
    total = float(sum(weights))
    norm = [float(w) / total for w in weights]
    primary = known[0]

    def name_in(source: str, tensor: str) -> str:
        return tensor if source == primary else f"{source}::{tensor}"

    first = names[0]
    prefix = "" if first == primary else f"{first}::"
    ops: list[Mapper] = []
    seen: set[str] = set()
    for full, info in catalog.items():
        if not full.startswith(prefix) or (not prefix and "::" in full):
            continue
        tensor = full[len(prefix):]
        seen.add(tensor)
        inputs = [name_in(s, tensor) for s in names]
        if is_float(info.dtype):
            ops.append(Function(fn=f"{_HERE}:weighted_mean", infer=f"{_HERE}:infer_mean", inputs=inputs, outputs=[tensor],
                                params={"weights": norm}))
        else:
            ops.append(Function(fn=f"{_HERE}:equal_copy", infer=f"{_HERE}:infer_mean", inputs=inputs, outputs=[tensor],
                                params={"weights": norm}))
    for full in catalog:
        source, _, tensor = full.partition("::") if "::" in full else (primary, "", full)
        if source not in names:  # a source left out of the average: none of its tensors is written
            ops.append(Drop(full))
        elif source != first and tensor not in seen:
            ops.append(Function(fn=f"{_HERE}:missing", infer=f"{_HERE}:infer_missing", inputs=[full], outputs=[full],
                                params={"first": first}))
    return Parallel(*ops)


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
