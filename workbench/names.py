"""Name templates and name filters: the one `{placeholder}` syntax of the package.

A placeholder `{i}` (any identifier in braces) stands for one dotted segment of a tensor name, or a part
of one: non-empty text without a dot. The same placeholder twice must stand for the same text. Mappers,
layer folding (`model.layers.{i}.mlp.up_proj.weight` ×32) and name filters all read it this way.

Templates (mappers): 'model.layers.{i}.self_attn.q_proj.weight' matches every name with the same number
of dotted segments whose literal segments are equal. Matching is done segment by segment so that a
catalog of 100k names can be indexed by (segment count, position, literal) and each template only looks
at the few names that can match. See `Template`.

Filters (people picking tensors: `workbench inspect --filter`, `Checkpoint.select` and the methods that
take a pattern, the Explorer's filter box) add glob wildcards and match part of a name. See
`name_filter` for the rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from .errors import MapperError, WorkbenchError


def is_unicode_text(text: str) -> bool:
    """False for a string holding a lone UTF-16 surrogate (a JSON `\\ud800` escape or a pickle's string can carry
    one): it is no Unicode character, so no file name, output header or terminal can hold it."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ANY_BRACE = re.compile(r"[{}]")
# Names in messages are quoted as typed, not with repr (which doubles every backslash of a pasted regular expression).
_REGEX_HINT = (" Names are not regular expressions: a '.' is a plain dot, '*' is any text, '?' one character and "
              "'{i}' one dotted segment.")
# What one placeholder captures: a non-empty part of one dotted segment (the shortest, when a segment
# holds several placeholders, so 'x_y_z' against '{a}_{b}' gives a='x', b='y_z' in templates and filters).
_SEGMENT_PART = "[^.]+?"
_GROUP = "ph_"  # regex group names are the placeholder names with this prefix


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
            f"Cannot build {where}: name '{name}' has a malformed placeholder. "
            "Write placeholders as {name} with a Python identifier inside, e.g. 'model.layers.{i}.mlp.up_proj.weight'."
            + (_REGEX_HINT if "\\" in name else "")
        )
    for segment in name.split("."):
        if not segment:
            raise MapperError(f"Cannot build {where}: name '{name}' has an empty dotted segment. Remove the doubled or trailing dot.")
    return name


def check_placeholder_sets(inputs: Sequence[str], outputs: Sequence[str], where: str) -> None:
    """Every input must use the same placeholders, and outputs exactly those (so expansion is one-to-one)."""
    if not inputs:
        return
    expected = set(placeholders_of(inputs[0]))
    for name in inputs[1:]:
        if set(placeholders_of(name)) != expected:
            raise MapperError(
                f"Cannot build {where}: inputs '{inputs[0]}' and '{name}' use different placeholders "
                f"({sorted(expected)} vs {sorted(placeholders_of(name))}). Give every input of one operation the same placeholders."
            )
    for name in outputs:
        if set(placeholders_of(name)) != expected:
            raise MapperError(
                f"Cannot build {where}: output '{name}' uses placeholders {sorted(placeholders_of(name))} but the inputs use "
                f"{sorted(expected)}. Use the same placeholders in outputs as in inputs, so each match writes its own tensor."
            )


def fill(template: str, values: dict[str, str]) -> str:
    """Substitute placeholder values into a template."""
    return template.format_map(values) if "{" in template else template


class Template:
    """A compiled template: literal segments to index on and placeholder segments to capture.

    `order` is the placeholder order of the owning operation; `match` returns the captured values
    in that order, so templates of one operation produce comparable keys. When every placeholder is a
    whole segment and appears once (`simple`), values are read by position; otherwise the name is
    matched by the same regular expression a name filter uses (`pattern_regex`), so both capture alike.
    """

    __slots__ = ("text", "nseg", "literals", "positions", "literal_key", "regex", "order", "simple")

    def __init__(self, text: str, order: Sequence[str]) -> None:
        self.text = text
        self.order = tuple(order)
        segments = text.split(".")
        self.nseg = len(segments)
        literals: list[tuple[int, str]] = []
        singles: list[tuple[int, str]] = []
        for pos, segment in enumerate(segments):
            whole = _PLACEHOLDER.fullmatch(segment)
            if whole is not None:
                singles.append((pos, whole.group(1)))
            elif not _PLACEHOLDER.search(segment):
                literals.append((pos, segment))
        self.literals = tuple(literals)
        self.positions = tuple(pos for pos, _ in literals)
        self.literal_key = tuple(literal for _, literal in literals)
        # Fast path: each placeholder is a whole segment and appears once -> (position, name) pairs.
        plain = len(literals) + len(singles) == len(segments) and len({name for _, name in singles}) == len(singles)
        self.simple = tuple(singles) if plain else None
        self.regex = None if plain else re.compile(pattern_regex(text, globs=False))

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
        found = self.regex.fullmatch(".".join(segments))  # type: ignore[union-attr]
        if found is None:
            return None
        return {key[len(_GROUP) :]: value for key, value in found.groupdict().items()}


# ------------------------------------------------------------------------------------------ filters


def name_filter(pattern: str) -> Callable[[str], bool]:
    """A test of tensor names for a filter pattern, the one rule of every place people pick tensors.

    A pattern is written like a tensor name, with
    - `{i}` (any identifier in braces): one dotted segment or a part of one, as in mapper templates
      (non-empty, no dot; the same placeholder twice is the same text);
    - `*`: any text, dots included (`*.mlp.*` spans the layer prefix); `?`: one character; `[abc]`,
      `[!abc]`: one character of (not of) a set, as in `fnmatch`;
    - any other character: itself, case-sensitively.
    It selects a name when it matches the whole name or any run of whole dotted segments in it:
    `layers.{i}.self_attn.*`, `self_attn` and `0.self_attn` all select
    `model.layers.0.self_attn.q_proj.weight`; `attn` does not (it is only part of a segment: write
    `*attn*`), and `norm.weight` selects `model.norm.weight` but not `model.layers.0.input_layernorm.weight`.

    An empty pattern selects every name. Raises WorkbenchError for a brace that is not a `{placeholder}`.
    """
    if not pattern:
        return lambda name: True  # an empty filter keeps everything, as an empty filter box does
    if not any(c in pattern for c in "{}*?["):  # plain text: string tests, several times faster than a regex
        inner, head, tail = f".{pattern}.", f"{pattern}.", f".{pattern}"
        return lambda name: name == pattern or inner in name or name.startswith(head) or name.endswith(tail)
    regex = re.compile(r"(?<![^.])(?:" + pattern_regex(pattern) + r")(?![^.])", re.DOTALL)
    return lambda name: regex.search(name) is not None


def filter_names(names: Iterable[str], pattern: str) -> list[str]:
    """The names a filter pattern selects (see `name_filter`), in their given order."""
    keep = name_filter(pattern)
    return [name for name in names if keep(name)]


def no_match_hint(pattern: str) -> str:
    """A sentence for when a filter selects nothing: a plain word matches only whole segments."""
    word = pattern.strip()
    if not word or any(c in word for c in "*?[{"):
        return ""
    return f"A filter matches whole dotted segments; to match inside names write '*{word}*'."


def pattern_regex(pattern: str, *, globs: bool = True, stars: bool = False) -> str:
    """The regular expression of a filter pattern (or, with `globs=False`, of a mapper template, where
    `*`, `?` and `[` are plain characters). Each placeholder is a named group (`ph_<name>`) of
    `_SEGMENT_PART`; a repeated one is a back-reference, so it must be the same text. With `stars`, the
    k-th `*` is the group `star<k>` and takes the shortest text that lets the whole pattern match (a
    glob in a mapper: what each `*` matched is carried to the output name)."""
    out: list[str] = []
    seen: set[str] = set()
    star = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "{" and (match := _PLACEHOLDER.match(pattern, i)):
            name = match.group(1)
            if name in seen:
                out.append(f"(?P={_GROUP}{name})")
            else:
                seen.add(name)
                out.append(f"(?P<{_GROUP}{name}>{_SEGMENT_PART})")
            i = match.end()
            continue
        if c in "{}":
            raise WorkbenchError(
                f"Cannot filter by '{pattern}': it has a malformed placeholder. Write placeholders as {{name}} with a "
                "Python identifier inside, e.g. 'layers.{i}.self_attn.*'."
            )
        if globs and c == "*":
            if stars:
                out.append(f"(?P<star{star}>.*?)")
                star += 1
            else:
                out.append(".*")
        elif globs and c == "?":
            out.append(".")
        elif globs and c == "[" and (end := _set_end(pattern, i)) > 0:
            inner = pattern[i + 1 : end].replace("\\", "\\\\").replace("[", "\\[")
            if inner.startswith("!"):
                inner = "^" + inner[1:]
            elif inner.startswith("^"):
                inner = "\\" + inner
            out.append(f"[{inner}]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _set_end(pattern: str, start: int) -> int:
    """Index of the ']' closing the `[...]` set that opens at `start`, or -1 when that '[' is literal.
    As in `fnmatch`, a ']' right after '[' or '[!' belongs to the set."""
    j = start + 1
    if pattern.startswith("!", j):
        j += 1
    if pattern.startswith("]", j):
        j += 1
    return pattern.find("]", j)
