"""From a finished binder walk to a `Binding`: one group per connected component, plus the rest policy.

A group's `op` is the mapper tree restricted to that group's operation instances (same structure,
templates replaced by the concrete instances), so it maps source names straight to final names with
exactly the semantics of the whole mapper. Its byte recipe and chunked-cast flag come from tracing
that op over symbolic inputs.
"""

from __future__ import annotations

from typing import Any

from ..catalog import TensorInfo
from ..errors import MapperError
from .base import Mapper, Rest
from .compose import Parallel, PrefixScope, Sequential
from .groups import Binding, ByteSlice, Group
from .op import Op, build_unchecked
from .ops import Identity
from .recipes import Tracer
from .state import find

MAX_REST_PROBLEMS = 100


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
    if kind == "many":
        return skeleton[1](*[_build(child, instances) for child in skeleton[2]])
    inner = skeleton[3]
    return PrefixScope(_build(inner, instances) if inner is not None else Sequential(), skeleton[1], skeleton[2])


def _has_scope(skeleton: tuple[Any, ...]) -> bool:
    if skeleton[0] == "scope":
        return True
    return skeleton[0] == "many" and any(_has_scope(child) for child in skeleton[2])


class GroupShape:
    """What every group over the same set of leaf paths shares: tree shape, label, recipe cacheability."""

    __slots__ = ("skeleton", "label", "cacheable")

    def __init__(self, skeleton: tuple[Any, ...], label: str, cacheable: bool) -> None:
        self.skeleton = skeleton
        self.label = label
        self.cacheable = cacheable


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
            found = self._shapes[signature] = GroupShape(skeleton, label_of(op), not _has_scope(skeleton))  # type: ignore[arg-type]
        return found

    def op_for(self, steps: list[tuple[int, Path, Any]]) -> tuple[Mapper, GroupShape, dict[Path, list[Op]], tuple[Path, ...]]:
        """The group's op, its shape, its instances by leaf path (execution order) and its path signature."""
        instances: dict[Path, list[Op]] = {}
        for _, path, instance in sorted(steps, key=lambda step: step[0]) if len(steps) > 1 else steps:
            found = instances.get(path)
            if found is None:
                found = instances[path] = []
            if instance is not None:
                found.append(instance)
        signature = tuple(sorted(instances)) if len(instances) > 1 else tuple(instances)
        shape = self.shape(signature, instances)
        return _build(shape.skeleton, instances), shape, instances, signature


def label_of(op: Mapper) -> str:
    """A short human label: the kinds of operations the group runs, e.g. 'Concat' or 'Reshape+Transpose'."""
    kinds: list[str] = []
    for leaf in op.leaves():
        kind = type(leaf).__name__
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return "+".join(kinds) or "Rename"


def _keep_group(info: TensorInfo) -> Group:
    nbytes = info.nbytes
    recipe = {info.name: (ByteSlice(info.name, 0, nbytes),) if nbytes else ()}
    op = build_unchecked(Identity, name=info.name)
    return Group((info,), (info.meta(),), op, recipe, None, "keep")


def build_binding(binder: Any, rest: Rest) -> Binding:
    """Turn the binder's components into ordered groups; apply the rest policy."""
    infos: list[TensorInfo] = binder.infos
    outputs: dict[int, list[TensorInfo]] = {}
    untouched: list[int] = []
    for name, node in binder.state.nodes.items():
        if node.comp is None:
            untouched.append(node.source)
            continue
        root = find(node.comp)
        if node.meta is not None and not root.poisoned:
            outputs.setdefault(id(root), []).append(TensorInfo(name, node.meta[0], node.meta[1]))

    tracer = Tracer()
    restrictor = Restrictor(binder.mapper)
    ordered: list[tuple[int, Group]] = []
    dropped: list[int] = []
    seen: set[int] = set()
    for comp in binder.comps:
        root = find(comp)
        if id(root) in seen:
            continue
        seen.add(id(root))
        if root.poisoned or not root.sources:
            continue
        sources = sorted(root.sources)
        outs = outputs.get(id(root))
        if not outs:
            dropped.extend(sources)
            continue
        op, shape, instances, signature = restrictor.op_for(root.steps)
        inputs = tuple(infos[index] for index in sources)
        try:
            if shape.cacheable:
                recipe, chunk_cast = tracer.shared_recipe(signature, instances, op, inputs, outs)
            else:
                recipe, chunk_cast = tracer.direct_recipe(op, inputs, outs)
        except MapperError as exc:
            binder.problem(exc.message, op, outs[0].name)
            continue
        ordered.append((sources[0], Group(inputs, tuple(outs), op, recipe, chunk_cast, shape.label)))  # type: ignore[arg-type]

    rest_errors = 0
    for index in untouched:
        info = infos[index]
        if rest == "keep":
            ordered.append((index, _keep_group(info)))
        elif rest == "drop":
            dropped.append(index)
        else:
            rest_errors += 1
            if rest_errors <= MAX_REST_PROBLEMS:
                binder.problem(
                    f"Cannot leave {info.name!r} unmapped: no operation mentions it and rest='error'. "
                    f"Map it, M.Drop({info.name!r}) it, or bind with rest='keep' or rest='drop'.",
                    None, info.name,
                )
    if rest_errors > MAX_REST_PROBLEMS:
        binder.problem(
            f"Cannot leave {rest_errors - MAX_REST_PROBLEMS} more source tensors unmapped (rest='error'); only the first "
            f"{MAX_REST_PROBLEMS} are listed. Map or drop them, or bind with rest='keep'.",
            None, None,
        )
    ordered.sort(key=lambda pair: pair[0])
    return Binding(
        groups=[group for _, group in ordered],
        problems=binder.problems,
        dropped=[infos[index].name for index in sorted(dropped)],
    )
