"""One rank's share of a plan: run its steps in schedule order, commit each file after its last step.

Writers open at a file's first step and commit (fsync + rename) right after its last one, so at
most the files being filled are open and every committed file is complete (commits run on a background
thread, `committer`, so the next file's copies overlap the last one's fsync). The rank measures what
it does: time, bytes, source files opened (through the counted I/O layer), tensor bytes held, RSS.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from ..errors import PlanError, WorkbenchError
from ..iostats import IO
from ..planning.gc_pause import gc_paused
from ..planning.lanes import rank_lanes
from ..planning.model import Plan
from ..planning.schedule import COPY, Step
from .committer import Committer
from .memory import reset_rss_peak, rss_bytes, rss_peak_bytes
from .progress import Progress
from .report import RankResult
from .source_guard import snapshot_for
from .steps import RankContext, StepFailed, preload_libraries, run_copies, run_step

FAIL_RANK_ENV = "WORKBENCH_FAIL_RANK"  # tests: make this rank fail just before committing its last file
KILL_RANK_ENV = "WORKBENCH_KILL_RANK"  # tests: SIGKILL this rank there instead (it dies without a status)

if TYPE_CHECKING:
    from .uploads import SpoolUploads


def _injected_failure(rank: int, name: str) -> None:
    if os.environ.get(KILL_RANK_ENV, "") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(FAIL_RANK_ENV, "") == str(rank):
        raise PlanError(f"Cannot finish {name}: failure injected for testing ({FAIL_RANK_ENV}={rank}).", file=name)


def _step_error(step, exc: Exception, tensor: str | None = None) -> PlanError:
    """The error of a step that failed unexpectedly; `tensor`: the one of a run that failed."""
    what = step.group.label or type(step.group.op).__name__
    outputs = step.group.outputs
    if tensor is not None:
        where, names = f"step {step.index}, {what}, in a run of {len(outputs)} tensors", tensor
    else:
        where, names = f"step {step.index}, {what}", ", ".join(t.name for t in outputs[:3])
        tensor = outputs[0].name if outputs else None
    return PlanError(
        f"Cannot compute {names} ({where}): {type(exc).__name__}: {exc}. "
        "Check the mapper on these tensors (e.g. wb.open_checkpoint(...).load and op.apply).",
        tensor=tensor,
    )


_FULL = {errno.ENOSPC: "the disk is full", errno.EFBIG: "a file size limit was reached", errno.EDQUOT: "the disk quota is exhausted"}


def write_failure(dest: object, exc: OSError) -> PlanError:
    """The error users see when the operating system refuses a write or a sync (disk full, I/O error ...)."""
    cause = _FULL.get(exc.errno, exc.strerror or str(exc))
    where = f" ({exc.filename})" if exc.filename else ""
    fix = "Free some space or choose another destination" if exc.errno in _FULL else "Check the destination's disk"
    return PlanError(
        f"Cannot write the conversion into {dest}: {cause}{where} [errno {exc.errno}]. Temporary files were removed and "
        f"no index was written. {fix}, then run the same conversion again to resume (finished shards are kept).",
        file=exc.filename,
    )


def _release_source_files(plan: Plan) -> None:
    """Close the source reader's cached descriptors (readers reopen lazily), so the run's own opens are counted."""
    close = getattr(plan.source.reader, "close", None)
    if close is not None:
        close()


class _Stopped(Exception):
    """The other lane failed: this one stops at its next step (the other lane's error is the one raised)."""


def _run_lane(ctx: RankContext, steps: list[Step], files: dict, last_step: dict[str, int], last_file: str | None,
              rank: int, committer: Committer, source, stop: threading.Event, progress: Progress | None = None,
              done_elsewhere=lambda: 0, spool: SpoolUploads | None = None) -> None:
    """Run `steps` in order, opening each file's writer at its first step and handing it to `committer` after its
    last. On failure its own writers are aborted (after its copies have stopped) and the error is raised."""
    plan = ctx.plan
    commit_at = set(last_step.values())  # steps after which a file is complete
    if spool is not None:  # streamed parts: copy stretches stop where a part opens or closes
        commit_at |= spool.breaks(steps)
    try:
        index, count = 0, len(steps)
        while index < count:
            step = steps[index]
            if stop.is_set():
                raise _Stopped()
            for name in step.files:
                if name in files and name not in ctx.writers:
                    file = files[name]
                    output = plan.output_format
                    if spool is not None:  # a remote destination: wait for room in the local spool
                        spool.opening(name, stop)
                    writer = spool.open_writer(name, file.layout) if spool is not None else None
                    if writer is None:
                        writer = (output.join_writer if file.ranks else output.open_writer)(plan.dest, file.layout)
                    ctx.writers[name] = writer
            if spool is not None:
                spool.before(step, stop)
            start = index
            try:
                if step.kind == COPY:  # a stretch of copies into these files, queued in one call
                    index = run_copies(ctx, steps, index, commit_at)
                    step = steps[index - 1]
                else:
                    run_step(ctx, step)
                    index += 1
            except (WorkbenchError, OSError):
                raise
            except StepFailed as failed:
                raise _step_error(failed.step, failed.cause, failed.tensor) from failed.cause
            except Exception as exc:
                raise _step_error(step, exc) from exc
            if ctx.queue.full:
                ctx.queue.flush()
            if spool is not None:  # parts whose every byte is now written go up (after the queued writes land)
                spool.after(steps[start:index], lambda: (ctx.cast.wait(), ctx.queue.flush()))
            for name in step.files:
                if last_step.get(name) == step.index:
                    ctx.cast.wait()  # the file's last cast piece may still be being written
                    ctx.queue.flush()
                    if name == last_file:
                        _injected_failure(rank, name)
                    source.check(plan.dest, f"committing {name}")
                    if files[name].ranks:  # shared: this rank's ranges synced; the finish renames the file
                        ctx.writers.pop(name).release()
                    else:
                        if spool is not None:
                            spool.finished(name)
                        committer.submit(name, ctx.writers.pop(name))
            if progress is not None:
                progress.update(ctx.done_bytes + done_elsewhere())
        ctx.cast.wait()
        ctx.queue.flush()
    except BaseException:
        stop.set()
        ctx.cast.close()  # no write may still be running when the partial files are removed
        ctx.queue.close()
        ctx.queue.clear()
        for writer in ctx.writers.values():
            writer.abort()
        ctx.writers.clear()
        raise
    finally:
        ctx.cast.close()
        ctx.queue.close()
        ctx.sources.close()  # its copies are done (commits read no source)


def _run_lanes(plan: Plan, lanes: list[list[Step]], files: dict, last_step: dict[str, int], last_file: str | None,
               rank: int, committer: Committer, source, progress: Progress | None,
               spool: SpoolUploads | None = None) -> list[RankContext]:
    """Run the lanes on threads of their own (the first on this one); raises the first lane's real failure."""
    contexts = [RankContext(plan) for _ in lanes]
    stop = threading.Event()
    errors: list[BaseException | None] = [None] * len(lanes)

    def lane(k: int) -> None:
        try:
            _run_lane(contexts[k], lanes[k], files, last_step, last_file, rank, committer, source, stop, spool=spool)
        except BaseException as exc:  # noqa: BLE001 - raised on the rank's thread below
            errors[k] = exc

    threads = [threading.Thread(target=lane, args=(k,), name=f"workbench-lane-{k}", daemon=True) for k in range(1, len(lanes))]
    for thread in threads:
        thread.start()
    others = contexts[1:]
    try:
        _run_lane(contexts[0], lanes[0], files, last_step, last_file, rank, committer, source, stop, progress,
                  lambda: sum(c.done_bytes for c in others), spool=spool)
    except BaseException as exc:  # noqa: BLE001 - raised below, after the other lanes have stopped
        errors[0] = exc
        stop.set()
    try:
        while progress is not None and errors[0] is None and any(t.is_alive() for t in threads):
            threads[0].join(0.2)  # the first lane is done: keep reporting the others' progress (and take a cancel)
            progress.update(sum(c.done_bytes for c in contexts))
    except BaseException as exc:  # noqa: BLE001 - a cancel from the progress callback
        errors[0] = exc
        stop.set()
    finally:
        for thread in threads:
            thread.join()
    real = [e for e in errors if e is not None and not isinstance(e, _Stopped)]
    if real:
        raise real[0]
    return contexts


@gc_paused()  # a step's objects are freed by reference counting; collections only walked the plan's million objects
def run_rank(plan: Plan, rank: int, progress: Progress | None = None) -> RankResult:
    """Execute `rank`'s steps of `plan` into `plan.dest`; raises on failure after removing partial files."""
    assert plan.dest is not None
    result = RankResult(rank, predicted_files=plan.source_paths(rank), predicted_peak_bytes=plan.rank_peak_bytes(rank),
                        predicted_rss_bytes=plan.rank_rss_bytes(rank))
    steps = plan.rank_steps(rank)
    files = {f.name: f for f in plan.rank_files(rank)}
    last_step = {name: step.index for step in steps for name in step.files if name in files}
    last_file = max(files, key=lambda n: last_step.get(n, -1), default=None)
    preload_libraries(plan, steps)  # before the baseline: a library's RSS is not the run's
    source = snapshot_for(plan)
    reset_rss_peak()
    result.rss_baseline = rss_bytes()
    _release_source_files(plan)
    IO.reset()
    ctx = RankContext(plan)
    lanes = rank_lanes(plan, rank)
    announce = getattr(plan.source.reader, "will_read", None)
    if announce is not None:  # a remote reader fetches ahead, in large ranges, what these steps read
        plan.source.reader.take_counts()  # the run's counts start here
        announce([info for step in steps for info in step.group.inputs])
    started = time.perf_counter()
    spool = None
    if plan.remote is not None:  # files go through a local spool folder (this rank's, on its own node)
        plan.dest.mkdir(parents=True, exist_ok=True)
        # its thread pool is imported only where a remote destination needs it
        from .uploads import SpoolUploads

        spool = SpoolUploads(plan, rank)
    committer = Committer(spool.upload if spool is not None else None)
    contexts = [ctx]
    try:
        if last_file is None:
            _injected_failure(rank, "(no file)")
        if lanes is None:
            _run_lane(ctx, steps, files, last_step, last_file, rank, committer, source, threading.Event(), progress,
                      spool=spool)
        else:
            contexts = _run_lanes(plan, lanes, files, last_step, last_file, rank, committer, source, progress, spool)
        result.files_written.extend(committer.finish())
    except BaseException as exc:
        if plan.remote is not None:
            if spool is not None:
                spool.close()  # no part upload may still be running ...
            committer.close()  # ... nor a file's upload when its multipart upload is aborted
            plan.remote.abort(keep_lock=True)  # the job's end (remove_partials) releases the lock
        if isinstance(exc, OSError):
            raise write_failure(plan.dest, exc) from exc
        raise
    finally:
        if spool is not None:
            spool.close()
        committer.close()  # before the launcher removes partial files: no commit may still be running
        _release_source_files(plan)
        if progress is not None:
            progress.update(sum(c.done_bytes for c in contexts), force=True)
    if result.files_written:
        fd = os.open(plan.dest, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    io = IO.snapshot()
    take = getattr(plan.source.reader, "take_counts", None)
    remote_files, remote_bytes, _ = take() if take is not None else ([], 0, 0)
    io["files_opened"] = sorted(set(io["files_opened"]) | set(remote_files))
    io["bytes_read"] += remote_bytes
    result.seconds = time.perf_counter() - started
    result.steps = len(steps)
    result.bytes_read = io["bytes_read"] + sum(c.queue.copied_bytes for c in contexts)
    result.bytes_written = io["bytes_written"]
    result.copy_calls = sum(c.queue.copy_calls for c in contexts)
    result.files_opened = io["files_opened"]
    result.peak_tensor_bytes = max(c.held.peak for c in contexts)
    result.overflow = contexts[0].overflow.counts  # lanes run byte copies only: no casts, no overflow
    result.rss_peak = rss_peak_bytes()
    if spool is not None:
        result.spool_peak, result.predicted_spool_bytes = spool.gate.peak, plan.rank_spool_bytes(rank)
    return result
