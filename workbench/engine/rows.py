"""Running a ROWS step: the row job its group's op offers (`mapper.row_jobs`), a chunk of whole rows at a time.

The inputs lie raw on disk (the planner makes a ROWS step only then); each chunk of whole rows is read into one
reused buffer, handed to the job's converter (numpy, and whatever the job's kernels import; no torch) with the
tensors the job reads whole beside that input, and the bytes it returns are written at their place in the output
slot. Inputs are converted one after another into consecutive rows of the output. The ledger holds the bytes the
planner counted for the step (`RowJob.held_bytes`), which bounds what the chunk loop allocates. A job with
`outputs` (one per input: a stacked tensor unstacked) writes input k whole into `outputs[k]` instead. The engine does not
know what a job makes: the kernels belong to the op that offers it.
"""

from __future__ import annotations

from ..catalog import TensorInfo
from ..errors import PlanError
from ..iostats import read_into
from ..mapper.row_jobs import row_job
from ..planning.schedule import Step
from .steps import WRITEBACK_PIECE, RankContext


def run_rows(ctx: RankContext, step: Step) -> None:
    """Convert the step's output in row chunks holding at most `job.budget(options.chunk_bytes)` bytes."""
    job = row_job(step.group)
    if job is None:
        raise PlanError(f"Cannot run step {step.index}: its op no longer offers a row conversion. Plan again.")
    outputs = getattr(job, "outputs", None)
    out = job.output
    target = ctx.target(out.name)
    if (target is None and outputs is None) or not job.rows:
        return
    per = job.chunk_rows(job.budget(ctx.plan.options.chunk_bytes))
    in_row, out_row = job.in_row, job.out_row
    held = job.held(per)
    ctx.held.hold(held)
    try:
        buffer = bytearray(per * in_row)
        convert = job.converter(per)
        at = 0
        low, high = step.part or (0, len(job.inputs) * job.rows * out_row)  # a part (`planning.parts`): chunks starting in it
        for k, info in enumerate(job.inputs):
            if outputs is not None:  # input k makes outputs[k], from its first byte (such a step is never cut into parts)
                out, at = outputs[k], 0
                target = ctx.target(out.name)
                if target is None:
                    continue
            span = job.rows * out_row
            if at + span <= low or at >= high:  # none of this input's chunks: not even its whole extras are read
                at += span
                continue
            assert target is not None
            writer = target[0]
            fd, begin = _located(ctx, info)
            whole = []
            for extra in job.whole(k):
                extra_fd, extra_begin = _located(ctx, extra)
                grid = bytearray(extra.nbytes)
                read_into(extra_fd, memoryview(grid), extra_begin)
                whole.append(grid)
            for first in range(0, job.rows, per):
                n = min(per, job.rows - first)
                if not low <= at < high:
                    at += n * out_row
                    continue
                view = memoryview(buffer)[: n * in_row]
                read_into(fd, view, begin + first * in_row)
                data, count, largest = convert(k, first, view, whole)
                ctx.overflowed(out.name, job.overflow_dtype, count, largest)
                writer.write(out.name, data.data, at)
                if data.nbytes >= WRITEBACK_PIECE:  # on its way to disk before the commit's fsync
                    writer.start_writeback(out.name, at, data.nbytes)
                at += n * out_row
                ctx.done_bytes += n * out_row
                del data  # freed before the next chunk is converted: one chunk's output at a time, as `held` counts
    finally:
        ctx.held.release(held)


def _located(ctx: RankContext, info: TensorInfo) -> tuple[int, int]:
    """(file descriptor, offset) of a step input's raw bytes; PlanError when they are not raw any more."""
    where = ctx.locate(info)
    if where is None:
        raise PlanError(f"Cannot convert {info.name!r} in row chunks: its bytes are no longer raw in {info.file}. "
                        "Plan again.", tensor=info.name)
    return where
