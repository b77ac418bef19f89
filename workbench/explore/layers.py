"""Layer folding: turn `model.layers.0.mlp.up_proj.weight` ... `model.layers.31.mlp.up_proj.weight` into
one template `model.layers.{i}.mlp.up_proj.weight` ×32.

A checkpoint of a deep model is mostly the same few tensors repeated per layer; folding shows its
structure in a screenful, and the templates it finds use the `{placeholder}` syntax of `workbench.names`
(mapper names and name filters), so a mapper builder can offer them as suggestions and a filter can
select them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Placeholder names for the 1st, 2nd, 3rd ... numeric segment of a name.
PLACEHOLDERS = ("i", "j", "k", "l", "m", "n", "p", "q", "r", "s")

# A dotted segment made only of ASCII digits; re.split keeps the digits as captured pieces.
_NUMERIC_SEGMENT = re.compile(r"(?:(?<=\.)|^)([0-9]+)(?=\.|$)")
_NATURAL = re.compile(r"([0-9]+)")


@dataclass(frozen=True)
class Fold:
    """Tensors whose names differ only in their numeric segments, e.g. the same weight in every layer.

    `names[n]` is the template with `indices[n]` filled in; members are ordered by their indices.
    A name without numeric segments is a fold of one, with no placeholders.
    """

    template: str
    placeholders: tuple[str, ...]
    names: tuple[str, ...]
    indices: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        """How many tensors the template stands for."""
        return len(self.names)

    def index_range(self) -> str:
        """The indices as compact runs: '0-31', '0-3, 5', or 'i=0-7; j=0-3' with several placeholders."""
        if not self.placeholders:
            return ""
        runs = [compact_runs(sorted({idx[pos] for idx in self.indices})) for pos in range(len(self.placeholders))]
        if len(runs) == 1:
            return runs[0]
        return "; ".join(f"{ph}={run}" for ph, run in zip(self.placeholders, runs, strict=True))

    def label(self, member: int) -> str:
        """A short label for one member: its index values joined by dots ('3', or '3.7')."""
        return ".".join(str(v) for v in self.indices[member])


def compact_runs(values: Sequence[int]) -> str:
    """Sorted integers as runs of consecutive values: [0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    if not values:
        return ""
    parts = []
    start = prev = values[0]
    for v in values[1:]:
        if v != prev + 1:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = v
        prev = v
    parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(parts)


def fold_name(name: str) -> tuple[str, tuple[int, ...]]:
    """The template of one name and the integers it replaced: 'a.3.b.7.w' -> ('a.{i}.b.{j}.w', (3, 7))."""
    pieces = _NUMERIC_SEGMENT.split(name)
    if len(pieces) == 1:
        return name, ()
    # pieces alternate text, digits, text, digits, ..., text
    numbers = pieces[1::2]
    if len(numbers) > len(PLACEHOLDERS):
        return name, ()  # absurdly deep numbering: leave the name as it is
    out = [pieces[0]]
    for pos, text in enumerate(pieces[2::2]):
        out.append("{" + PLACEHOLDERS[pos] + "}")
        out.append(text)
    return "".join(out), tuple(int(d) for d in numbers)


def fold_names(names: Iterable[str]) -> list[Fold]:
    """Group names into folds, in order of each template's first appearance."""
    members: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for name in names:
        template, numbers = fold_name(name)
        bucket = members.get(template)
        if bucket is None:
            members[template] = bucket = []
        bucket.append((numbers, name))
    folds = []
    for template, bucket in members.items():
        bucket.sort()
        n_ph = len(bucket[0][0])
        folds.append(
            Fold(
                template=template,
                placeholders=PLACEHOLDERS[:n_ph],
                names=tuple(name for _, name in bucket),
                indices=tuple(numbers for numbers, _ in bucket),
            )
        )
    return folds


def natural_key(name: str) -> tuple:
    """Sort key that orders 'layers.10' after 'layers.9'."""
    return tuple(int(p) if p.isdigit() else p for p in _NATURAL.split(name))
