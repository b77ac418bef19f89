"""Span runs: neighbouring small byte copies of one file, some of them concatenations, planned as one step.

A fusion preset (`presets.hf_to_fused`) makes each layer's q/k/v one output and gate/up another, and keeps the
norms and the other projections as they are: in schedule order (file, then offset) a layer is a kept tensor, a
concatenation, a kept tensor, a concatenation... Copy runs (`planning.runs.CopyRun`) join only whole copies of
one input, so there they joined two or three tensors at a time, and a checkpoint of 100k tiny tensors still made
one step (a layout entry, a fingerprint line, an engine call) per concatenation. A span run joins up to
`RUN_TENSORS` neighbours whose one output is a concatenation of byte ranges of inputs in the same source file
(a whole copy is the case of one range): each member keeps its own group (its recipe, shared per shape by the
tracer, and its label), and the run is what the schedule, the layout, the fingerprint and the engine see.

The layout still places each member's output one by one, and cuts a run where it crosses into the next output
file (`planning.sharding.split_runs` calls `part`), so the output bytes and the ranks are those of one step per
group.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..catalog import TensorInfo
from ..mapper.groups import ByteSlice, Group
from .schedule import COPY


def member_spans(group: Group, name: str) -> list[tuple[str, int, int]]:
    """Output `name`'s byte ranges in `group`'s recipe as (input name, begin, end), without making ByteSlices
    when the recipe can say them directly (a shared recipe, `mapper.recipes.LazyRecipe`)."""
    recipe = group.recipe
    spans = None if type(recipe) is dict else getattr(recipe, "spans", None)
    if spans is not None:
        return spans(name)
    return [(p.source, p.begin, p.end) for p in recipe[name]]  # type: ignore[index]


Pieces = tuple[tuple[TensorInfo, int, int], ...]  # one output's byte ranges: (input, begin, end), in order


def whole_pieces(info: TensorInfo, size: int) -> Pieces:
    """The byte ranges of a whole copy of `info` (`size` bytes, none when empty)."""
    return ((info, 0, size),) if size else ()


def span_pieces(group: Group) -> Pieces | None:
    """The byte ranges making a group's one output when it is a concatenation of byte ranges of its inputs, all in
    one source file (a fused q/k/v, a whole copy); None for any other group. The caller knows every input lies raw
    in place (the schedule joins runs only then)."""
    inputs, outputs, recipe = group.inputs, group.outputs, group.recipe
    if recipe is None or len(outputs) != 1 or len(recipe) != 1 or not inputs:
        return None
    file = inputs[0].file
    for t in inputs:
        if t.file != file:
            return None
    out = outputs[0]
    if next(iter(recipe)) != out.name:  # (`in` would build a shared recipe's ByteSlices)
        return None
    by_name = {t.name: t for t in inputs}
    pieces = []
    total = 0
    for source, begin, end in member_spans(group, out.name):
        info = by_name.get(source)
        if info is None:
            return None
        pieces.append((info, begin, end))
        total += end - begin
    return tuple(pieces) if total == out.nbytes else None


class SpanRun(Mapping[str, tuple[ByteSlice, ...]]):
    """The recipe of a span run: output name -> its member's ByteSlices (what every general path reads).

    `members` are the joined groups in schedule order, one output each; `outputs` their outputs, `out_sizes` their
    bytes, `total` the bytes read and written; `labels` each member's label (the plan's tensor table shows them).
    """

    __slots__ = ("members", "outputs", "out_sizes", "total", "_index", "_pieces")

    def __init__(self, members: tuple[Group, ...], pieces: tuple[Pieces, ...]) -> None:
        self.members = members
        self._pieces = pieces
        self.outputs = tuple([g.outputs[0] for g in members])
        self.out_sizes = tuple([t.nbytes for t in self.outputs])
        self.total = sum(self.out_sizes)
        self._index: dict[str, int] | None = None

    def pieces(self) -> tuple[Pieces, ...]:
        """Per member, its output's byte ranges as (input, begin, end), in order (what the fingerprint, the page
        alignment and the engine read)."""
        return self._pieces

    def member(self, name: str) -> Group:
        """The member group writing output `name`."""
        if self._index is None:
            self._index = {t.name: k for k, t in enumerate(self.outputs)}
        return self.members[self._index[name]]

    def __getitem__(self, name: str) -> tuple[ByteSlice, ...]:
        return tuple(self.member(name).recipe[name])  # type: ignore[index]

    def spans(self, name: str) -> list[tuple[str, int, int]]:
        """Output `name`'s byte ranges as (input name, begin, end)."""
        return member_spans(self.member(name), name)

    @property
    def labels(self) -> tuple[str, ...]:
        """Each member's label, in run order."""
        return tuple([g.label for g in self.members])

    def text(self) -> str:
        """What the plan fingerprint hashes: the source file; per member its label, output and the byte ranges it is
        made of (input name, where the input starts in the file, the range). Dtypes and shapes are the output
        header's, which the fingerprint hashes per file."""
        members = self.members
        lines = [f"spans {members[0].inputs[0].file if members else ''}"]
        for group, pieces in zip(members, self.pieces(), strict=True):
            spans = ",".join([f"{t.name}@{t.begin}[{begin}:{end}]" for t, begin, end in pieces])
            lines.append(f"{group.label}|{group.outputs[0].name}={spans}")
        return "\0".join(lines)

    def part(self, start: int, end: int, label: str) -> Group:
        """The group of members [start, end) of this run, labelled `label` (a run cut where it crosses into the
        next output file)."""
        return span_run_group(self.members[start:end], self._pieces[start:end], label)

    def __iter__(self) -> Iterator[str]:
        return iter([t.name for t in self.outputs])

    def __len__(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        return f"SpanRun({len(self.members)} groups of {self.members[0].inputs[0].file if self.members else '-'!r})"


class SpanRunOp:
    """The op of a span run: each member's op on its own inputs."""

    run_kind = COPY  # the schedule's kind of a span run's step

    def __init__(self, members: tuple[Group, ...]) -> None:
        self.members = members

    def apply(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Every member's outputs, each computed from its own inputs."""
        result: dict[str, Any] = {}
        for group in self.members:
            result.update(group.apply({t.name: tensors[t.name] for t in group.inputs}))
        return result

    def __repr__(self) -> str:
        return f"SpanRunOp({len(self.members)} groups)"


def span_run_group(members: tuple[Group, ...], pieces: tuple[Pieces, ...], label: str) -> Group:
    """The group of a span run over `members` (neighbours in schedule order, inputs in one file; `pieces`: each
    one's byte ranges, `span_pieces`)."""
    inputs: list[TensorInfo] = []
    for group in members:
        inputs.extend(group.inputs)
    recipe = SpanRun(members, pieces)
    return Group(tuple(inputs), recipe.outputs, SpanRunOp(members), recipe, None, label)


def run_label(members: tuple[Group, ...]) -> str:
    """A span run's label: its members' distinct labels, in order of first appearance."""
    return " + ".join(dict.fromkeys(g.label for g in members))
