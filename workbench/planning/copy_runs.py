"""Copy runs: neighbouring small tensors copied whole, planned and run as one group instead of one each.

Copying a checkpoint of 100k tiny tensors would otherwise make 100k groups, steps, fingerprint lines and engine
calls, and that bookkeeping, not the bytes, was most of its planning time. When a safetensors output is made
from at least `RUN_MIN_TENSORS` tensors that lie raw in their files (safetensors), the planner puts up to
`RUN_TENSORS` small neighbours of one file (schedule order: file, then offset) that are copied whole, unchanged
or renamed, in one group: with no mapper and no dtype the binding is made in runs directly
(`copy_run_binding`); otherwise the schedule joins the mapper's one-tensor copies (`coalesce_copies`). The
layout still places the tensors one by one, exactly where one group per tensor would have put them, and cuts
a run where it crosses into the next output file (`planning.sharding.split_runs`), so the output bytes and the
rank assignment are the same.

Smaller checkpoints keep one group per tensor, which is what the plan's tables and graphs show best;
`wb.bind` and everything that previews single tensors always see the mapper's own groups.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from ..catalog import Catalog, TensorInfo
from ..mapper.groups import Binding, ByteSlice, Group
from ..mapper.recipes import LazyRecipe
from .sources import copy_group

T = TypeVar("T")

RUN_MIN_TENSORS = 1024  # below this many tensors a checkpoint keeps one group per tensor
RUN_TENSORS = 256  # tensors in one run, at most
RUN_TENSOR_BYTES = 1 << 20  # a tensor at least this large is a group of its own (runs are for bookkeeping-bound tensors)

_name = operator.attrgetter("name")
_begin = operator.attrgetter("begin")


class CopyRun(Mapping[str, tuple[ByteSlice, ...]]):
    """The recipe of a run: each output is the bytes of its input, whole, under its own name.

    `inputs` lie in one source file in file order; `sizes` are their byte sizes (end - begin); `outputs` are
    what they become (the inputs themselves when nothing renames them).
    """

    __slots__ = ("inputs", "outputs", "sizes", "total", "_index")

    def __init__(self, inputs: tuple[TensorInfo, ...], sizes: tuple[int, ...], outputs: tuple[TensorInfo, ...] | None = None) -> None:
        self.inputs = inputs
        self.outputs = inputs if outputs is None else outputs
        self.sizes = sizes
        self.total = sum(sizes)
        self._index: dict[str, int] | None = None

    def _position(self, name: str) -> int:
        if self._index is None:
            self._index = {t.name: k for k, t in enumerate(self.outputs)}
        return self._index[name]

    def __getitem__(self, name: str) -> tuple[ByteSlice, ...]:
        k = self._position(name)
        size = self.sizes[k]
        return (ByteSlice(self.inputs[k].name, 0, size),) if size else ()

    def spans(self, name: str) -> list[tuple[str, int, int]]:
        """Output `name`'s slices as (input name, begin, end): its input's bytes, whole."""
        k = self._position(name)
        size = self.sizes[k]
        return [(self.inputs[k].name, 0, size)] if size else []

    def input_bytes(self) -> list[tuple[str, int]]:
        """(input name, bytes copied from it), in run order."""
        return [(t.name, size) for t, size in zip(self.inputs, self.sizes, strict=True)]

    def text(self) -> str:
        """What the plan fingerprint hashes: the source file, every tensor's name (and new name), its source bytes."""
        inputs = self.inputs
        renamed = "" if self.outputs is inputs else " -> " + "\0".join(map(_name, self.outputs))
        return (f"run {inputs[0].file if inputs else ''} " + "\0".join(map(_name, inputs)) + renamed + " "
                + ",".join(map(str, map(_begin, inputs))) + " " + ",".join(map(str, self.sizes)))

    @property
    def out_sizes(self) -> tuple[int, ...]:
        """The bytes each output takes (its input's: a copy)."""
        return self.sizes

    def part(self, start: int, end: int, label: str) -> Group:
        """The group of tensors [start, end) of this run, labelled `label` (a run cut where it crosses into the
        next output file)."""
        renamed = self.outputs is not self.inputs
        return run_group(self.inputs[start:end], self.sizes[start:end], self.outputs[start:end] if renamed else None, label)

    def __iter__(self) -> Iterator[str]:
        return map(_name, self.outputs)

    def __len__(self) -> int:
        return len(self.inputs)

    def __repr__(self) -> str:
        return f"CopyRun({len(self.inputs)} tensors of {self.inputs[0].file if self.inputs else '-'!r})"


class PassThroughRun:
    """The op of a run: each input under its output name (what `PassThrough` or a rename is for one)."""

    def __init__(self, names: tuple[str, ...], outputs: tuple[str, ...] | None = None) -> None:
        self.names = names
        self.outputs = names if outputs is None else outputs

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Return the inputs under their output names."""
        return {out: tensors[name] for name, out in zip(self.names, self.outputs, strict=True)}

    def __repr__(self) -> str:
        return f"PassThroughRun({len(self.names)} tensors)"


def run_group(inputs: tuple[TensorInfo, ...], sizes: tuple[int, ...], outputs: tuple[TensorInfo, ...] | None = None,
              label: str = "copy") -> Group:
    """The group copying `inputs` (neighbours in one file) whole; its outputs are the inputs themselves unless given."""
    names = tuple(map(_name, inputs))
    if outputs is None:
        return Group(inputs, inputs, PassThroughRun(names), CopyRun(inputs, sizes), None, label)
    return Group(inputs, outputs, PassThroughRun(names, tuple(map(_name, outputs))), CopyRun(inputs, sizes, outputs), None, label)


def many_raw(catalog: Catalog) -> bool:
    """Whether `catalog` has enough tensors, raw in place, for its whole copies to be planned in runs."""
    return len(catalog.tensors) >= RUN_MIN_TENSORS and getattr(catalog.reader, "raw_in_place", False) is True


def schedule_order(catalog: Catalog) -> Iterator[list[TensorInfo]]:
    """The tensors of `catalog` in the order the schedule takes them: per source file (files sorted), by offset.

    Stable: tensors at one offset (empty ones) keep catalog order, as the schedule's binding order does.
    """
    by_file: dict[str, list[TensorInfo]] = {}
    for info in catalog.tensors.values():
        by_file.setdefault(info.file, []).append(info)
    for file in sorted(by_file):
        infos = by_file[file]
        infos.sort(key=_begin)
        yield infos


def stretches(items: Iterable[T], key: Callable[[T], object]) -> Iterator[list[T]]:
    """`items` cut into stretches of neighbours with equal keys, at most RUN_TENSORS long; an item whose key is
    None (one that cannot join a run) is a stretch of its own."""
    stretch: list[T] = []
    current: object = None
    for item in items:
        here = key(item)
        if stretch and (here is None or here != current or len(stretch) == RUN_TENSORS):
            yield stretch
            stretch = []
        if here is None:
            yield [item]
            continue
        stretch.append(item)
        current = here
    if stretch:
        yield stretch


def _small(info: TensorInfo) -> bool | None:
    """A run key for tensors of one file: True for a tensor small enough to join a run, None for one alone."""
    return True if info.end - info.begin < RUN_TENSOR_BYTES else None


def copy_run_binding(catalog: Catalog) -> Binding:
    """Every tensor of `catalog` copied unchanged, in schedule order: runs of small neighbours, other tensors alone.

    A tensor alone is the same group `passthrough_binding` makes, so what plans for it does not change.
    """
    groups: list[Group] = []
    for infos in schedule_order(catalog):
        for part in stretches(infos, _small):
            if len(part) > 1:
                groups.append(run_group(tuple(part), tuple(t.end - t.begin for t in part)))
            else:
                groups.append(copy_group(part[0], part[0].end - part[0].begin))
    return Binding(groups)


def whole_copy_size(group: Group) -> int | None:
    """The byte size of a group that copies its one input, whole and raw in place, into its one output (a
    pass-through or a rename); None for any other group."""
    inputs, outputs, recipe = group.inputs, group.outputs, group.recipe
    if recipe is None or len(inputs) != 1 or len(outputs) != 1 or len(recipe) != 1:
        return None
    first = inputs[0]
    size = first.end - first.begin
    if type(recipe) is dict:
        pieces = recipe.get(outputs[0].name)
        if pieces is None or len(pieces) > 1:
            return None
        if not pieces:
            return 0 if size == 0 else None
        piece = pieces[0]
        return size if piece.source == first.name and piece.begin == 0 and piece.end == size else None
    if type(recipe) is LazyRecipe:
        spans = recipe.spans(outputs[0].name)
        if not spans:
            return 0 if size == 0 else None
        return size if spans == [(first.name, 0, size)] else None
    return None


def coalesce_copies(groups: list[Group]) -> list[Group]:
    """`groups` (in schedule order, inputs raw in place) with each stretch of neighbouring small whole copies from
    one file with one label made one run (with that label); what a mapper keeps or renames one tensor at a time
    is then planned in runs too."""

    def key(item: tuple[Group, int | None]) -> tuple[str, str] | None:
        group, size = item
        return (group.inputs[0].file, group.label) if size is not None and size < RUN_TENSOR_BYTES else None

    result: list[Group] = []
    for part in stretches([(group, whole_copy_size(group)) for group in groups], key):
        if len(part) > 1:
            members = [group for group, _ in part]
            result.append(run_group(tuple(g.inputs[0] for g in members), tuple(size for _, size in part),  # type: ignore[misc]
                                    tuple(g.outputs[0] for g in members), members[0].label))
        else:
            result.append(part[0][0])
    return result
