"""The schedule: one step per dependency group, in the order the engine runs them.

Steps are ordered by where their first byte lies in the source (file, then offset), so reads sweep
each file forward and a group whose inputs span files runs as soon as its earliest input is reached
instead of holding anything back. Each step knows what it reads from which file and how many
tensor bytes the engine holds while running it; the engine uses the same rules, so the predicted
memory is the measured one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..catalog import TensorInfo
from ..dtypes import dtype_bits, nbytes_of
from ..mapped_inputs import maps_inputs
from ..mapper.groups import ByteSlice, Group
from ..mapper.recipes import LazyRecipe

COPY, CAST, COMPUTE, ROWS, PIECES = "copy", "cast", "compute", "rows", "pieces"


@dataclass(slots=True)
class Step:
    """One group in schedule order, with its cost; `files` and `rank` are filled in by the layout."""

    index: int
    group: Group
    kind: str  # COPY (bytes moved, no tensors), CAST (chunked elementwise cast), COMPUTE (tensors in, op, out),
    # ROWS (a row job its op offers, run a few rows at a time with numpy: mapper.row_jobs), PIECES (one output stacked
    # from computed pieces, each computed, written at its byte range and freed: mapper.pieces)
    held_bytes: int  # tensor bytes the engine holds at the peak of this step
    reads: dict[str, int]  # source file (relative) -> bytes read from it
    bytes_out: int  # tensor bytes of the group's outputs
    files: tuple[str, ...] = ()  # output files this step writes
    rank: int = 0
    # Small casts run together (`planning.runs.batch_casts`): on a batch's first step the groups of all its steps,
    # on the others () (their work is done by the first); None for a step that runs on its own.
    batch: tuple[Group, ...] | None = None
    # A cast run's tensors as the engine converts them, [start, end) positions, batches and single casts
    # (`planning.runs.run_batches`); None for any other step (and for a run not yet laid out: each alone).
    spans: tuple[tuple[int, int], ...] | None = None
    # A run (`planning.runs`): neighbours of one file copied whole or cast as one group, its tensors independent.
    run: bool = False
    # A part (`planning.parts`): bytes [begin, end) of the one output, when ranks share the output (None: all of it).
    part: tuple[int, int] | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes the step reads from the source, all files together."""
        return sum(self.reads.values())


def group_scratch_bytes(group: Group, mapped: bool = False) -> int:
    """Work bytes (beyond inputs and outputs) of the operations of a bound group that declare them
    (`scratch_bytes(inputs)`: merges), at most the largest one's (the steps of a group run one after another); 0 for
    every other group. `mapped`: the engine maps the group's inputs (`mapped_inputs.maps_inputs`), so an op that gives
    them back counts its peak without them. Asked by duck typing, so a plan with no merge imports no merge module."""
    op = group.op
    own = getattr(op, "scratch_bytes", None)
    if own is not None:
        return int(own(group.inputs, mapped=True) if mapped else own(group.inputs))
    if not hasattr(op, "mappers"):
        return 0
    by_name = {info.name: info for info in group.inputs}
    most = 0
    for leaf in op.leaves():
        leaf_scratch = getattr(leaf, "scratch_bytes", None)
        if leaf_scratch is not None:
            most = max(most, int(leaf_scratch([by_name[n] for n in leaf.inputs if n in by_name] or list(group.inputs))))
    return most


@functools.lru_cache(maxsize=4096)  # asked per cast step by the planner and the engine; few distinct answers
def cast_chunk(numel: int, src_dtype: str, dst_dtype: str, chunk_bytes: int) -> tuple[int, int]:
    """Elements per chunk of a chunked cast and the bytes held for one chunk (input + output buffers)."""
    bits = dtype_bits(src_dtype)
    per = max(1, chunk_bytes * 8 // bits)
    while (per * bits) % 8 or (per * dtype_bits(dst_dtype)) % 8:  # sub-byte dtypes: whole bytes per chunk
        per += 1
    per = min(per, numel)
    return per, nbytes_of(src_dtype, per) + nbytes_of(dst_dtype, per)


def step_kind(group: Group, access: SourceAccess | None = None) -> str:
    """How the engine runs a group: byte copy, chunked cast, the row job its op offers (`mapper.row_jobs`; inputs
    raw on disk), its one output stacked from computed pieces (`mapper.pieces`), or tensor compute."""
    if group.recipe is not None:
        return COPY
    if group.chunk_cast is not None and (len(group.inputs) == 1 and len(group.outputs) == 1 or run_kind(group) == CAST):
        return CAST
    if access is None:
        return COMPUTE
    from ..mapper.row_jobs import row_job  # here: byte copies and casts never import it

    if row_job(group) is not None and all(access.located(t) for t in group.inputs):
        return ROWS
    from ..mapper.pieces import output_pieces

    pieces = output_pieces(group)
    if pieces is not None and pieces.row_blocks and not all(access.located(t) for t in group.inputs):
        pieces = None  # rows of a source are read as a byte range: of a source raw on disk only
    _last_pieces[:] = [group, pieces]  # step_cost asks next for the same group
    return COMPUTE if pieces is None else PIECES


_last_pieces: list = [None, None]  # (group, its pieces) of the last step_kind, so step_cost does not find them again


class SourceAccess:
    """How the source's bytes are reached: raw ranges (kernel-copyable) or whole reads through the reader.

    A reader may define `sources_of(info) -> [(file, bytes), ...]` when one tensor is assembled from
    several files (e.g. flat shards of several ranks); otherwise a tensor is read from `info.file`.
    """

    def __init__(self, reader: object | None) -> None:
        self._locate = getattr(reader, "locate", None)
        self._sources_of = getattr(reader, "sources_of", None)
        # True when `located` answers True for every tensor, so per-tensor loops need not ask
        # (a reader without `locate`, or one whose tensors all lie raw in their files: safetensors).
        self.all_located = self._locate is None or getattr(reader, "raw_in_place", False) is True

    def located(self, info: TensorInfo) -> bool:
        """True when the tensor's bytes lie raw and contiguous in one file."""
        return self.all_located or self._locate(info) is not None  # type: ignore[misc]

    def add_whole_read(self, reads: dict[str, int], info: TensorInfo) -> None:
        """Count reading the whole tensor into `reads` (file -> bytes)."""
        if self._sources_of is not None and not self.located(info):
            for rel, n in self._sources_of(info):
                reads[rel] = reads.get(rel, 0) + n
        else:
            reads[info.file] = reads.get(info.file, 0) + info.nbytes


def step_cost(group: Group, kind: str, bytes_out: int, access: SourceAccess, chunk_bytes: int) -> tuple[int, dict[str, int]]:
    """(tensor bytes held at the peak, bytes read per source file) of running `group` as `kind`."""
    reads: dict[str, int] = {}
    if kind == COPY:
        inputs = group.inputs
        if len(inputs) == 1 and access.located(inputs[0]):
            simple = _located_copy_reads(inputs[0], group.recipe)
            if simple is not None:
                return 0, simple
        by_name = {inputs[0].name: inputs[0]} if len(inputs) == 1 else {t.name: t for t in inputs}
        held = 0
        whole: set[str] = set()
        for slices in group.recipe.values():
            for piece in slices:
                info = by_name[piece.source]
                if access.located(info):
                    reads[info.file] = reads.get(info.file, 0) + piece.end - piece.begin
                elif piece.source not in whole:  # read once, whole, and held for the step
                    whole.add(piece.source)
                    access.add_whole_read(reads, info)
                    held += info.nbytes
        return held, reads
    bytes_in = 0
    for info in group.inputs:
        bytes_in += info.nbytes
        access.add_whole_read(reads, info)
    if kind == ROWS:
        from ..mapper.row_jobs import row_job

        job = row_job(group)
        assert job is not None
        return job.held_bytes(chunk_bytes), reads
    if kind == PIECES:
        from ..mapper.pieces import output_pieces

        pieces = _last_pieces[1] if _last_pieces[0] is group else output_pieces(group)
        assert pieces is not None
        return pieces.held_bytes, reads
    if kind == CAST:
        src, out = group.inputs[0], group.outputs[0]
        per, held = cast_chunk(src.numel, src.dtype, out.dtype, chunk_bytes)
        if not access.located(src):  # read whole, converted chunk by chunk
            held = bytes_in + nbytes_of(out.dtype, per)
        return held, reads
    return bytes_in + bytes_out + group_scratch_bytes(group, mapped=maps_inputs(group.op, group.inputs, access.located)), reads


def _located_copy_reads(info: TensorInfo, recipe: Mapping[str, tuple[ByteSlice, ...]]) -> dict[str, int] | None:
    """Bytes read by a copy whose only input lies raw on disk (the common case, 100k times on big checkpoints);
    None when the recipe names another input (the general path reports that)."""
    total = 0
    pieces = 0
    name = info.name
    for slices in recipe.values():
        for piece in slices:
            if piece.source != name:
                return None
            total += piece.end - piece.begin
            pieces += 1
    return {info.file: total} if pieces else {}


def run_kind(group: Group) -> str | None:
    """COPY or CAST for the group of a run (`planning.runs`: its op names the kind), None for any other group."""
    return getattr(group.op, "run_kind", None)


def step_of_run(index: int, group: Group) -> Step:
    """The step of a run (`planning.runs`). A run of empty tensors reads nothing; what a cast run holds is set by
    `planning.runs.batch_casts` once the layout says which of its tensors are converted together (until then: its
    largest tensor, in and out)."""
    op = group.op
    if op.run_kind == COPY:
        total = group.recipe.total
        return Step(index, group, COPY, 0, {group.inputs[0].file: total} if total else {}, total, run=True)
    return Step(index, group, CAST, max(op.in_sizes) + max(op.out_sizes), {group.inputs[0].file: sum(op.in_sizes)},
                sum(op.out_sizes), run=True)


def build_steps(groups: list[Group], access: SourceAccess, chunk_bytes: int, *,
                coalesce: Callable[[list[Group]], list[Group]] | None = None) -> list[Step]:
    """Steps for the groups that produce something, in schedule order (source file, then offset). `coalesce` (inputs
    raw in place: `planning.runs.coalesce_copies`) joins neighbouring small whole copies into one step each stretch."""
    files = sorted({t.file for g in groups for t in g.inputs})
    file_order = {f: i for i, f in enumerate(files)}
    never = len(files)
    ordered = []  # (file rank, offset, group index, group): sorts by position, then by binding order
    for index, group in enumerate(groups):
        if not group.outputs:
            continue
        inputs = group.inputs
        if len(inputs) == 1 or getattr(group.op, "run_kind", None) is not None:  # a run's first input is its first byte
            first = inputs[0]
            ordered.append((file_order[first.file], first.begin, index, group))
        else:
            where, begin = min(((file_order[t.file], t.begin) for t in inputs), default=(never, 0))
            ordered.append((where, begin, index, group))
    ordered.sort()  # indexes are unique, so groups themselves are never compared
    in_order = [group for *_, group in ordered]
    if coalesce is not None:
        in_order = coalesce(in_order)
    steps = []
    located = access.located
    everywhere = access.all_located  # no need to ask per tensor
    for index, group in enumerate(in_order):
        outputs = group.outputs
        recipe = group.recipe
        inputs = group.inputs
        if getattr(group.op, "run_kind", None) is not None:  # neighbours of one file copied whole or cast
            steps.append(step_of_run(index, group))
            continue
        if recipe is not None and len(recipe) == 1 and len(inputs) == 1:  # step_cost of a one-slice copy, inlined
            (pieces,) = recipe.values()
            first = inputs[0]
            if len(pieces) == 1 and pieces[0].source == first.name and (everywhere or located(first)):
                # the one output is that slice's bytes (a recipe's output is the concatenation of its slices)
                piece = pieces[0]
                size = piece.end - piece.begin
                steps.append(Step(index, group, COPY, 0, {first.file: size}, size))
                continue
        bytes_out = outputs[0].nbytes if len(outputs) == 1 else sum(t.nbytes for t in outputs)
        if recipe is None and group.chunk_cast is not None and len(inputs) == 1 and len(outputs) == 1:
            first = inputs[0]  # step_cost of a chunked cast of a located input, inlined
            if everywhere or located(first):
                held = cast_chunk(first.numel, first.dtype, outputs[0].dtype, chunk_bytes)[1]
                steps.append(Step(index, group, CAST, held, {first.file: first.nbytes}, bytes_out))
                continue
        if type(recipe) is LazyRecipe and len(inputs) > 1 and (everywhere or all(located(t) for t in inputs)):
            # step_cost of a copy from several located inputs (a fused q/k/v): bytes per input from the shared recipe
            file_of = {t.name: t.file for t in inputs}
            reads: dict[str, int] = {}
            for source, n in recipe.input_bytes():
                file = file_of[source]
                reads[file] = reads.get(file, 0) + n
            steps.append(Step(index, group, COPY, 0, reads, bytes_out))
            continue
        kind = step_kind(group, access)
        held, reads = step_cost(group, kind, bytes_out, access, chunk_bytes)
        steps.append(Step(index, group, kind, held, reads, bytes_out))
    return steps
