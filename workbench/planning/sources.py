"""What a plan starts from: a source catalog and the binding of a mapper to it.

A source may be a path, a `Checkpoint` (anything with `.catalog`) or a `Catalog`. A mapper may be a
mapper (anything with `.bind`), an already computed `Binding`, or None for "copy every tensor".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..dtypes import policy_dtype
from ..errors import PlanError
from ..mapper.groups import Binding, ByteSlice, Group
from .dtype_policy import CastOutputs, apply_dtype, kept_warnings, policy_casts, policy_keeps
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


def copy_group(info: TensorInfo, size: int) -> Group:
    """The group copying one source tensor unchanged: its `size` bytes from the start of its data."""
    name = info.name
    return Group((info,), (TensorInfo(name, info.dtype, info.shape),), PassThrough(name), {name: (ByteSlice(name, 0, size),)}, None, "copy")


class PolicyGroups:
    """What a dtype policy (`code`) makes of source tensors taken one by one: a chunked cast of each float it casts,
    a byte copy of anything else; floats it cannot cast are kept, and `binding` warns about them."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.label = f"copy -> {code}"
        self._casts: dict[str, bool] = {}  # source dtype -> cast by the policy
        self._kept: dict[str, list[str]] = {}  # float dtype the policy cannot cast -> tensor names

    def casts(self, dtype: str) -> bool:
        """Whether the policy casts tensors of `dtype`."""
        here = self._casts.get(dtype)
        if here is None:
            here = self._casts[dtype] = policy_casts(dtype, self.code)
            if policy_keeps(dtype, self.code):
                self._kept[dtype] = []
        return here

    def group(self, info: TensorInfo) -> Group:
        """The group of one source tensor under the policy."""
        name = info.name
        if self.casts(info.dtype):  # a whole copy cast: chunked
            return Group((info,), (TensorInfo(name, self.code, info.shape),), CastOutputs(PassThrough(name), self.code, frozenset((name,))),
                         None, self.code, self.label)
        if info.dtype in self._kept:
            self._kept[info.dtype].append(name)
        return copy_group(info, info.nbytes)

    def binding(self, groups: list[Group]) -> Binding:
        """`groups` with the policy's warnings about the floats it kept."""
        return Binding(groups, kept_warnings(self._kept, self.code))


def passthrough_binding(catalog: Catalog, dtype: str | None = None) -> Binding:
    """One byte-copy group per source tensor, in catalog order.

    With `dtype` (a policy's code): what `apply_dtype` makes of those groups, built directly, so that a
    mapper-less conversion to bf16 does not first make 100k copy groups only to replace them.
    """
    if dtype is None:
        raw = getattr(catalog.reader, "raw_in_place", False) is True  # each tensor's bytes are [begin, end) of its file
        return Binding([copy_group(info, info.end - info.begin if raw else info.nbytes) for info in catalog.tensors.values()])
    policy = PolicyGroups(policy_dtype(dtype))
    return policy.binding([policy.group(info) for info in catalog.tensors.values()])


def check_rest(rest: str) -> None:
    """Refuse a rest policy that is not one of RESTS."""
    if rest not in RESTS:
        raise PlanError(f"Cannot plan with rest={rest!r}: it must be one of {', '.join(map(repr, RESTS))}.")


def bind(catalog: Catalog, mapper: Any, rest: str, dtype: str | None = None) -> Binding:
    """Bind `mapper` to `catalog` with the given rest policy; None copies everything. With `dtype` (a policy's
    code) every floating-point output is stored as `dtype` (`planning.dtype_policy`)."""
    check_rest(rest)
    if mapper is None:
        return passthrough_binding(catalog, dtype)
    if isinstance(mapper, Binding):
        return mapper if dtype is None else apply_dtype(mapper, dtype)
    binder = getattr(mapper, "bind", None)
    if binder is None:
        raise PlanError(
            f"Cannot plan with mapper {type(mapper).__name__}: it has no bind(). Pass a mapper from "
            "workbench.mapper, a Binding, or None to copy every tensor."
        )
    binding = binder(catalog, rest=rest)
    return binding if dtype is None else apply_dtype(binding, dtype)


def mapper_json(mapper: Any) -> str | None:
    """The mapper's JSON export when it has one (None for no mapper); used to ship and fingerprint it."""
    if mapper is None or isinstance(mapper, Binding):
        return None
    to_json = getattr(mapper, "to_json", None)
    return to_json() if to_json is not None else None
