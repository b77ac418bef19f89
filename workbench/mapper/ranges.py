"""Ranges in templates: `{e*}` stands for every value of `e` present, in natural order.

    M.Stack(['model.layers.{i}.mlp.experts.{e*}.w1.weight'], 'model.layers.{i}.mlp.experts.w1')

stacks, for each layer `i`, all experts of that layer (0, 1, 2, ... 10, natural order, not text order).
A range is written inside the name (a `*` after the placeholder) rather than as a marker object, so
names stay plain strings everywhere a name travels: `to_code`, JSON for workers, the builder widget,
`PrefixScope` renames. Where a range may stand:

- inputs of `Stack` and `Concat` (`srcs`): the values come from the source. Within one instance (one
  value of the other placeholders), every input ranging over the same placeholder must find the same
  values, and integer values must be consecutive, else the binding reports the missing tensor.
- outputs of `Unstack` and `Split` (`dsts`): the values are 0 .. n-1; `Unstack` takes n from the size
  of `dim`, `Split` from `sizes` (each ranged output takes an equal share of the parts the plain
  outputs leave). So `Stack.inverse` is an `Unstack` over the same range: the count comes from the data.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import MapperError
from ..names import Template, fill, placeholders_of

if TYPE_CHECKING:  # pragma: no cover
    from .op import Op

RANGE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\*\}")
ORDER_NOTE = "# {x*} in a name: every value of x present in the source, in natural order (2 before 10)."


def is_ranged(name: str) -> bool:
    """True when `name` holds a `{x*}` range."""
    return "*}" in name


def range_of(name: str) -> str | None:
    """The range placeholder of `name` (at most one per name), or None."""
    found = RANGE.search(name)
    return found.group(1) if found else None


def plain(name: str) -> str:
    """`name` with its range written as an ordinary placeholder (`{e*}` -> `{e}`), for matching and checks."""
    return RANGE.sub(lambda m: "{" + m.group(1) + "}", name) if "*}" in name else name


def without(name: str) -> str:
    """`name` with its range replaced by a literal segment: what the other placeholders see."""
    return RANGE.sub("_range_", name) if "*}" in name else name


def has_ranges(op: Any) -> bool:
    """True when some input or output name of `op` holds a range."""
    return any("*}" in name for name in op.inputs) or any("*}" in name for name in op.outputs)


def natural_key(value: str) -> tuple[int, int, str]:
    """Integers by value first, then other text."""
    return (0, int(value), "") if value.isdigit() else (1, 0, value)


def check_ranges(op: Op, where: str) -> None:
    """Construction checks: ranges only where they are defined, one per name, not reusing another placeholder."""
    ranged_in = [n for n in op.inputs if is_ranged(n)]
    ranged_out = [n for n in op.outputs if is_ranged(n)]
    if not ranged_in and not ranged_out:
        return
    from .ops import Concat, Split, Stack, Unstack

    allowed_in, allowed_out = isinstance(op, (Stack, Concat)), isinstance(op, (Unstack, Split))
    if (ranged_in and not allowed_in) or (ranged_out and not allowed_out):
        name = (ranged_in or ranged_out)[0]
        raise MapperError(
            f"Cannot build {where}: {name!r} holds a range ({{x*}}), which only Stack/Concat inputs and Unstack/Split "
            "outputs may hold. Use an ordinary placeholder {x} here."
        )
    for name in ranged_in + ranged_out:
        if len(RANGE.findall(name)) > 1:
            raise MapperError(f"Cannot build {where}: {name!r} holds two ranges. Range over one placeholder per name.")
        others = placeholders_of(without(name))
        if range_of(name) in others:
            raise MapperError(
                f"Cannot build {where}: {name!r} uses {{{range_of(name)}}} both as a range and as a placeholder. "
                "Give the range its own placeholder name."
            )
    if isinstance(op, Split) and ranged_out:
        plain_count = len(op.dsts) - len(ranged_out)
        if op.sizes is None or len(op.sizes) <= plain_count or (len(op.sizes) - plain_count) % len(ranged_out):
            raise MapperError(
                f"Cannot build {where}: outputs {list(op.dsts)} hold ranges, so the number of parts comes from sizes "
                f"(got {None if op.sizes is None else list(op.sizes)}). Give one size per part: the plain outputs take one "
                "each and the ranged outputs share the rest equally."
            )


def _consecutive_gap(values: list[str]) -> str | None:
    """The first missing integer when `values` are integers with a hole, else None."""
    if not values or not all(v.isdigit() for v in values):
        return None
    numbers = [int(v) for v in values]
    for before, after in zip(numbers, numbers[1:], strict=False):
        if after != before + 1:
            return str(before + 1)
    return None


def _replace(op: Op, **fields: Any) -> Op:
    return dataclasses.replace(op, **fields)  # type: ignore[type-var]


def expand(binder: Any, leaf: Op, state: Any, path: tuple[int, ...]) -> list[tuple[Op, bool]]:
    """Concrete instances of a leaf with ranges (the binder's `expand` for ranged leaves)."""
    if any(is_ranged(name) for name in leaf.inputs):
        return _expand_inputs(binder, leaf, state)
    return _expand_outputs(binder, leaf, state)


def _expand_inputs(binder: Any, leaf: Op, state: Any) -> list[tuple[Op, bool]]:
    """Stack/Concat: each ranged input becomes every matching name of its instance, in natural order."""
    order = tuple(sorted(placeholders_of(without(leaf.inputs[0]))))
    nodes = state.nodes
    entries: list[tuple[str, str | None, dict[tuple[str, ...], Any]]] = []
    for text in leaf.inputs:
        rng = range_of(text)
        template = Template(plain(text), order + ((rng,) if rng else ()))
        found: dict[tuple[str, ...], Any] = {}
        for name in state.candidates(template):
            if name in nodes:
                key = template.capture(name.split("."))
                if key is None:
                    continue
                if rng:
                    found.setdefault(key[:-1], {})[key[-1]] = name
                else:
                    found[key] = name
        entries.append((text, rng, found))
    empty = [plain(text) for text, _, found in entries if not found]
    if empty:
        binder._report_unmatched(leaf, empty, state)
        binder._failed_templates.update(leaf.outputs)
        return []
    instances: list[tuple[Op, bool]] = []
    keys = dict.fromkeys(key for _, _, found in entries for key in found)
    for key in keys:
        values = dict(zip(order, key, strict=True))
        where = ", ".join(f"{{{k}}}={v}" for k, v in values.items())
        where = f" ({where})" if where else ""
        problem: str | None = None
        seen: dict[str, tuple[str, list[str]]] = {}  # range -> (first input text, its values)
        srcs: list[str] = []
        for text, rng, found in entries:
            if rng is None:
                name = found.get(key, fill(text, values))
                if key not in found and problem is None:
                    problem = f"{name!r} is missing{where}"
                srcs.append(name)
                continue
            present = sorted(found.get(key, {}), key=natural_key)
            first = seen.setdefault(rng, (text, present))
            expected = sorted(set(present) | set(first[1]), key=natural_key)
            gap = _consecutive_gap(expected)
            if problem is None and (set(present) != set(first[1]) or gap is not None):
                lacking = next((v for v in expected if v not in present), None)
                if lacking is not None:
                    problem = (f"{fill(plain(text), {**values, rng: lacking})!r} is missing although "
                               f"{fill(plain(first[0]), {**values, rng: lacking})!r} is present{where}")
                elif gap is not None:
                    problem = f"{{{rng}*}} skips {gap} in {fill(plain(text), {**values, rng: gap})!r}{where}"
                else:
                    other = next(v for v in expected if v not in first[1])
                    problem = (f"{fill(plain(first[0]), {**values, rng: other})!r} is missing although "
                               f"{fill(plain(text), {**values, rng: other})!r} is present{where}")
            srcs.extend(fill(plain(text), {**values, rng: value}) for value in expected)
        if problem is not None:
            binder.problem(
                f"Cannot bind {leaf.short()}: {problem}. Every input ranging over one placeholder must find the same "
                "values (e.g. the same experts for w1 and w3). Add the missing tensor or list the inputs explicitly.",
                leaf, srcs[0], kind="missing",
            )
        instance = _replace(leaf, srcs=tuple(srcs), dst=fill(leaf.dst, values))  # type: ignore[attr-defined]
        instances.append((instance, problem is not None))
    return instances


def _expand_outputs(binder: Any, leaf: Op, state: Any) -> list[tuple[Op, bool]]:
    """Unstack/Split: the ranged outputs become 0 .. n-1, n from the input's shape (Unstack) or sizes (Split)."""
    src = leaf.src  # type: ignore[attr-defined]
    order = tuple(sorted(placeholders_of(src)))
    nodes = state.nodes
    if order:
        template = Template(src, order)
        matches = [(name, template.capture_values(name.split("."))) for name in state.candidates(template) if name in nodes]
        matches = [(name, values) for name, values in matches if values is not None]
        if not matches:
            binder._report_unmatched(leaf, [src], state)
            binder._failed_templates.update(without(n) for n in leaf.outputs)
            return []
    else:
        matches = [(src, {})]
    instances: list[tuple[Op, bool]] = []
    for name, values in matches:
        node = nodes.get(name)
        count = _output_count(leaf, node.meta if node is not None else None)
        if count is None:  # input missing or unknown: let `instance` report it, outputs stay unknown
            dsts = tuple(fill(plain(d), {**values, range_of(d): "0"}) if is_ranged(d) else fill(d, values) for d in leaf.dsts)  # type: ignore[attr-defined]
        else:
            dsts = tuple(_expanded_names(leaf.dsts, values, count))  # type: ignore[attr-defined]
        instances.append((_replace(leaf, src=name, dsts=dsts), False))
    return instances


def _output_count(leaf: Op, meta: Any) -> int | None:
    """How many values each ranged output takes, or None when the input's metadata is unknown."""
    from .ops import Split

    ranged = sum(1 for d in leaf.dsts if is_ranged(d))  # type: ignore[attr-defined]
    if isinstance(leaf, Split):
        return (len(leaf.sizes) - (len(leaf.dsts) - ranged)) // ranged  # type: ignore[arg-type]
    if meta is None:
        return None
    shape = meta[1]
    if not shape or not -len(shape) <= leaf.dim < len(shape):  # type: ignore[attr-defined]
        return None
    plain_count = len(leaf.dsts) - ranged  # type: ignore[attr-defined]
    return max(shape[leaf.dim % len(shape)] - plain_count, 0) // ranged  # type: ignore[attr-defined]


def _expanded_names(dsts: Sequence[str], values: dict[str, str], count: int) -> Iterable[str]:
    for name in dsts:
        if is_ranged(name):
            rng = range_of(name)
            yield from (fill(plain(name), {**values, rng: str(k)}) for k in range(count))  # type: ignore[dict-item]
        else:
            yield fill(name, values)


def zero_based(leaf: Op, instance: Op) -> bool:
    """True when every ranged input of `instance` took exactly the values 0 .. n-1 (so a ranged inverse is exact)."""
    order = tuple(sorted(placeholders_of(without(leaf.inputs[0]))))
    position = 0
    concrete = list(instance.inputs)
    for text in leaf.inputs:
        rng = range_of(text)
        if rng is None:
            position += 1
            continue
        template = Template(plain(text), order + (rng,))
        taken: list[str] = []
        while position < len(concrete):
            key = template.match(concrete[position].split("."))
            if key is None:
                break
            taken.append(key[-1])
            position += 1
        if taken != [str(k) for k in range(len(taken))]:
            return False
    return position == len(concrete)
