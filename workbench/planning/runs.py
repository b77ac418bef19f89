"""Runs: neighbouring small tensors of one file planned and run as one group, and small casts batched.

Copy runs. Copying a checkpoint of 100k tiny tensors would otherwise make 100k groups, steps, fingerprint lines and
engine calls, and that bookkeeping, not the bytes, was most of its planning time. When a safetensors output is made
from at least `RUN_MIN_TENSORS` tensors that lie raw in their files (safetensors), the planner puts up to
`RUN_TENSORS` small neighbours of one file (schedule order: file, then offset) that are copied whole, unchanged
or renamed, in one group: with no mapper and no dtype the binding is made in runs directly
(`copy_run_binding`); otherwise the schedule joins the mapper's one-tensor copies (`coalesce_copies`). The
layout still places the tensors one by one, exactly where one group per tensor would have put them, and cuts
a run where it crosses into the next output file (`planning.sharding.split_runs`), so the output bytes and the
rank assignment are the same.

Smaller checkpoints keep one group per tensor, which is what the plan's tables and graphs show best;
`wb.bind` and everything that previews single tensors always see the mapper's own groups.

Cast runs. With `dtype=` and no mapper, a checkpoint of 100k tiny float32 tensors is 100k casts. When a safetensors
output is made from enough tensors that lie raw in their files (`many_raw`), the planner puts up to `RUN_TENSORS`
small neighbours of one file (schedule order) that numpy converts from one dtype to the policy's in one group
(`CastRun`). The layout places them one by one and cuts a run where it crosses into the next output file, as for
copy runs; after the layout, `run_batches` marks which neighbours the engine converts at once, by the batch rules
below. Batching never changes the bytes, so the files are the ones one group per tensor gives. Batches end at a
run's edges, where batches across steps of one tensor each do not, so the peak memory can differ from a plan of
one step per tensor, within the same bound (`BATCH_BYTES`, or one tensor's chunked cast); the plan predicts the
run's own peak exactly.

Cast batches: small casts that run as one, adjacent in the source and in the output, read, converted and written
at once. A checkpoint of many tiny tensors cast one by one costs a read, a conversion call and a write per tensor
(~20 µs each: 2 s for 100k tensors). When consecutive cast steps of one rank read adjacent bytes of one source
file and fill adjacent slots of one output file, the engine reads the whole run with one read, converts it with
one call and writes it with one write (`engine.cast_batch`); a cast run is batched inside itself by the same rules
(`run_batches`). Only float32 -> bfloat16 casts are batched: numpy converts them element by element, so converting
the run equals converting each tensor, bit for bit. A run holding a NaN or an overflowing value is converted
tensor by tensor instead (torch encodes the NaN, overflow is counted per tensor), which is what the engine does
without batches. The plan counts a batch honestly: every step of it holds the batch's input and output bytes
(`Step.held_bytes`), which is what the engine's cast arena holds.

A run's op says which step kind it is (`run_kind`): the schedule asks for that attribute, so it never imports
this module (runs -> schedule, never back), and its steps are marked `Step.run` for the engine.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..catalog import Catalog, TensorInfo
from ..dtypes import numpy_castable
from ..mapper.groups import Binding, ByteSlice, Group
from ..mapper.recipes import LazyRecipe
from ..overflow import cast
from .schedule import CAST, COPY, Step, cast_chunk
from .sources import PolicyGroups, copy_group
from .span_runs import run_label, span_pieces, span_run_group, whole_pieces

if TYPE_CHECKING:
    from .sharding import OutputFile

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

    run_kind = COPY  # the schedule's kind of a copy run's step

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
    """`groups` (in schedule order, inputs raw in place) with each stretch of neighbouring small copies from one file
    made one run: whole copies with one label a copy run (`CopyRun`), a stretch that also holds concatenations of
    byte ranges (a fused q/k/v: `planning.span_runs`) a span run; what a mapper keeps, renames or fuses one
    group at a time is then planned in runs too."""

    def whole_key(item: tuple[Group, int | None, Any]) -> str:
        return item[0].label

    def key(item: tuple[Group, int | None, Any]) -> str | None:
        group, size, _ = item
        return group.inputs[0].file if size is not None and size < RUN_TENSOR_BYTES else None

    items: list[tuple[Group, int | None, Any]] = []  # (group, output bytes, its byte ranges or None for a whole copy)
    for group in groups:
        size = whole_copy_size(group)
        if size is not None:
            items.append((group, size, None))
            continue
        pieces = span_pieces(group)
        items.append((group, None if pieces is None else group.outputs[0].nbytes, pieces))
    result: list[Group] = []
    for part in stretches(items, key):
        if len(part) == 1:
            result.append(part[0][0])
            continue
        if any(pieces is not None for _, _, pieces in part):
            members = tuple(group for group, _, _ in part)
            ranges = tuple(whole_pieces(group.inputs[0], size) if pieces is None else pieces  # type: ignore[arg-type]
                           for group, size, pieces in part)
            result.append(span_run_group(members, ranges, run_label(members)))
            continue
        for same in stretches(part, whole_key):  # whole copies: a copy run per label, as one label's stretch
            if len(same) == 1:
                result.append(same[0][0])
                continue
            members = [group for group, _, _ in same]
            result.append(run_group(tuple(g.inputs[0] for g in members), tuple(size for _, size, _ in same),  # type: ignore[misc]
                                    tuple(g.outputs[0] for g in members), members[0].label))
    return result


# Cast runs

class CastRun:
    """The op of a cast run: each input converted to `dtype` under its own name.

    `inputs` lie in one source file in file order and share one dtype; `outputs` are the same tensors in `dtype`;
    `in_sizes` / `out_sizes` are their byte sizes.
    """

    run_kind = CAST  # the schedule's kind of a cast run's step

    def __init__(self, inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...], dtype: str,
                 in_sizes: tuple[int, ...], out_sizes: tuple[int, ...]) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.dtype = dtype
        self.in_sizes = in_sizes
        self.out_sizes = out_sizes

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The inputs converted to `dtype`."""
        return {t.name: cast(tensors[t.name], self.dtype, t.name) for t in self.inputs}

    def text(self) -> str:
        """What the plan fingerprint hashes: the source file and dtype, every tensor's name and source bytes."""
        inputs = self.inputs
        return (f"casts {inputs[0].file} {inputs[0].dtype}->{self.dtype} " + "\0".join(map(_name, inputs)) + " "
                + ",".join(map(str, map(_begin, inputs))) + " " + ",".join(map(str, self.in_sizes)))

    def part(self, start: int, end: int, label: str) -> Group:
        """The group of tensors [start, end) of this run, labelled `label` (a run cut where it crosses into the
        next output file)."""
        return cast_run_group(self.inputs[start:end], self.outputs[start:end], self.dtype, self.in_sizes[start:end],
                              self.out_sizes[start:end], label)

    def __repr__(self) -> str:
        return f"CastRun({len(self.inputs)} tensors -> {self.dtype})"


def cast_run_group(inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...], dtype: str,
                   in_sizes: tuple[int, ...], out_sizes: tuple[int, ...], label: str) -> Group:
    """The group converting `inputs` (neighbours in one file, one dtype) to `dtype`."""
    return Group(inputs, outputs, CastRun(inputs, outputs, dtype, in_sizes, out_sizes), None, dtype, label)


def cast_run_binding(catalog: Catalog, code: str) -> Binding:
    """`passthrough_binding(catalog, code)` in schedule order, with the small casts numpy does in runs.

    The same decisions per tensor (`sources.PolicyGroups`): a float the policy casts becomes a chunked cast,
    anything else a copy (which the schedule joins into copy runs), floats the policy cannot cast are kept with a
    warning.
    """
    policy = PolicyGroups(code)

    def key(info: TensorInfo) -> str | None:  # casts numpy does, small enough for a run: joined by source dtype
        dtype = info.dtype
        runs = policy.casts(dtype) and numpy_castable(dtype, code) and info.end - info.begin < RUN_TENSOR_BYTES
        return dtype if runs else None

    groups: list[Group] = []
    for infos in schedule_order(catalog):
        for part in stretches(infos, key):
            if len(part) == 1:
                groups.append(policy.group(part[0]))
                continue
            outputs = tuple(TensorInfo(t.name, code, t.shape) for t in part)
            groups.append(cast_run_group(tuple(part), outputs, code, tuple(t.end - t.begin for t in part),
                                         tuple(t.nbytes for t in outputs), policy.label))
    return policy.binding(groups)


def run_batches(op: CastRun, out_begin: Mapping[str, int], chunk_bytes: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The tensors of a cast run the engine converts at once, as [start, end) positions covering the run, and the
    bytes the step holds at its peak: neighbours adjacent in the source and in the output file batched by the
    rules of `batch_casts` (`out_begin`: each output's offset in its file)."""
    spans: list[tuple[int, int]] = []
    peak = 0
    start: int | None = None  # the open batch's first position
    held = src_bytes = 0
    src_end = out_end = -1
    src_dtype = op.inputs[0].dtype if op.inputs else ""

    def close(end: int) -> None:  # the open batch ends before `end`; one tensor alone is cast chunk by chunk
        nonlocal peak
        spans.append((start, end))  # type: ignore[arg-type]
        peak = max(peak, held if end - start > 1 else cast_chunk(op.inputs[start].numel, src_dtype, op.dtype, chunk_bytes)[1])  # type: ignore[operator,index]

    for k, (src, out, n_in, n_out) in enumerate(zip(op.inputs, op.outputs, op.in_sizes, op.out_sizes, strict=True)):
        begin = out_begin[out.name]
        small = batchable(n_out)
        if small and start is not None and src.begin == src_end and begin == out_end and joins(held, src_bytes, n_in, n_out, chunk_bytes):
            held += n_in + n_out
            src_bytes += n_in
        else:
            if start is not None:
                close(k)
            start, held, src_bytes = k, n_in + n_out, n_in
            if not (small and n_in <= chunk_bytes):  # converted alone, chunk by chunk
                close(k + 1)
                start = None
        src_end, out_end = src.begin + n_in, begin + n_out
    if start is not None:
        close(len(op.inputs))
    return tuple(spans), peak


# Cast batches

BATCH_BYTES = 256 << 10  # input + output bytes of one batch at most: one numpy block (`engine.bf16.BLOCK`), written at once


def batchable(n_out: int) -> bool:
    """Whether a float32 -> bfloat16 cast of `n_out` output bytes may join a batch (3x its output bytes are held)."""
    return n_out > 0 and n_out * 3 <= BATCH_BYTES


def joins(held: int, src_bytes: int, n_in: int, n_out: int, chunk_bytes: int) -> bool:
    """Whether a batch holding `held` bytes, `src_bytes` of them read, can take one more cast of `n_in` -> `n_out`."""
    return held + n_in + n_out <= BATCH_BYTES and src_bytes + n_in <= chunk_bytes


def batch_casts(steps: list[Step], files: list[OutputFile], reader: object | None, chunk_bytes: int) -> None:
    """Mark runs of small adjacent casts in `steps` (schedule order, ranks and files assigned) as batches."""
    locate = getattr(reader, "locate", None)
    if locate is None or not any(s.kind == CAST for s in steps):
        return
    out_begin = {t.name: t.begin for f in files for t in f.layout.tensors}
    for step in steps:
        if step.run and step.kind == CAST:  # batched inside the run (`run_batches`)
            step.spans, step.held_bytes = run_batches(step.group.op, out_begin, chunk_bytes)
    ranks = {s.rank for s in steps}
    for rank in sorted(ranks):
        _batch_rank(steps if len(ranks) == 1 else [s for s in steps if s.rank == rank], locate, out_begin, chunk_bytes)


def _batch_rank(steps: list[Step], locate, out_begin: dict[str, int], chunk_bytes: int) -> None:  # noqa: ANN001
    """Mark the batches among one rank's steps (once per tensor of a big checkpoint: spelled out with locals)."""
    run: list[Step] = []  # the batch being extended
    file = path = None
    src_end = out_end = held = src_bytes = 0
    castable: dict[tuple[str, str], bool] = {}
    for step in steps:
        begin = None
        if step.kind == CAST and len(step.files) == 1 and step.spans is None:
            group = step.group
            src, out = group.inputs[0], group.outputs[0]
            pair = (src.dtype, out.dtype)
            ok = castable.get(pair)
            if ok is None:
                ok = castable[pair] = numpy_castable(*pair)
            n_out = step.bytes_out
            if ok and batchable(n_out):
                where = locate(src)
                if where is not None:
                    begin = out_begin.get(out.name)
        if begin is None:
            _close(run, held)
            run = []
            continue
        step_path, src_begin, step_end = where
        n_in = step_end - src_begin
        if (run and src_begin == src_end and begin == out_end and step.files[0] == file and (step_path is path or step_path == path)
                and joins(held, src_bytes, n_in, n_out, chunk_bytes)):
            run.append(step)
            held += n_in + n_out
            src_bytes += n_in
        else:
            _close(run, held)
            run = [step] if n_in <= chunk_bytes else []
            file, path, held, src_bytes = step.files[0], step_path, n_in + n_out, n_in
        src_end, out_end = step_end, begin + n_out
    _close(run, held)


def _close(run: list[Step], held: int) -> None:
    """Mark a run's steps as one batch (holding `held` bytes) when it has more than one step."""
    if len(run) < 2:
        return
    for step in run:
        step.held_bytes = held
        step.batch = ()
    run[0].batch = tuple(s.group for s in run)
