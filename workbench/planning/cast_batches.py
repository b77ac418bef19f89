"""Small casts that run as one: adjacent in the source and in the output, read, converted and written at once.

A checkpoint of many tiny tensors cast one by one costs a read, a conversion call and a write per
tensor (~20 µs each: 2 s for 100k tensors). When consecutive cast steps of one rank read adjacent
bytes of one source file and fill adjacent slots of one output file, the engine reads the whole run
with one read, converts it with one call and writes it with one write (`engine.cast_batch`).

Only float32 -> bfloat16 casts are batched: numpy converts them element by element, so converting
the run equals converting each tensor, bit for bit. A run holding a NaN or an overflowing value is
converted tensor by tensor instead (torch encodes the NaN, overflow is counted per tensor), which is
what the engine does without batches. The plan counts a batch honestly: every step of it holds the
batch's input and output bytes (`Step.held_bytes`), which is what the engine's cast arena holds.
"""

from __future__ import annotations

from ..dtypes import numpy_castable
from .schedule import CAST, Step
from .sharding import OutputFile

BATCH_BYTES = 256 << 10  # input + output bytes of one batch at most: one numpy block (`engine.bf16.BLOCK`), written at once


def batch_casts(steps: list[Step], files: list[OutputFile], reader: object | None, chunk_bytes: int) -> None:
    """Mark runs of small adjacent casts in `steps` (schedule order, ranks and files assigned) as batches."""
    locate = getattr(reader, "locate", None)
    if locate is None or sum(1 for s in steps if s.kind == CAST) < 2:
        return
    out_begin = {t.name: t.begin for f in files for t in f.layout.tensors}
    runs: dict[int, _Run] = {}  # rank -> the run being extended
    for step in steps:
        run = runs.get(step.rank)
        entry = _entry(step, locate, out_begin, chunk_bytes)
        if run is not None and entry is not None and run.extends(entry, chunk_bytes):
            run.add(step, entry)
            continue
        if run is not None:
            run.close()
        runs[step.rank] = _Run(step, entry) if entry is not None else None
    for run in runs.values():
        if run is not None:
            run.close()


def _entry(step: Step, locate, out_begin: dict[str, int], chunk_bytes: int) -> tuple | None:
    """(output file, source path, source begin, source end, output begin, output end, held bytes) of a
    batchable step, or None."""
    if step.kind != CAST or len(step.files) != 1:
        return None
    group = step.group
    src, out = group.inputs[0], group.outputs[0]
    held = src.nbytes + out.nbytes
    if not src.nbytes or held > BATCH_BYTES or src.nbytes > chunk_bytes or not numpy_castable(src.dtype, out.dtype):
        return None
    where = locate(src)
    begin = out_begin.get(out.name)
    if where is None or begin is None:
        return None
    path, src_begin, src_end = where
    return step.files[0], path, src_begin, src_end, begin, begin + out.nbytes, held


class _Run:
    """Consecutive batchable steps of one rank, adjacent in source and output."""

    def __init__(self, step: Step, entry: tuple) -> None:
        self.steps = [step]
        self.file, self.path, _, self.src_end, _, self.out_end, self.held = entry
        self.src_bytes = entry[3] - entry[2]

    def extends(self, entry: tuple, chunk_bytes: int) -> bool:
        """True when the step of `entry` continues this run within the batch's bounds."""
        file, path, src_begin, src_end, out_begin, _, held = entry
        return (file == self.file and path == self.path and src_begin == self.src_end and out_begin == self.out_end
                and self.held + held <= BATCH_BYTES and self.src_bytes + src_end - src_begin <= chunk_bytes)

    def add(self, step: Step, entry: tuple) -> None:
        """Append the step of `entry` (it `extends` the run)."""
        self.steps.append(step)
        self.src_bytes += entry[3] - entry[2]
        self.src_end, self.out_end = entry[3], entry[5]
        self.held += entry[6]

    def close(self) -> None:
        """Mark the run's steps as one batch when it has more than one step."""
        if len(self.steps) < 2:
            return
        first = self.steps[0]
        first.batch = tuple(s.group for s in self.steps)
        for step in self.steps:
            step.held_bytes = self.held
            if step is not first:
                step.batch = ()
