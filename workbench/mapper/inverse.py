"""Inverting a mapper, using the source it applies to for what the mapper alone does not say.

Binding the forward mapper records the input metadata of every operation instance; each leaf then
inverts itself from that metadata (a Concat learns its part sizes, a Reshape its original shape, a
Cast its original dtype). Templated leaves stay templated when every instance inverts the same way,
and expand into concrete instances otherwise.
"""

from __future__ import annotations

from typing import Any

from ..errors import MapperError
from .base import Mapper
from .claim import Claim
from .compose import Parallel, PrefixScope, Sequential
from .config_update import ConfigUpdate
from .op import Op
from .output_file import OutputFile
from .patterns import has_globs, inverse_keeps_glob
from .ranges import has_ranges, zero_based


def inverse(mapper: Mapper, source: Any) -> Mapper:
    """A mapper that undoes `mapper` on the output it makes from `source`; see `Mapper.inverse`."""
    from .bind import run_binder

    binding, binder = run_binder(mapper, source, rest="keep", record=True)
    if not binding.ok:
        raise MapperError(
            f"Cannot invert {mapper.short()}: it does not bind cleanly to the source "
            f"({len(binding.errors)} problem(s), first: {binding.errors[0].message}) Fix the mapper first."
        )
    return _invert(mapper, (), binder) or Sequential()


def _invert(mapper: Mapper, path: tuple[int, ...], binder: Any) -> Mapper | None:
    if isinstance(mapper, Op):
        return _invert_leaf(mapper, binder.records.get(path, []), binder.after.get(path))
    if isinstance(mapper, Sequential):
        parts = [_invert(child, path + (i,), binder) for i, child in enumerate(mapper.mappers)]
        kept = [part for part in reversed(parts) if part is not None]
        return Sequential(*kept) if kept else None
    if isinstance(mapper, Parallel):
        parts = [_invert(child, path + (i,), binder) for i, child in enumerate(mapper.mappers)]
        kept = [part for part in parts if part is not None]
        return Parallel(*kept) if kept else None
    if isinstance(mapper, PrefixScope):
        clash = binder.scope_clashes.get(path)
        if clash is not None:
            raise MapperError(
                f"Cannot invert {mapper.short()}: tensor {clash!r} lies outside the scope but its name already starts "
                f"with the target prefix {mapper.target_prefix!r}, so the inverse could not tell it apart. "
                "Scope every tensor (e.g. strip the prefix from all of them) or use explicit Renames."
            )
        inner = _invert(mapper.mapper, path + (0,), binder)
        return PrefixScope(inner if inner is not None else Sequential(), mapper.target_prefix, mapper.source_prefix)
    if isinstance(mapper, (Claim, ConfigUpdate, OutputFile)):
        return None  # a check on this mapper's source; the inverse reads another layout
    raise MapperError(f"Cannot invert {mapper!r}: unknown mapper type {type(mapper).__name__}.")


def _invert_leaf(leaf: Op, records: list[tuple[Op, tuple[Any, ...]]], after: Any = None) -> Mapper | None:
    if not records:
        return None
    if has_globs(leaf):  # keep the glob only when, bound where the inverse runs, it stands for exactly the inverse instances
        own = dict.fromkeys(metas for instance, metas in records if type(instance) is type(leaf))  # not a Cast's pass-throughs
        candidates = {leaf._invert(list(metas)) for metas in own}
        if len(candidates) == 1 and inverse_keeps_glob(leaf, next(iter(candidates)), records, after):
            return candidates.pop()
        return Parallel(*[instance._invert(list(metas)) for instance, metas in records])
    if not leaf.is_template:
        return leaf._invert(list(records[0][1]))
    if has_ranges(leaf) and not all(zero_based(leaf, instance) for instance, _ in records):
        return Parallel(*[instance._invert(list(metas)) for instance, metas in records])  # values the inverse cannot count
    by_signature: dict[tuple[Any, ...], None] = dict.fromkeys(metas for _, metas in records)
    inverses = {leaf._invert(list(metas)) for metas in by_signature}
    if len(inverses) == 1:
        return inverses.pop()
    return Parallel(*[instance._invert(list(metas)) for instance, metas in records])
