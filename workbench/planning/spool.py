"""How much local disk a remote destination's spool needs: the bound `output/remote/spool.SpoolGate` keeps.

The spool holds *units*: a whole output file, or, for a file the destination uploads in parts as they are written
(`RemoteDestination.stream_part_size`: S3 multipart parts of a safetensors file that no other rank writes), one
part of it. A unit is open from the first step writing into it to the last; then it waits for its upload and
leaves the spool (a file is deleted, a part's blocks are freed: a hole punched in the sparse spool file). The gate
lets finished units wait only while everything fits in `spool_size`, and never waits on a unit still being
written. So a rank holds at most `max(spool_size, the most bytes of units open at once)`, never more than the
files it writes: with parts, a spool smaller than one shard suffices.

Freeing a part's blocks needs a file system that can punch holes (ext4, xfs, btrfs, tmpfs). On one that cannot
(vfat, ramfs, some network mounts; `spool_route` asks the spool folder once per plan) the files are spooled whole:
each is written, then uploaded and deleted, so a unit is a whole file and the bound above counts whole files (at
least the largest file a rank writes). That route needs no file-system feature at all and is the one every
destination already takes for files it uploads whole; spooling each part in its own file would need every engine
write path (pwrite, copy_file_range, a format's header) to split at part boundaries. `--shard-size` bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import Plan
    from .schedule import Step


@dataclass
class StreamedFile:
    """One output file uploaded part by part as its byte ranges are written: part k is bytes `bounds[k]`."""

    name: str
    size: int
    part_size: int
    bounds: list[tuple[int, int]]
    parts_of_step: dict[int, list[int]] = field(default_factory=dict)  # step.index -> the parts it writes into
    first_step: dict[int, list[int]] = field(default_factory=dict)  # step.index -> the parts it is the first to write
    steps_per_part: list[int] = field(default_factory=list)  # how many steps write into each part

    def part_bytes(self, k: int) -> int:
        """The size of part `k`."""
        begin, end = self.bounds[k]
        return end - begin


def _step_ranges(step: Step, by_name: dict) -> list[tuple[int, int]]:
    """The byte ranges of one file a step writes into (its tensors' slots; a batch's first step writes all of its
    groups'). A superset is safe: a part is uploaded only after every step touching it ran."""
    groups = (step.group, *(step.batch or ()))
    ranges = []
    for group in groups:
        for info in group.outputs:
            slot = by_name.get(info.name)
            if slot is not None and slot.end > slot.begin:
                ranges.append((slot.begin, slot.end))
    if step.part is not None and ranges:
        ranges = [(max(b, step.part[0]), min(e, step.part[1])) for b, e in ranges]
        ranges = [(b, e) for b, e in ranges if e > b]
    return ranges


PARTS, WHOLE, WHOLE_NO_HOLES = "parts", "whole files", "whole files (the spool folder cannot punch holes)"


def spool_route(plan: Plan) -> str | None:
    """How a remote destination's files go through the local spool: `PARTS` (uploaded part by part as they are
    written, each part's blocks freed after its upload), `WHOLE` (written whole, then uploaded: the destination or
    the format does not stream), `WHOLE_NO_HOLES` (it would stream, but the spool folder's file system cannot free
    a part's blocks); None for a local destination. Asked of the spool folder once per plan."""
    remote = plan.remote
    if remote is None:
        return None
    if getattr(remote, "stream_part_size", None) is None or not getattr(plan.output_format, "streams_parts", False):
        return WHOLE
    route = plan.__dict__.get("_spool_route")
    if route is None:
        from ..output.remote.spool import can_punch_holes

        route = PARTS if plan.dest is None or can_punch_holes(plan.dest) else WHOLE_NO_HOLES
        plan.__dict__["_spool_route"] = route
    return route


def streamed_files(plan: Plan, rank: int) -> dict[str, StreamedFile]:
    """The files `rank` uploads part by part, with which steps write into which part (empty when none is: see
    `spool_route`)."""
    from ..output.base import FileLayout

    if spool_route(plan) != PARTS:
        return {}
    remote = plan.remote
    part_size = remote.stream_part_size
    found: dict[str, StreamedFile] = {}
    slots: dict[str, dict] = {}
    for f in plan.rank_files(rank):
        size = part_size(f.size)
        if f.ranks or not size or f.size <= size or not isinstance(f.layout, FileLayout):
            continue
        bounds = [(b, min(b + size, f.size)) for b in range(0, f.size, size)]
        found[f.name] = StreamedFile(f.name, f.size, size, bounds, steps_per_part=[0] * len(bounds))
        slots[f.name] = f.layout.by_name()
    if not found:
        return found
    for step in plan.rank_steps(rank):
        for name in step.files:
            streamed = found.get(name)
            if streamed is None:
                continue
            parts = sorted({k for b, e in _step_ranges(step, slots[name])
                            for k in range(b // streamed.part_size, (e - 1) // streamed.part_size + 1)})
            if not parts:
                continue
            streamed.parts_of_step[step.index] = parts
            for k in parts:
                if not streamed.steps_per_part[k]:
                    streamed.first_step.setdefault(step.index, []).append(k)
                streamed.steps_per_part[k] += 1
    return found


def deferred_names(plan: Plan) -> list[str]:
    """The output files a remote destination must keep invisible until the finish: all of them when the output has
    no index or other marker written last (`plan.commit_files` empty: one safetensors or GGUF file), else none."""
    return [] if plan.commit_files else [f.name for f in plan.output_file_list]


def open_bytes_peak(plan: Plan, rank: int) -> int:
    """The most bytes of `rank`'s spool units (whole files, or parts of streamed files) open at once: from the first
    step writing into a unit to the last (a part no step writes, header or padding only, opens and closes with its
    file's first step)."""
    streamed = streamed_files(plan, rank)
    files = {f.name: f.size for f in plan.rank_files(rank)}
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    sizes: dict[tuple[str, int], int] = {}
    for position, step in enumerate(plan.rank_steps(rank)):
        for name in step.files:
            if name not in files:
                continue
            s = streamed.get(name)
            if s is None:
                units = [(name, -1)]
                sizes[(name, -1)] = files[name]
            else:
                units = [(name, k) for k in s.parts_of_step.get(step.index, ())]
                if (name, -1) not in first:  # the file's first step: its parts no step writes open and close here
                    first[(name, -1)] = last[(name, -1)] = position
                    sizes[(name, -1)] = sum(s.part_bytes(k) for k in range(len(s.bounds)) if not s.steps_per_part[k])
                for unit in units:
                    sizes[unit] = s.part_bytes(unit[1])
            for unit in units:
                first.setdefault(unit, position)
                last[unit] = position
    events = sorted([(first[u], 0, sizes[u]) for u in first] + [(last[u], 1, -sizes[u]) for u in last])
    held = peak = 0
    for _, _, delta in events:  # at one position, opens (0) come before closes (1)
        held += delta
        peak = max(peak, held)
    return peak


def rank_spool_bytes(plan: Plan, rank: int) -> int:
    """The spool bound of `rank` (see the module docstring)."""
    total = sum(f.size for f in plan.rank_files(rank))
    if not total:
        return 0
    return min(total, max(plan.options.spool_size, open_bytes_peak(plan, rank)))
