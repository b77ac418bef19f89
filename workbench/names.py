"""Name templates: `{placeholder}` segments that stand for one dotted segment of a tensor name.

A template such as 'model.layers.{i}.self_attn.q_proj.weight' matches every name with the same number
of dotted segments whose literal segments are equal and whose `{i}` segment is any non-empty text
without a dot. Matching is done segment by segment so that a catalog of 100k names can be indexed by
(segment count, position, literal) and each template only looks at the few names that can match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from .errors import MapperError

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ANY_BRACE = re.compile(r"[{}]")


def is_template(name: str) -> bool:
    """True when `name` holds at least one `{placeholder}`."""
    return "{" in name


def placeholders_of(name: str) -> tuple[str, ...]:
    """The placeholder names of a template, in order of first appearance."""
    seen: dict[str, None] = {}
    for match in _PLACEHOLDER.finditer(name):
        seen.setdefault(match.group(1), None)
    return tuple(seen)


def check_name(name: object, where: str) -> str:
    """Validate one tensor name or template; raise MapperError naming the operation `where`."""
    if not isinstance(name, str) or not name:
        raise MapperError(f"Cannot build {where}: tensor names must be non-empty strings (got {name!r}). Pass a name such as 'model.norm.weight'.")
    leftover = _ANY_BRACE.search(_PLACEHOLDER.sub("", name))
    if leftover is not None:
        raise MapperError(
            f"Cannot build {where}: name {name!r} has a malformed placeholder. "
            "Write placeholders as {name} with a Python identifier inside, e.g. 'model.layers.{i}.mlp.up_proj.weight'."
        )
    for segment in name.split("."):
        if not segment:
            raise MapperError(f"Cannot build {where}: name {name!r} has an empty dotted segment. Remove the doubled or trailing dot.")
    return name


def check_placeholder_sets(inputs: Sequence[str], outputs: Sequence[str], where: str) -> None:
    """Every input must use the same placeholders, and outputs exactly those (so expansion is one-to-one)."""
    if not inputs:
        return
    expected = set(placeholders_of(inputs[0]))
    for name in inputs[1:]:
        if set(placeholders_of(name)) != expected:
            raise MapperError(
                f"Cannot build {where}: inputs {inputs[0]!r} and {name!r} use different placeholders "
                f"({sorted(expected)} vs {sorted(placeholders_of(name))}). Give every input of one operation the same placeholders."
            )
    for name in outputs:
        if set(placeholders_of(name)) != expected:
            raise MapperError(
                f"Cannot build {where}: output {name!r} uses placeholders {sorted(placeholders_of(name))} but the inputs use "
                f"{sorted(expected)}. Use the same placeholders in outputs as in inputs, so each match writes its own tensor."
            )


def fill(template: str, values: dict[str, str]) -> str:
    """Substitute placeholder values into a template."""
    return template.format_map(values) if "{" in template else template


class Template:
    """A compiled template: literal segments to index on and placeholder segments to capture.

    `order` is the placeholder order of the owning operation; `match` returns the captured values
    in that order, so templates of one operation produce comparable keys.
    """

    __slots__ = ("text", "nseg", "literals", "positions", "literal_key", "captures", "order", "simple")

    def __init__(self, text: str, order: Sequence[str]) -> None:
        self.text = text
        self.order = tuple(order)
        segments = text.split(".")
        self.nseg = len(segments)
        literals: list[tuple[int, str]] = []
        captures: list[tuple[int, str | None, re.Pattern[str] | None, tuple[str, ...]]] = []
        for pos, segment in enumerate(segments):
            names = [m.group(1) for m in _PLACEHOLDER.finditer(segment)]
            if not names:
                literals.append((pos, segment))
            elif _PLACEHOLDER.fullmatch(segment):
                captures.append((pos, names[0], None, ()))
            else:
                pattern = re.compile(_PLACEHOLDER.sub("([^.]+?)", re.escape(segment).replace(r"\{", "{").replace(r"\}", "}")))
                captures.append((pos, None, pattern, tuple(names)))
        self.literals = tuple(literals)
        self.positions = tuple(pos for pos, _ in literals)
        self.literal_key = tuple(literal for _, literal in literals)
        self.captures = tuple(captures)
        # Fast path: each placeholder is a whole segment and appears once -> (position, name) pairs.
        singles = [(pos, single) for pos, single, _, _ in captures if single is not None]
        plain = len(singles) == len(captures) and len({name for _, name in singles}) == len(singles)
        self.simple = tuple(singles) if plain else None

    def match(self, segments: Sequence[str]) -> tuple[str, ...] | None:
        """Placeholder values (in `order`) if the split name matches, else None."""
        if len(segments) != self.nseg:
            return None
        for pos, literal in self.literals:
            if segments[pos] != literal:
                return None
        return self.capture(segments)

    def capture(self, segments: Sequence[str]) -> tuple[str, ...] | None:
        """Placeholder values (in `order`) of a name already known to have this template's literal segments."""
        values = self.capture_values(segments)
        return None if values is None else tuple([values[name] for name in self.order])

    def capture_values(self, segments: Sequence[str]) -> dict[str, str] | None:
        """Placeholder name -> value for a name already known to have this template's literal segments."""
        if self.simple is not None:
            return {name: segments[pos] for pos, name in self.simple}
        values: dict[str, str] = {}
        for pos, single, pattern, names in self.captures:
            if single is not None:
                pairs: Iterable[tuple[str, str]] = ((single, segments[pos]),)
            else:
                found = pattern.fullmatch(segments[pos])  # type: ignore[union-attr]
                if found is None:
                    return None
                pairs = zip(names, found.groups(), strict=False)
            for name, value in pairs:
                if values.setdefault(name, value) != value:
                    return None
        return values
