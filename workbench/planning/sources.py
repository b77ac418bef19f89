"""What a plan starts from: a source catalog and the binding of a mapper to it.

A source may be a path, a `Checkpoint` (anything with `.catalog`) or a `Catalog`. A mapper may be a
mapper (anything with `.bind`), an already computed `Binding`, or None for "copy every tensor".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..errors import PlanError
from ..mapper.groups import Binding, ByteSlice, Group
from .gc_pause import gc_paused

RESTS = ("keep", "drop", "error")


def resolve_catalog(source: Any) -> Catalog:
    """The catalog of a path, a Checkpoint or a Catalog."""
    if isinstance(source, Catalog):
        return source
    catalog = getattr(source, "catalog", None)
    if isinstance(catalog, Catalog):
        return catalog
    if isinstance(source, Mapping):  # several named sources: one joined catalog (workbench.formats.multi)
        from ..formats.multi import open_sources

        with gc_paused():
            return open_sources(source)
    if isinstance(source, (str, os.PathLike)):
        from ..formats import open_catalog

        with gc_paused():  # headers of many tensors: many small objects, none of them garbage
            return open_catalog(source)
    raise PlanError(
        f"Cannot plan from {type(source).__name__}: a source must be a checkpoint path, a Checkpoint "
        "(from wb.open_checkpoint) or a Catalog."
    )


class PassThrough:
    """The op of a group that copies one tensor unchanged (used when no mapper is given)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Return the input under the same name."""
        return {self.name: tensors[self.name]}

    def __repr__(self) -> str:
        return f"PassThrough({self.name!r})"


def passthrough_binding(catalog: Catalog) -> Binding:
    """One byte-copy group per source tensor, in catalog order."""
    groups = [
        Group((info,), (TensorInfo(name, info.dtype, info.shape),), PassThrough(name), {name: (ByteSlice(name, 0, info.nbytes),)}, None, "copy")
        for name, info in catalog.tensors.items()
    ]
    return Binding(groups)


def bind(catalog: Catalog, mapper: Any, rest: str) -> Binding:
    """Bind `mapper` to `catalog` with the given rest policy; None copies everything."""
    if rest not in RESTS:
        raise PlanError(f"Cannot plan with rest={rest!r}: it must be one of {', '.join(map(repr, RESTS))}.")
    if mapper is None:
        return passthrough_binding(catalog)
    if isinstance(mapper, Binding):
        return mapper
    binder = getattr(mapper, "bind", None)
    if binder is None:
        raise PlanError(
            f"Cannot plan with mapper {type(mapper).__name__}: it has no bind(). Pass a mapper from "
            "workbench.mapper, a Binding, or None to copy every tensor."
        )
    return binder(catalog, rest=rest)


def mapper_json(mapper: Any) -> str | None:
    """The mapper's JSON export when it has one (None for no mapper); used to ship and fingerprint it."""
    if mapper is None or isinstance(mapper, Binding):
        return None
    to_json = getattr(mapper, "to_json", None)
    return to_json() if to_json is not None else None
