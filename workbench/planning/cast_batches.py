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
    runs: dict[int, list | None] = {}  # rank -> [output file, source path, source end, output end, held, source bytes, steps]
    castable: dict[tuple[str, str], bool] = {}
    for step in steps:  # once per tensor of a big checkpoint: spelled out
        run = runs.get(step.rank)
        where = begin = None
        if step.kind == CAST and len(step.files) == 1:
            group = step.group
            src, out = group.inputs[0], group.outputs[0]
            pair = (src.dtype, out.dtype)
            ok = castable.get(pair)
            if ok is None:
                ok = castable[pair] = numpy_castable(*pair)
            n_out = step.bytes_out
            if ok and n_out and n_out * 3 <= BATCH_BYTES:  # float32 in, bfloat16 out: 3x the output bytes held
                where = locate(src)
                begin = out_begin.get(out.name) if where is not None else None
        if begin is None:
            if run is not None:
                _close(run)
                runs[step.rank] = None
            continue
        path, src_begin, src_end = where
        n_in = src_end - src_begin
        file = step.files[0]
        if (run is not None and run[2] == src_begin and run[3] == begin and run[0] == file and (run[1] is path or run[1] == path)
                and run[4] + n_in + n_out <= BATCH_BYTES and run[5] + n_in <= chunk_bytes):
            run[2], run[3] = src_end, begin + n_out
            run[4] += n_in + n_out
            run[5] += n_in
            run[6].append(step)
            continue
        if run is not None:
            _close(run)
        runs[step.rank] = [file, path, src_end, begin + n_out, n_in + n_out, n_in, [step]] if n_in <= chunk_bytes else None
    for run in runs.values():
        if run is not None:
            _close(run)


def _close(run: list) -> None:
    """Mark a run's steps as one batch when it has more than one step."""
    held, batch = run[4], run[6]
    if len(batch) < 2:
        return
    for step in batch:
        step.held_bytes = held
        step.batch = ()
    batch[0].batch = tuple(s.group for s in batch)
