"""Copy runs: neighbouring small tensors copied unchanged, planned and run as one group instead of one each.

Copying a checkpoint of 100k tiny tensors as it is would make 100k groups, steps, fingerprint lines and engine
calls, and that bookkeeping, not the bytes, was most of its planning time. When nothing maps the tensors (no
mapper, no dtype) and they lie raw in their files (safetensors), the planner takes them in schedule order
(file, then offset) and puts up to `RUN_TENSORS` small neighbours of one file in one group. The layout still
places them one by one, exactly where one group per tensor would have put them, and splits a run where it
crosses into the next output file (`split_runs`), so the output bytes and the rank assignment are the same.

Checkpoints of fewer than `RUN_MIN_TENSORS` tensors keep one group per tensor, which is what the plan's tables
and graphs show best; `wb.bind` and everything that previews single tensors always see one group per tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..mapper.groups import Binding, ByteSlice, Group

RUN_MIN_TENSORS = 1024  # below this many tensors a checkpoint keeps one group per tensor
RUN_TENSORS = 256  # tensors in one run, at most
RUN_TENSOR_BYTES = 1 << 20  # a tensor at least this large is a group of its own (runs are for bookkeeping-bound tensors)

_begin = operator.attrgetter("begin")
_file = operator.attrgetter("file")


class CopyRun(Mapping[str, tuple[ByteSlice, ...]]):
    """The recipe of a run: each output is its own input's bytes, whole (a run's outputs are its inputs).

    `inputs` lie in one source file in file order; `sizes` are their byte sizes (end - begin).
    """

    __slots__ = ("inputs", "sizes", "total", "_index")

    def __init__(self, inputs: tuple[TensorInfo, ...], sizes: tuple[int, ...]) -> None:
        self.inputs = inputs
        self.sizes = sizes
        self.total = sum(sizes)
        self._index: dict[str, int] | None = None

    def _position(self, name: str) -> int:
        if self._index is None:
            self._index = {t.name: k for k, t in enumerate(self.inputs)}
        return self._index[name]

    def __getitem__(self, name: str) -> tuple[ByteSlice, ...]:
        size = self.sizes[self._position(name)]
        return (ByteSlice(name, 0, size),) if size else ()

    def spans(self, name: str) -> list[tuple[str, int, int]]:
        """Output `name`'s slices as (input name, begin, end): its own bytes, whole."""
        size = self.sizes[self._position(name)]
        return [(name, 0, size)] if size else []

    def input_bytes(self) -> list[tuple[str, int]]:
        """(input name, bytes copied from it), in run order."""
        return [(t.name, size) for t, size in zip(self.inputs, self.sizes, strict=True)]

    def text(self) -> str:
        """What the plan fingerprint hashes: the source file, every tensor's name and its source bytes."""
        inputs = self.inputs
        return (f"run {inputs[0].file if inputs else ''} " + "\0".join(map(_name, inputs)) + " "
                + ",".join(map(str, map(_begin, inputs))) + " " + ",".join(map(str, self.sizes)))

    def __iter__(self) -> Iterator[str]:
        return map(_name, self.inputs)

    def __len__(self) -> int:
        return len(self.inputs)

    def __repr__(self) -> str:
        return f"CopyRun({len(self.inputs)} tensors of {self.inputs[0].file if self.inputs else '-'!r})"


_name = operator.attrgetter("name")


class PassThroughRun:
    """The op of a run: its tensors, unchanged (what `PassThrough` is for one)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Return the inputs under their own names."""
        return {name: tensors[name] for name in self.names}

    def __repr__(self) -> str:
        return f"PassThroughRun({len(self.names)} tensors)"


def run_group(inputs: tuple[TensorInfo, ...], sizes: tuple[int, ...]) -> Group:
    """The group copying `inputs` (neighbours in one file) unchanged; its outputs are the inputs themselves."""
    return Group(inputs, inputs, PassThroughRun(tuple(map(_name, inputs))), CopyRun(inputs, sizes), None, "copy")


def eligible(catalog: Catalog, mapper: Any, dtype: Any) -> bool:
    """Whether a plan of `catalog` copies its tensors in runs: nothing maps or casts them, they lie raw in place,
    and there are enough of them for per-tensor bookkeeping to matter."""
    return (mapper is None and dtype is None and len(catalog.tensors) >= RUN_MIN_TENSORS
            and getattr(catalog.reader, "raw_in_place", False) is True)


def copy_run_binding(catalog: Catalog) -> Binding:
    """Every tensor of `catalog` copied unchanged, in schedule order: runs of small neighbours, large tensors alone.

    A tensor alone is the same group `passthrough_binding` makes, so what plans for it does not change.
    """
    from .sources import PassThrough

    by_file: dict[str, list[TensorInfo]] = {}
    for info in catalog.tensors.values():
        by_file.setdefault(info.file, []).append(info)
    groups: list[Group] = []
    for file in sorted(by_file):
        infos = by_file[file]
        infos.sort(key=_begin)  # stable: tensors at one offset (empty ones) keep catalog order, as the schedule does
        run: list[TensorInfo] = []
        sizes: list[int] = []
        for info in infos:
            size = info.end - info.begin
            if size >= RUN_TENSOR_BYTES:
                if run:
                    groups.append(run_group(tuple(run), tuple(sizes)))
                    run, sizes = [], []
                name = info.name
                groups.append(Group((info,), (TensorInfo(name, info.dtype, info.shape),), PassThrough(name),
                                    {name: (ByteSlice(name, 0, size),)}, None, "copy"))
                continue
            run.append(info)
            sizes.append(size)
            if len(run) == RUN_TENSORS:
                groups.append(run_group(tuple(run), tuple(sizes)))
                run, sizes = [], []
        if run:
            groups.append(run_group(tuple(run), tuple(sizes)))
    return Binding(groups)


def split_run(group: Group, counts: list[int]) -> list[Group]:
    """`group` (a run) cut into consecutive runs of `counts` tensors."""
    recipe = group.recipe
    assert type(recipe) is CopyRun
    parts = []
    start = 0
    for count in counts:
        parts.append(run_group(recipe.inputs[start : start + count], recipe.sizes[start : start + count]))
        start += count
    return parts
