"""The output layout: which shard file each output tensor goes to, and where in it.

Shards are filled greedily with whole groups in schedule order, so a shard's tensors come from
neighbouring source bytes and a group's outputs stay in one file whenever the group fits in one
shard. A run of independent tensors (`planning.runs`) is placed tensor by
tensor instead, as one group each would be, and cut where it crosses into the next shard. Only the shard size decides the layout, never the number of ranks, so the output bytes are
the same however many processes write them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..catalog import TensorInfo
from ..display import format_bytes
from ..mapper.groups import Problem
from ..output.base import FileLayout, OutputFormat
from .page_align import SourceOffset, choose_residue
from .runs import CopyRun
from .schedule import Step, step_of_run
from .span_runs import SpanRun


@dataclass
class OutputFile:
    """One planned output file: its layout (header bytes, tensor offsets) and who writes it."""

    name: str
    layout: FileLayout
    steps: list[int] = field(default_factory=list)  # indexes of the steps that write to it, in order
    rank: int = 0  # the rank that writes it; of a shared file, the rank of its first step
    ranks: tuple[int, ...] = ()  # a file several ranks write (`planning.ranks.share_ranks`): those ranks, else ()
    kept: bool = False  # already complete at the destination (resume): not rewritten

    @property
    def size(self) -> int:
        """File size in bytes, header included."""
        return self.layout.size

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data (the file without its header)."""
        return self.layout.size - len(self.layout.header)

    @property
    def n_tensors(self) -> int:
        """Number of tensors in the file."""
        return len(self.layout.tensors)


def _oversized(infos: list[TensorInfo], limit: int) -> list[Problem]:
    if len(infos) > 3:  # one line for many, not one per tensor
        biggest = max(infos, key=lambda t: t.nbytes)
        return [Problem(
            "warning",
            f"{len(infos)} tensors are larger than the shard size ({format_bytes(limit)}), the largest {biggest.name!r} "
            f"({format_bytes(biggest.nbytes)}): each gets a shard of its own, as the HF tools do. Raise the shard size "
            "to avoid oversized shards.",
            tensor=biggest.name, kind="layout",
        )]
    return [
        Problem(
            "warning",
            f"Tensor {info.name!r} ({format_bytes(info.nbytes)}) is larger than the shard size ({format_bytes(limit)}): "
            "it gets a shard of its own, as the HF tools do. Raise the shard size to avoid oversized shards.",
            tensor=info.name, kind="layout",
        )
        for info in infos
    ]


def assign_shards(steps: list[Step], limit: int) -> tuple[list[list[TensorInfo]], list[tuple[int, ...]], list[Problem]]:
    """Group output tensors into shards of at most `limit` tensor bytes.

    Returns the shards (lists of metadata TensorInfos), the shard numbers each step writes to, and
    warnings about tensors above the limit.
    """
    shards: list[list[TensorInfo]] = [[]]
    step_shards: list[tuple[int, ...]] = []
    filled = 0
    oversized: list[TensorInfo] = []

    def start_shard() -> None:
        nonlocal filled
        if shards[-1]:
            shards.append([])
        filled = 0

    def place_each(outputs: Iterable[TensorInfo], sizes: Iterable[int]) -> list[int]:
        """Place tensors one by one (a run's, or a group's too large for one shard); the shard of each."""
        nonlocal filled
        used = []
        for info, tensor_size in zip(outputs, sizes, strict=True):
            if tensor_size > limit:
                oversized.append(info)
                start_shard()
                shards[-1].append(info)
                used.append(len(shards) - 1)
                start_shard()
                continue
            if filled + tensor_size > limit:
                start_shard()
            shards[-1].append(info)
            filled += tensor_size
            used.append(len(shards) - 1)
        return used

    current = (0,)  # the shard being filled, as a step's shard numbers (one tuple shared by its steps)
    crossing: dict[int, list[int]] = {}  # runs that reach into several shards: position -> shard per tensor
    for position, step in enumerate(steps):
        outputs = step.group.outputs
        size = step.bytes_out
        recipe, op = step.group.recipe, step.group.op
        sizes = (recipe.out_sizes if type(recipe) is CopyRun or type(recipe) is SpanRun else op.out_sizes) if step.run else None
        if sizes is not None and (filled + size > limit or max(sizes) > limit):
            used = place_each(outputs, sizes)  # a run's tensors are independent: placed as one group each would be
            numbers = tuple(dict.fromkeys(used))
            if len(numbers) > 1:
                crossing[position] = used
            elif numbers != current:
                current = numbers
            step_shards.append(numbers if len(numbers) > 1 else current)
            continue
        if size <= limit:
            if filled + size > limit:
                start_shard()
            shards[-1].extend(outputs)
            filled += size
            if current[0] != len(shards) - 1:
                current = (len(shards) - 1,)
            step_shards.append(current)
            continue
        used = place_each(outputs, [t.nbytes for t in outputs])  # the group cannot fit one shard
        step_shards.append(tuple(dict.fromkeys(used)))
    if not shards[-1]:
        shards.pop()
    if crossing:
        step_shards = split_runs(steps, step_shards, crossing)
    return shards, step_shards, _oversized(oversized, limit)


def split_runs(steps: list[Step], step_shards: list[tuple[int, ...]], crossing: dict[int, list[int]]) -> list[tuple[int, ...]]:
    """Cut each run (of copies or casts) that reaches into several shards into one step per shard (`crossing`: step
    position -> shard of each of its tensors), in place, renumbering the steps; returns the new steps' shard numbers.

    A step writes the files of one rank (ranks own whole files and a step joins the files it writes), so a run
    must not join two files that one tensor per group would have left apart."""
    new_steps: list[Step] = []
    new_shards: list[tuple[int, ...]] = []
    for position, (step, numbers) in enumerate(zip(steps, step_shards, strict=True)):
        used = crossing.get(position)
        if used is None:
            new_steps.append(step)
            new_shards.append(numbers)
            continue
        recipe = step.group.recipe
        run = recipe if type(recipe) is CopyRun or type(recipe) is SpanRun else step.group.op
        start = 0
        for k, members in itertools.groupby(used):
            end = start + len(list(members))
            new_steps.append(step_of_run(0, run.part(start, end, step.group.label)))
            new_shards.append((k,))
            start = end
    for index, step in enumerate(new_steps):
        step.index = index
    steps[:] = new_steps
    return new_shards


def assign_by_format(steps: list[Step], output: OutputFormat) -> tuple[list[list[TensorInfo]], list[tuple[int, ...]], list[Problem]]:
    """Files chosen by the output format per tensor (e.g. Meta's model-parallel ranks), in schedule order."""
    chosen = {t.name: output.shard_of(t.name) or 0 for s in steps for t in s.group.outputs}
    shards: list[list[TensorInfo]] = [[] for _ in range(max(chosen.values(), default=0) + 1)]
    step_shards = []
    for step in steps:
        for info in step.group.outputs:
            shards[chosen[info.name]].append(info)
        step_shards.append(tuple(dict.fromkeys(chosen[t.name] for t in step.group.outputs)))
    return shards, step_shards, []


def layout_outputs(
    steps: list[Step], limit: int, output: OutputFormat, metadata: Callable[[Iterable[str]], dict[str, str]] | None = None,
    source_offset: SourceOffset | None = None,
) -> tuple[list[OutputFile], list[Problem]]:
    """Name and lay out the shards; sets `step.files` to file names.

    `output` names and lays out each file (see `workbench.output`); `metadata` maps the source files feeding
    a shard to its header `__metadata__` where the format keeps one (default `{"format": "pt"}`). With
    `source_offset` (where a source tensor's raw bytes start) a format that pads its header places each
    file's data start so its kernel copies are page-congruent (`planning.page_align`).
    """
    decides = type(output).shard_of is not OutputFormat.shard_of  # else every answer is None: no call per tensor
    if decides and any(output.shard_of(t.name) is not None for s in steps for t in s.group.outputs):
        shards, step_shards, warnings = assign_by_format(steps, output)
    else:
        shards, step_shards, warnings = assign_shards(steps, limit)
    names = [output.file_name(k, len(shards)) for k in range(len(shards))]
    metas: list[dict[str, str] | None] = [None] * len(shards)
    if metadata is not None and output.keeps_header_metadata:
        from .header_metadata import shard_sources

        feeds = shard_sources(zip((s.group.inputs for s in steps), step_shards, strict=True), len(shards))
        metas = [metadata(f) for f in feeds]
    step_lists: list[list[Step]] = [[] for _ in shards]
    file_names: dict[tuple[int, ...], tuple[str, ...]] = {}  # shard numbers -> names, built once per distinct tuple
    for step, numbers in zip(steps, step_shards, strict=True):
        named = file_names.get(numbers)
        if named is None:
            named = file_names[numbers] = tuple(names[k] for k in numbers)
        step.files = named
        for k in numbers:
            step_lists[k].append(step)
    align = source_offset is not None and output.pads_header
    files = []
    for name, tensors, meta, file_steps in zip(names, shards, metas, step_lists, strict=True):
        if align:
            def chooser(offsets: dict[str, int], file_steps: list[Step] = file_steps) -> int | None:
                return choose_residue(file_steps, offsets, source_offset)  # type: ignore[arg-type]

            layout = output.layout_file(name, tensors, meta, data_residue=chooser)
        else:
            layout = output.layout_file(name, tensors, meta)
        files.append(OutputFile(name, layout, [step.index for step in file_steps]))
    return files, warnings
