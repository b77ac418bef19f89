"""Running a concrete (template-free) mapper over a name -> value mapping.

The same walk serves three kinds of values: torch tensors (`apply`), symbolic byte layouts (recipes,
see `layout.Sym`) and plain metadata. Only leaves differ, through `leaf_fn`.
Semantics: a leaf reads its inputs and writes its outputs; untouched names pass through;
a Parallel's children all read the state before any of them writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import MapperError
from .base import Mapper
from .claim import Claim
from .compose import Parallel, PrefixScope, Sequential
from .config_update import ConfigUpdate
from .op import Op
from .output_file import OutputFile

LeafFn = Callable[[Op, list[Any]], list[Any]]
_MISSING = object()


def run(mapper: Mapper, state: dict[str, Any], leaf_fn: LeafFn) -> None:
    """Apply `mapper` to `state` in place."""
    if isinstance(mapper, Op):
        consumed, produced = _leaf_effect(mapper, state, leaf_fn)
        _commit(state, consumed, produced, mapper)
    elif isinstance(mapper, Sequential):
        for child in mapper.mappers:
            run(child, state, leaf_fn)
    elif isinstance(mapper, Parallel):
        _run_parallel(mapper, state, leaf_fn)
    elif isinstance(mapper, PrefixScope):
        _run_scope(mapper, state, leaf_fn)
    elif isinstance(mapper, (Claim, ConfigUpdate, OutputFile)):
        pass  # a check on the source, made by binding (`apply_mapper` binds mappers that hold one)
    else:  # pragma: no cover - every Mapper subclass is one of the above
        raise MapperError(f"Cannot apply {mapper!r}: unknown mapper type {type(mapper).__name__}.")


def _leaf_effect(op: Op, state: Mapping[str, Any], leaf_fn: LeafFn) -> tuple[list[str], dict[str, Any]]:
    if op.is_template:
        raise MapperError(f"Cannot apply {op.short()} directly: it holds templates. Bind it to a source first (mapper.bind).")
    values = []
    for name in op.inputs:
        value = state.get(name, _MISSING)
        if value is _MISSING:
            raise MapperError(
                f"Cannot apply {op.short()}: input {name!r} is not present ({len(state)} tensors available). "
                "Check the name, or the operations that should have produced it."
            )
        values.append(value)
    results = leaf_fn(op, values)
    return list(op.inputs), dict(zip(op.outputs, results, strict=False))


def _commit(state: dict[str, Any], consumed: list[str], produced: dict[str, Any], op: Mapper) -> None:
    for name in consumed:
        del state[name]
    for name, value in produced.items():
        if name in state:
            raise MapperError(
                f"Cannot apply {op.short()}: it writes {name!r}, which already exists and is not consumed. "
                f"Drop or rename the existing tensor first (M.Drop({name!r}))."
            )
        state[name] = value


def _run_parallel(parallel: Parallel, state: dict[str, Any], leaf_fn: LeafFn) -> None:
    consumed: dict[str, Mapper] = {}
    produced: dict[str, Any] = {}
    writers: dict[str, Mapper] = {}
    for child in parallel.mappers:
        if isinstance(child, Op):
            reads, writes = _leaf_effect(child, state, leaf_fn)
        else:
            scratch = dict(state)
            run(child, scratch, leaf_fn)
            reads = [name for name, value in state.items() if scratch.get(name, _MISSING) is not value]
            writes = {name: value for name, value in scratch.items() if state.get(name, _MISSING) is not value}
        for name in reads:
            if name in consumed:
                raise MapperError(
                    f"Cannot apply {parallel.short()}: {name!r} is read by both {consumed[name].short()} and {child.short()}. "
                    "Each tensor can feed one operation per step; chain the operations in a Sequential."
                )
            consumed[name] = child
        for name, value in writes.items():
            if name in writers:
                raise MapperError(
                    f"Cannot apply {parallel.short()}: {name!r} is written by both {writers[name].short()} and {child.short()}. "
                    "Give the outputs different names."
                )
            writers[name] = child
            produced[name] = value
    _commit(state, list(consumed), produced, parallel)


def _run_scope(scope: PrefixScope, state: dict[str, Any], leaf_fn: LeafFn) -> None:
    source, target = scope.source_prefix, scope.target_prefix
    inner = {name[len(source):]: state.pop(name) for name in [n for n in state if n.startswith(source)]}
    run(scope.mapper, inner, leaf_fn)
    _commit(state, [], {target + name: value for name, value in inner.items()}, scope)


def apply_concrete(mapper: Mapper, tensors: Mapping[str, Any], leaf_fn: LeafFn) -> dict[str, Any]:
    """Run a template-free mapper on a copy of `tensors` and return the result."""
    state = dict(tensors)
    run(mapper, state, leaf_fn)
    return state


def checked_compute(op: Op, tensors: list[Any]) -> list[Any]:
    """Compute a leaf on torch tensors and check the results against its inferred metadata."""
    from ..dtypes import from_torch

    metas = [(from_torch(t.dtype), tuple(t.shape)) for t in tensors]
    expected = op._infer(metas)
    results = op._compute(tensors)
    if len(results) != len(expected):
        raise MapperError(f"Cannot apply {op.short()}: it produced {len(results)} tensors for {len(expected)} outputs.")
    for name, result, (dtype, shape) in zip(op.outputs, results, expected, strict=False):
        got = (from_torch(result.dtype), tuple(result.shape)) if hasattr(result, "dtype") else (type(result).__name__, ())
        if got != (dtype, shape):
            raise MapperError(
                f"Cannot apply {op.short()}: output {name!r} came out as {got[0]} {list(got[1])}, but its inference "
                f"declared {dtype} {list(shape)}. Make the function and its infer agree."
            )
    return results
