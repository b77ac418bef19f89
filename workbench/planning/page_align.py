"""Page-congruent output files: where each safetensors file's data starts, so kernel copies move whole pages.

`copy_file_range` between two files on ext4 (a splice through the page cache) fills the destination page
by page. When the source and destination offsets share their position within a page, every source page
lands on exactly one destination page; otherwise each one straddles two, and the same copy costs about
35 % more system time plus a slower fsync (1 GB on this project's VM: 0.31-0.36 s of system time
congruent, 0.47-0.65 s not, most of 20 runs). `cp` always copies congruently (offset 0 to offset 0).

A safetensors file's data starts right after its header, which the format lets end in any number of
spaces. So each output file gets one free choice: the data start's offset within a page. This module
picks, per file, the offset that makes the most kernel-copied bytes congruent with their source. Tensors
inside a file are contiguous (readers reject gaps), so runs from other source files stay where they fall.

Files whose best choice would make less than `ALIGN_MIN_BYTES` congruent keep the reference writer's
minimal header, byte-identical to `safetensors.save_file`. The page is fixed at 4096 bytes (not the
running machine's), so the output bytes are the same everywhere, for any number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ..catalog import TensorInfo
from ..output.safetensors import PAGE
from .runs import CopyRun
from .schedule import COPY, Step
from .span_runs import SpanRun

ALIGN_MIN_BYTES = 1 << 20  # below this, copies cost microseconds: keep the minimal (reference) header

# Where a source tensor's raw bytes start in its file (the reader's `locate`), or None when not raw on disk.
SourceOffset = Callable[[TensorInfo], "int | None"]


def congruent_bytes(steps: Iterable[Step], placed: Mapping[str, int], source_offset: SourceOffset) -> dict[int, int]:
    """For each data-start offset within a page (multiples of 8), the bytes of one file's kernel copies it
    makes congruent with their source (`placed`: the file's tensors, name -> offset from its data start);
    in the order the residues first occur in `steps` (deterministic)."""
    weights: dict[int, int] = {}
    raw = source_offset is raw_begin  # spelled out below: no call per tensor
    for step in steps:
        group = step.group
        recipe = group.recipe
        if step.kind != COPY or recipe is None:
            continue
        if raw and type(recipe) is CopyRun:  # neighbours copied whole (`planning.runs`): one residue each
            for source, out, length in zip(group.inputs, recipe.outputs, recipe.sizes, strict=True):
                at = placed.get(out.name)
                if at is not None and length > 0:
                    residue = (source.begin - at) % PAGE
                    if residue % 8 == 0:
                        weights[residue] = weights.get(residue, 0) + length
            continue
        if raw and type(recipe) is SpanRun:  # neighbours copied in byte ranges (`planning.span_runs`)
            for out, pieces in zip(recipe.outputs, recipe.pieces(), strict=True):
                at = placed.get(out.name)
                if at is None:
                    continue
                for source, piece_begin, piece_end in pieces:
                    length = piece_end - piece_begin
                    if length > 0:
                        residue = (source.begin + piece_begin - at) % PAGE
                        if residue % 8 == 0:
                            weights[residue] = weights.get(residue, 0) + length
                    at += length
            continue
        if len(recipe) == 1 and len(group.inputs) == 1:  # one output, one input (once per tensor): spelled out
            ((out_name, pieces),) = recipe.items()
            source = group.inputs[0]
            if len(pieces) == 1 and pieces[0].source == source.name:
                at = placed.get(out_name)
                piece = pieces[0]
                length = piece.end - piece.begin
                if at is not None and length > 0:
                    begin = source.begin if raw else source_offset(source)
                    if begin is not None:
                        residue = (begin + piece.begin - at) % PAGE
                        if residue % 8 == 0:
                            weights[residue] = weights.get(residue, 0) + length
                continue
        if raw:
            inputs = None
            offsets: dict[str, int | None] = {t.name: t.begin for t in group.inputs}
        else:
            inputs = {t.name: t for t in group.inputs}
            offsets = {}
        spans = getattr(recipe, "spans", None)  # a shared recipe (mapper.recipes.LazyRecipe): no ByteSlices made
        for out_name in recipe:
            at = placed.get(out_name)  # where the tensor starts, relative to the data start
            if at is None:  # written to another file
                continue
            for name, piece_begin, piece_end in spans(out_name) if spans is not None else [(p.source, p.begin, p.end) for p in recipe[out_name]]:
                length = piece_end - piece_begin
                if length > 0:
                    if name not in offsets:
                        offsets[name] = source_offset(inputs[name])  # type: ignore[index]
                    begin = offsets[name]
                    if begin is not None:
                        residue = (begin + piece_begin - at) % PAGE
                        if residue % 8 == 0:  # reachable: a data start must stay 8-byte aligned
                            weights[residue] = weights.get(residue, 0) + length
                at += length
    return weights


def best_residue(weights: Mapping[int, int]) -> int | None:
    """The residue making the most bytes congruent (the first one on a tie), or None below `ALIGN_MIN_BYTES`."""
    if not weights:
        return None
    residue = max(weights, key=lambda r: weights[r])  # max keeps the first of equals: insertion order decides
    return residue if weights[residue] >= ALIGN_MIN_BYTES else None


def choose_residue(steps: Iterable[Step], placed: Mapping[str, int], source_offset: SourceOffset) -> int | None:
    """The data-start offset within a page for one file (`placed`: its tensors' offsets from its data start),
    or None to keep the minimal header."""
    return best_residue(congruent_bytes(steps, placed, source_offset))


def raw_begin(info: TensorInfo) -> int:
    """`source_offset` of a reader whose tensors all lie raw in place: a tensor's bytes start at its `begin`."""
    return info.begin


def reader_offsets(reader: object | None) -> SourceOffset | None:
    """`source_offset` for a catalog's reader: the start of a tensor's raw bytes in its file — `raw_begin` for a
    reader whose tensors lie raw in place (`raw_in_place`: spelled out by `congruent_bytes`), the reader's
    `raw_offset` where it has one (remote readers: the bytes are not local, the layout is the same), else
    via `locate`. The choice depends on the source's layout only, never on where the files are."""
    if getattr(reader, "raw_in_place", False) is True:  # every tensor lies raw at its own `begin` (safetensors)
        return raw_begin
    raw_offset = getattr(reader, "raw_offset", None)
    if raw_offset is not None:
        return raw_offset
    locate = getattr(reader, "locate", None)
    if locate is None:
        return None

    def offset(info: TensorInfo) -> int | None:
        where = locate(info)
        return None if where is None else where[1]

    return offset
