"""Composition: run mappers one after another, side by side, or inside a name prefix.

- `Sequential(a, b)`: b sees a's result; names a does not touch pass through to b.
- `Parallel(a, b)`: a and b both read the same input; they may not read or write the same name.
- `PrefixScope(m, source_prefix, target_prefix)`: m sees only names under `source_prefix`, with the
  prefix removed; everything in scope comes out under `target_prefix` (touched by m or not).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import MapperError
from .base import Mapper


def _check_children(mappers: tuple[object, ...], where: str) -> tuple[Mapper, ...]:
    if len(mappers) == 1 and isinstance(mappers[0], (list, tuple)):
        mappers = tuple(mappers[0])
    for child in mappers:
        if not isinstance(child, Mapper):
            raise MapperError(
                f"Cannot build {where}: {child!r} is not a mapper operation. "
                "Pass operations such as M.Rename(...) or M.Concat(...) as separate arguments."
            )
    return tuple(mappers)  # type: ignore[return-value]


@dataclass(frozen=True, init=False, repr=False)
class Sequential(Mapper):
    """Apply `mappers` in order, each to the previous one's result."""

    mappers: tuple[Mapper, ...]

    def __init__(self, *mappers: Mapper) -> None:
        object.__setattr__(self, "mappers", _check_children(mappers, "Sequential"))

    def leaves(self) -> Iterator[Mapper]:
        for child in self.mappers:
            yield from child.leaves()

    @property
    def inputs(self) -> tuple[str, ...]:
        """Names read from outside (templates as written)."""
        return _flow(self)[0]

    @property
    def outputs(self) -> tuple[str, ...]:
        """Names written and still present at the end (templates as written)."""
        return _flow(self)[1]


@dataclass(frozen=True, init=False, repr=False)
class Parallel(Mapper):
    """Apply `mappers` side by side to the same input; their reads and writes must not overlap."""

    mappers: tuple[Mapper, ...]

    def __init__(self, *mappers: Mapper) -> None:
        object.__setattr__(self, "mappers", _check_children(mappers, "Parallel"))

    def leaves(self) -> Iterator[Mapper]:
        for child in self.mappers:
            yield from child.leaves()

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(name for child in self.mappers for name in child.inputs)  # type: ignore[attr-defined]

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(name for child in self.mappers for name in child.outputs)  # type: ignore[attr-defined]


@dataclass(frozen=True, repr=False)
class PrefixScope(Mapper):
    """Run `mapper` on the names under `source_prefix` (prefix removed), re-prefixing results with `target_prefix`."""

    mapper: Mapper
    source_prefix: str = ""
    target_prefix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.mapper, Mapper):
            raise MapperError(f"Cannot build PrefixScope: {self.mapper!r} is not a mapper. Pass e.g. M.Sequential(...).")
        for field in ("source_prefix", "target_prefix"):
            value = getattr(self, field)
            if not isinstance(value, str) or "{" in value or "}" in value:
                raise MapperError(f"Cannot build PrefixScope: {field} must be a plain string without placeholders (got {value!r}).")

    def leaves(self) -> Iterator[Mapper]:
        yield from self.mapper.leaves()

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(self.source_prefix + name for name in self.mapper.inputs)  # type: ignore[attr-defined]

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.target_prefix + name for name in self.mapper.outputs)  # type: ignore[attr-defined]


def _flow(sequence: Sequential) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """External reads and final writes of a Sequential, following names symbolically."""
    reads: dict[str, None] = {}
    alive: dict[str, None] = {}
    for child in sequence.mappers:
        for name in child.inputs:  # type: ignore[attr-defined]
            if name in alive:
                del alive[name]
            else:
                reads.setdefault(name, None)
        for name in child.outputs:  # type: ignore[attr-defined]
            alive[name] = None
    return tuple(reads), tuple(alive)
