"""Small casts that run as one: adjacent in the source and in the output, read, converted and written at once.

A checkpoint of many tiny tensors cast one by one costs a read, a conversion call and a write per
tensor (~20 µs each: 2 s for 100k tensors). When consecutive cast steps of one rank read adjacent
bytes of one source file and fill adjacent slots of one output file, the engine reads the whole run
with one read, converts it with one call and writes it with one write (`engine.cast_batch`).

A cast run (`planning.cast_runs`, many tensors in one step) is batched inside itself by the same rules
(`cast_runs.run_batches`); the batches here join steps of one tensor each.

Only float32 -> bfloat16 casts are batched: numpy converts them element by element, so converting
the run equals converting each tensor, bit for bit. A run holding a NaN or an overflowing value is
converted tensor by tensor instead (torch encodes the NaN, overflow is counted per tensor), which is
what the engine does without batches. The plan counts a batch honestly: every step of it holds the
batch's input and output bytes (`Step.held_bytes`), which is what the engine's cast arena holds.
"""

from __future__ import annotations

from ..dtypes import numpy_castable
from .cast_runs import CastRun, run_batches
from .schedule import CAST, Step
from .sharding import OutputFile

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
        if type(step.group.op) is CastRun:  # batched inside the run (`planning.cast_runs`)
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
