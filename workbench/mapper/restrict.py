"""A group's op: the mapper tree restricted to the operation instances of that group.

Same structure as the whole mapper (Sequential/Parallel/PrefixScope), templated leaves replaced by the
group's concrete instances, everything else left out. So the op maps the group's source names straight
to its final names with exactly the whole mapper's semantics (swaps, scopes and all).
"""

from __future__ import annotations

from typing import Any

from .base import Mapper
from .compose import Parallel, PrefixScope, Sequential
from .op import Op

Path = tuple[int, ...]


def _skeleton(mapper: Mapper, path: Path, chosen: set[Path], prefixes: set[Path]) -> tuple[Any, ...] | None:
    """The shape of `mapper` restricted to the leaves at `chosen` paths (None when nothing is left)."""
    if path not in prefixes:
        return None
    if isinstance(mapper, (Sequential, Parallel)):
        kept = [_skeleton(child, path + (i,), chosen, prefixes) for i, child in enumerate(mapper.mappers)]
        kids = [child for child in kept if child is not None]
        if not kids:
            return None
        return kids[0] if len(kids) == 1 else ("many", type(mapper), tuple(kids))
    if isinstance(mapper, PrefixScope):
        inner = _skeleton(mapper.mapper, path + (0,), chosen, prefixes)
        if inner is None and path not in chosen:
            return None
        return ("scope", mapper.source_prefix, mapper.target_prefix, inner)
    return ("leaf", path)


def _build(skeleton: tuple[Any, ...], instances: dict[Path, list[Op]]) -> Mapper:
    kind = skeleton[0]
    if kind == "leaf":
        found = instances[skeleton[1]]
        return found[0] if len(found) == 1 else Parallel(*found)
    if kind == "many":  # children are mappers already: skip the constructor's checks (100k groups)
        composite = object.__new__(skeleton[1])
        object.__setattr__(composite, "mappers", tuple([_build(child, instances) for child in skeleton[2]]))
        return composite
    inner = skeleton[3]
    return PrefixScope(_build(inner, instances) if inner is not None else Sequential(), skeleton[1], skeleton[2])


def _has_leaf(skeleton: tuple[Any, ...]) -> bool:
    if skeleton[0] == "leaf":
        return True
    if skeleton[0] == "scope":
        return skeleton[3] is not None and _has_leaf(skeleton[3])
    return any(_has_leaf(child) for child in skeleton[2])


def _has_scope(skeleton: tuple[Any, ...]) -> bool:
    if skeleton[0] == "scope":
        return True
    return skeleton[0] == "many" and any(_has_scope(child) for child in skeleton[2])


class GroupShape:
    """What every group over the same set of leaf paths shares: tree shape, label, recipe cacheability."""

    __slots__ = ("skeleton", "label", "cacheable", "op")

    def __init__(self, skeleton: tuple[Any, ...], label: str, cacheable: bool, op: Mapper | None = None) -> None:
        self.skeleton = skeleton
        self.label = label
        self.cacheable = cacheable
        # Without operation leaves (a prefix rename) the op is the same for every group of this shape: built once
        # and shared (mappers are immutable), not rebuilt 100k times for a renamed checkpoint.
        self.op = op


class Restrictor:
    """Builds a group's op: the mapper tree restricted to the group's instances (shapes cached by path set)."""

    def __init__(self, mapper: Mapper) -> None:
        self.mapper = mapper
        self._shapes: dict[tuple[Path, ...], GroupShape] = {}

    def shape(self, signature: tuple[Path, ...], instances: dict[Path, list[Op]]) -> GroupShape:
        found = self._shapes.get(signature)
        if found is None:
            prefixes = {path[:k] for path in signature for k in range(len(path) + 1)}
            skeleton = _skeleton(self.mapper, (), set(signature), prefixes)
            op = _build(skeleton, instances)  # type: ignore[arg-type]
            found = self._shapes[signature] = GroupShape(
                skeleton, label_of(op), not _has_scope(skeleton), None if _has_leaf(skeleton) else op  # type: ignore[arg-type]
            )
        return found

    def op_for(self, steps: list[tuple[int, Path, Any]]) -> tuple[Mapper, GroupShape, dict[Path, list[Op]], tuple[Path, ...]]:
        """The group's op, its shape, its instances by leaf path (execution order) and its path signature."""
        if len(steps) == 1:  # the common case: one operation instance (or one scope rename)
            _, path, instance = steps[0]
            instances = {path: [] if instance is None else [instance]}
            signature: tuple[Path, ...] = (path,)
            shape = self._shapes.get(signature) or self.shape(signature, instances)
            op = shape.op if shape.op is not None else _build(shape.skeleton, instances)
            return op, shape, instances, signature
        instances = {}
        for _, path, instance in sorted(steps, key=lambda step: step[0]) if len(steps) > 1 else steps:
            found = instances.get(path)
            if found is None:
                found = instances[path] = []
            if instance is not None:
                found.append(instance)
        signature = tuple(sorted(instances)) if len(instances) > 1 else tuple(instances)
        shape = self.shape(signature, instances)
        return shape.op if shape.op is not None else _build(shape.skeleton, instances), shape, instances, signature


def label_of(op: Mapper) -> str:
    """A short human label: the kinds of operations the group runs, e.g. 'Concat' or 'Reshape+Transpose'; a
    `Function` by its function's name (e.g. 'dequantize_fp8_tensor+to_gguf')."""
    kinds: list[str] = []
    for leaf in op.leaves():
        fn = getattr(leaf, "fn", None)
        kind = fn.rpartition(":")[2] if type(leaf).__name__ == "Function" and isinstance(fn, str) else type(leaf).__name__
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return "+".join(kinds) or "Rename"


