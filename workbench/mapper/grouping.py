"""From a finished binder walk to a `Binding`: one group per connected component, plus the rest policy.

Each group's op comes from `restrict` (the mapper restricted to the group's instances); its byte recipe
and chunked-cast flag from `recipes` (tracing that op over symbolic inputs, once per group shape).
"""

from __future__ import annotations

from typing import Any

from ..catalog import TensorInfo
from ..errors import MapperError
from .base import Mapper, Rest
from .compose import Parallel, PrefixScope, Sequential
from .groups import Binding, ByteSlice, Group
from .ops import Identity
from .recipes import Tracer
from .restrict import Restrictor
from .state import find

MAX_REST_PROBLEMS = 100


def keep_group(info: TensorInfo) -> Group:
    """The group of a source tensor no operation mentions, under rest='keep': its bytes copied as they are."""
    # Once per untouched tensor (44k of a fused 100k-tensor checkpoint): the op and the group are filled in place,
    # as `build_unchecked` and `Group.__init__` do, without their calls.
    name = info.name
    nbytes = info.nbytes
    op = _new(Identity)
    op.__dict__["name"] = name
    group = _new(Group)
    group.__dict__.update(inputs=(info,), outputs=(TensorInfo(name, info.dtype, info.shape),), op=op,
                          recipe={name: (ByteSlice(name, 0, nbytes),) if nbytes else ()}, chunk_cast=None, label="keep")
    return group


_new = object.__new__


def build_binding(binder: Any, rest: Rest) -> Binding:
    """Turn the binder's components into ordered groups; apply the rest policy."""
    infos: list[TensorInfo] = binder.infos
    untouched: list[int] = []
    for name, node in binder.state.nodes.items():
        comp = node.comp
        if comp is None:
            untouched.append(node.source)
            continue
        root = comp if comp.parent is None else find(comp)
        if node.meta is not None and not root.poisoned:
            root.outputs.append(TensorInfo(name, node.meta[0], node.meta[1]))

    tracer = Tracer()
    restrictor = Restrictor(binder.mapper)
    ordered: list[tuple[int, Group]] = []
    dropped: list[int] = []
    for root in binder.comps:
        if root.parent is not None or root.poisoned or not root.sources:
            continue  # merged into another component, failed, or made of missing inputs only
        sources = sorted(root.sources) if len(root.sources) > 1 else root.sources
        outs = root.outputs
        if not outs:
            dropped.extend(sources)
            continue
        op, shape, instances, signature = restrictor.op_for(root.steps)
        inputs = (infos[sources[0]],) if len(sources) == 1 else tuple([infos[index] for index in sources])
        try:
            if shape.cacheable:
                recipe, chunk_cast = tracer.shared_recipe(signature, instances, op, inputs, outs)
            else:
                recipe, chunk_cast = tracer.direct_recipe(op, inputs, outs, leafless=shape.op is not None)
        except MapperError as exc:
            binder.problem(exc.message, op, outs[0].name, kind="invalid")
            continue
        ordered.append((sources[0], Group(inputs, tuple(outs), op, recipe, chunk_cast, shape.label)))  # type: ignore[arg-type]

    rest_errors = 0
    for index in untouched:
        info = infos[index]
        if rest == "keep":
            ordered.append((index, keep_group(info)))
        elif rest == "drop":
            dropped.append(index)
        else:
            rest_errors += 1
            if rest_errors <= MAX_REST_PROBLEMS:
                binder.problem(
                    f"Cannot leave {info.name!r} unmapped: no operation mentions it and rest='error'. "
                    f"Map it, M.Drop({info.name!r}) it, or bind with rest='keep' or rest='drop'.",
                    None, info.name, kind="unmapped",
                )
    if rest_errors > MAX_REST_PROBLEMS:
        binder.problem(
            f"Cannot leave {rest_errors - MAX_REST_PROBLEMS} more source tensors unmapped (rest='error'); only the first "
            f"{MAX_REST_PROBLEMS} are listed. Map or drop them, or bind with rest='keep'.",
            None, None, kind="unmapped",
        )
    ordered.sort(key=lambda pair: pair[0])
    return Binding(
        groups=[group for _, group in ordered],
        problems=binder.problems,
        dropped=[infos[index].name for index in sorted(dropped)],
    )


def rename_binding(mapper: Mapper, infos: list[TensorInfo], rest: Rest) -> Binding | None:
    """The binding of a bare prefix rename (a `PrefixScope` around an empty composite: `presets.strip_prefix`,
    `presets.add_prefix`) built in one pass over the source, or None when the walk is needed.

    Equal to what the binder's walk and `build_binding` give (tests compare the two); the walk is taken
    whenever a renamed tensor would land on a name left in place (that is a problem the walk reports),
    and for rest='error' (its messages). A renamed checkpoint of 100k tensors binds in a third of the time.
    """
    if type(mapper) is not PrefixScope or rest not in ("keep", "drop"):
        return None
    inner = mapper.mapper
    source, target = mapper.source_prefix, mapper.target_prefix
    if type(inner) not in (Sequential, Parallel) or inner.mappers or source == target:
        return None
    cut = len(source)
    renamed = {target + info.name[cut:] for info in infos if info.name.startswith(source)}
    if any(info.name in renamed for info in infos if not info.name.startswith(source)):
        return None
    op, shape, _, _ = Restrictor(mapper).op_for([(1, (), None)])  # the group every renamed tensor gets
    label = shape.label
    groups: list[Group] = []
    dropped: list[str] = []
    for info in infos:
        name = info.name
        if name.startswith(source):
            out = target + name[cut:]
            nbytes = info.nbytes
            recipe = {out: (ByteSlice(name, 0, nbytes),) if nbytes else ()}
            groups.append(Group((info,), (TensorInfo(out, info.dtype, tuple(info.shape)),), op, recipe, None, label))
        elif rest == "keep":
            groups.append(keep_group(info))
        else:
            dropped.append(name)
    return Binding(groups, [], dropped)
