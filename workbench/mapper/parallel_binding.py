"""Binding a Parallel of templated operations in one pass over the source, without the binder's walk.

Presets such as `presets.hf_to_fused` are `Sequential(Parallel(op, op, ...), Claim, ...)`: every operation
reads source tensors through templates whose placeholders are whole segments
(`model.layers.{i}.self_attn.q_proj.weight`), no two read the same tensor, and the claims only look at what
is left. For that shape the walk's bookkeeping (a node per tensor, components, consumed and produced
effects, a template index) finds nothing the source order does not say already: each template instance is a
group of its own. `parallel_binding` builds those groups directly, equal to what the walk and
`grouping.build_binding` give (tests compare the two), and returns None, so that the walk runs and
reports, whenever anything is off: a partial or missing match, a tensor read twice, an output name
taken, an inference or recipe error, rest='error'.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from ..catalog import TensorInfo
from ..errors import MapperError
from ..names import Template, placeholders_of
from .base import Mapper, Meta, Rest
from .claim import Claim
from .compose import Parallel, Sequential
from .grouping import keep_group
from .groups import Binding, Group, Problem
from .op import Op
from .patterns import has_globs
from .ranges import has_ranges
from .recipes import LazyRecipe, Tracer
from .restrict import GroupShape, Restrictor

Path = tuple[int, ...]
Key = tuple[str, ...]  # placeholder values in the leaf's placeholder order


@dataclass
class _Leaf:
    """One operation of the Parallel: where it sits in the tree, its placeholder order, its compiled input templates."""

    path: Path
    op: Op
    order: tuple[str, ...]
    templates: list[Template]


def _leaf(op: Mapper, path: Path) -> _Leaf | None:
    """`op` as a `_Leaf` when every input is a whole-segment template over the same placeholders, else None."""
    if not isinstance(op, Op) or not op.outputs or not op.inputs or has_ranges(op) or has_globs(op) or not op.is_template:
        return None
    order = tuple(sorted(placeholders_of(op.inputs[0])))
    templates = [Template(text, order) for text in op.inputs]
    for template in templates:
        if template.simple is None or sorted(name for _, name in template.simple) != list(order):
            return None
    return _Leaf(path, op, order, templates)


def _shape(mapper: Mapper) -> tuple[list[_Leaf], list[Claim]] | None:
    """The leaves of a bare `Parallel`, or of a `Sequential(Parallel, Claim, ...)` with its claims; None otherwise."""
    if type(mapper) is Parallel:
        parallel, claims, base = mapper, [], ()
    elif type(mapper) is Sequential and mapper.mappers and type(mapper.mappers[0]) is Parallel:
        parallel, claims, base = mapper.mappers[0], list(mapper.mappers[1:]), (0,)
        if any(type(claim) is not Claim for claim in claims):
            return None
    else:
        return None
    leaves = [_leaf(child, base + (index,)) for index, child in enumerate(parallel.mappers)]
    if not leaves or None in leaves:
        return None
    return leaves, claims  # type: ignore[return-value]


def _picker(positions: list[int] | tuple[int, ...]) -> Callable[[list[str]], Key]:
    """A function giving the segments at `positions` as a tuple (itemgetter's speed, a tuple even for one position)."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        (pos,) = positions
        return lambda segments: (segments[pos],)
    return lambda segments: ()


def _match(leaves: list[_Leaf], infos: list[TensorInfo]) -> list[dict[Key, list[int]]] | None:
    """For each leaf: placeholder values -> the index of the source tensor each of its templates matches (-1: none).

    None when a source tensor matches two templates (the walk reports it read twice).
    """
    # segment count -> literal positions -> (their picker, literal segments -> (leaf, template) numbers)
    tables: dict[int, dict[tuple[int, ...], tuple[Callable[[list[str]], Key], dict[Key, list[tuple[int, int]]]]]] = {}
    key_of: list[list[Callable[[list[str]], Key]]] = []  # per leaf, per template: its placeholder values, in `order`
    for number, leaf in enumerate(leaves):
        key_of.append([])
        for slot, template in enumerate(leaf.templates):
            by_positions = tables.setdefault(template.nseg, {})
            if template.positions not in by_positions:
                by_positions[template.positions] = (_picker(template.positions), {})
            by_positions[template.positions][1].setdefault(template.literal_key, []).append((number, slot))
            at = {name: pos for pos, name in template.simple}  # type: ignore[union-attr]
            key_of[number].append(_picker([at[name] for name in leaf.order]))
    matched: list[dict[Key, list[int]]] = [{} for _ in leaves]
    for index, info in enumerate(infos):
        segments = info.name.split(".")
        by_positions = tables.get(len(segments))
        if by_positions is None:
            continue
        hit = None
        for literals_of, table in by_positions.values():
            found = table.get(literals_of(segments))
            if found is not None:
                if hit is not None or len(found) > 1:
                    return None
                hit = found[0]
        if hit is not None:
            number, slot = hit
            key = key_of[number][slot](segments)
            found = matched[number].get(key)
            if found is None:
                found = matched[number][key] = [-1] * len(key_of[number])
            found[slot] = index
    return matched


def _complete(found: dict[Key, list[int]]) -> bool:
    """A leaf matched, and every one of its templates for the same placeholder values."""
    return bool(found) and not any(-1 in indexes for indexes in found.values())


def parallel_binding(mapper: Mapper, infos: list[TensorInfo], rest: Rest) -> Binding | None:
    """The binding of a Parallel of whole-segment template operations (optionally followed by claims) built in
    one pass over the source, or None when the walk is needed (see the module docstring)."""
    if rest not in ("keep", "drop"):
        return None
    shape = _shape(mapper)
    if shape is None:
        return None
    leaves, claims = shape
    matched = _match(leaves, infos)
    if matched is None or not all(_complete(found) for found in matched):
        return None
    restrictor, tracer = Restrictor(mapper), Tracer()
    consumed = bytearray(len(infos))
    group_at: dict[int, Group] = {}  # a group by its first (lowest) source index: where the walk's order puts it
    produced: set[str] = set()
    for leaf, found in zip(leaves, matched, strict=True):
        maker = _LeafGroups(restrictor, tracer, leaf.path)
        op = leaf.op
        for key, indexes in found.items():
            instance = op.fill_names(dict(zip(leaf.order, key, strict=True)))
            try:
                group = maker.group(instance, infos, indexes)
            except MapperError:
                return None
            for index in indexes:
                consumed[index] = 1
            names = instance.outputs
            if not produced.isdisjoint(names):
                return None  # two instances write one name
            produced.update(names)
            group_at[min(indexes)] = group
    left = [info.name for index, info in enumerate(infos) if not consumed[index]]
    if not produced.isdisjoint(left):
        return None  # an output lands on a tensor left in place
    problems = []
    for claim in claims:
        leftovers = claim.leftovers(left)
        if leftovers:
            problems.append(Problem("error", claim.message(leftovers), claim.short(), leftovers[0], kind="unconverted"))
    return _assemble(infos, consumed, group_at, rest, problems)


class _LeafGroups:
    """Makes the groups of one leaf's instances, working out once what they share: the group's op (the
    instance itself when the leaf is the restricted mapper's only node), its label, and per input metadata
    the inferred outputs and the traced recipe, which later instances take renamed (`LazyRecipe.renamed`)
    instead of building their token pattern and cache key again. Equal to `grouping.build_binding`'s groups
    (tests compare them); any other case takes the general path per instance (`_group`)."""

    def __init__(self, restrictor: Restrictor, tracer: Tracer, path: Path) -> None:
        self.restrictor, self.tracer, self.path = restrictor, tracer, path
        # input metadata (template order) -> (outputs, (recipe, chunk_cast, label) to reuse or None)
        self.known: dict[tuple[Meta, ...], tuple[list[Meta], tuple[LazyRecipe | None, str | None, str] | None]] = {}

    def group(self, instance: Op, infos: list[TensorInfo], indexes: list[int]) -> Group:
        """The group of one instance reading `infos[indexes]` (template order); raises MapperError as the walk's would."""
        metas = tuple([(infos[index].dtype, tuple(infos[index].shape)) for index in indexes])
        known = self.known.get(metas)
        if known is None:
            outputs = instance._infer(list(metas))
            group, shape = _group(self.restrictor, self.tracer, self.path, instance, infos, indexes, outputs)
            self.known[metas] = (outputs, self._reusable(instance, group, shape))
            return group
        outputs, reuse = known
        names = instance.inputs + instance.outputs
        if reuse is None or len(set(names)) != len(names):
            return _group(self.restrictor, self.tracer, self.path, instance, infos, indexes, outputs)[0]
        recipe, chunk_cast, label = reuse
        sources = sorted(indexes)
        inputs = tuple([infos[index] for index in sources])
        outs = tuple([TensorInfo(name, dtype, shape) for name, (dtype, shape) in zip(instance.outputs, outputs, strict=True)])
        return Group(inputs, outs, instance, None if recipe is None else recipe.renamed(list(names)), chunk_cast, label)

    @staticmethod
    def _reusable(instance: Op, group: Group, shape: GroupShape) -> tuple[LazyRecipe | None, str | None, str] | None:
        """What later instances with the same input metadata can take from `group` (the first one's), or None.

        Reusable when the group's op is the instance itself and its recipe came from the tracer's shared cache
        with every name distinct (tokens = positions in inputs + outputs): then another instance with distinct
        names has the same cache key, so the same shared recipe and chunk_cast."""
        names = instance.inputs + instance.outputs
        recipe = group.recipe
        if not shape.cacheable or group.op is not instance or len(set(names)) != len(names):
            return None
        if recipe is not None and type(recipe) is not LazyRecipe:
            return None
        return recipe, group.chunk_cast, group.label


def _group(restrictor: Restrictor, tracer: Tracer, path: Path, instance: Op, infos: list[TensorInfo],
           indexes: list[int], outputs: list[Meta]) -> tuple[Group, GroupShape]:
    """What `grouping.build_binding` makes of the component of one instance (raises MapperError as its recipe does),
    and the shape of its op."""
    sources = sorted(indexes)
    inputs = tuple([infos[index] for index in sources])
    outs = [TensorInfo(name, dtype, shape) for name, (dtype, shape) in zip(instance.outputs, outputs, strict=True)]
    op, shape, instances, signature = restrictor.op_for([(1, path, instance)])
    if shape.cacheable:
        recipe, chunk_cast = tracer.shared_recipe(signature, instances, op, inputs, outs)
    else:
        recipe, chunk_cast = tracer.direct_recipe(op, inputs, outs, leafless=shape.op is not None)
    return Group(inputs, tuple(outs), op, recipe, chunk_cast, shape.label), shape


def _assemble(infos: list[TensorInfo], consumed: bytearray, group_at: dict[int, Group], rest: Rest,
              problems: list[Problem]) -> Binding:
    """Groups in source order (each at its first input), untouched tensors kept or dropped."""
    groups: list[Group] = []
    dropped: list[str] = []
    for index, info in enumerate(infos):
        group = group_at.get(index)
        if group is not None:
            groups.append(group)
        elif not consumed[index]:
            if rest == "keep":
                groups.append(keep_group(info))
            else:
                dropped.append(info.name)
    return Binding(groups, problems, dropped)
