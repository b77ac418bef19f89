"""`wb.convert(...)`: plan, check, run (here, on torchrun workers, or in place under torchrun), report."""

from __future__ import annotations

import os
import time
from typing import Any

from ..planning.build import DEFAULT_CHUNK, build_plan, make_options
from ..planning.model import Plan
from ..planning.sources import resolve_catalog
from .finalize import finalize_destination, prepare_destination, remove_partials, require_runnable
from .inplace import convert_in_place, under_torchrun
from .launcher import check_launcher, launch
from .lock import DestinationLock
from .output_check import check_outputs
from .progress import Progress, ProgressCallback, live_display
from .rank import run_rank, write_failure
from .report import RunReport
from .source_guard import snapshot_for


def run_local(plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None) -> RunReport:
    """Execute a one-process plan in this process."""
    require_runnable(plan)
    started = time.perf_counter()
    snapshot_for(plan)  # the source as it is before anything is written
    with DestinationLock(plan.dest):
        prepare_destination(plan)
        total = sum(f.tensor_bytes for f in plan.rank_files(0))
        progress = Progress(total, bar=not quiet, callback=on_progress)
        try:
            result = run_rank(plan, 0, progress)
            index_written = finalize_destination(plan)
        except BaseException as exc:
            remove_partials(plan)
            if isinstance(exc, OSError):
                raise write_failure(plan.dest, exc) from exc
            raise
        finally:
            progress.close()
    return RunReport(
        dest=plan.dest, ranks=[result], seconds=time.perf_counter() - started, predicted_peak_bytes=plan.peak_bytes,
        predicted_files=plan.source_paths(), predicted_bytes_read=plan.bytes_read,
        predicted_bytes_written=plan.bytes_written,
        files=[f.name for f in plan.output_file_list] + (plan.commit_files if index_written else []),
        kept=sorted(plan.kept), extras=list(plan.extras), index_written=index_written,
    )


def execute(plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None, verify: bool = False,
            launcher: str = "torchrun") -> RunReport:
    """Run an existing plan (made with a destination): here when nproc is 1, else on worker processes.

    `launcher` starts the workers: "torchrun" or "local" (see `wb.convert`). `verify=True` re-reads
    every output afterwards and compares it with the source (`report.verification`).
    """
    require_runnable(plan)
    check_launcher(launcher)
    if plan.complete:  # the destination holds this very conversion, finished: re-running it changes nothing
        report = RunReport.nothing_to_do(plan)
        if verify:
            report.output_check = check_outputs(plan)
        return report
    display = None if quiet else live_display(plan, on_progress, launcher)  # a notebook panel, not the tqdm bar
    if display is not None:
        report = display.run()
    elif plan.nproc == 1:
        report = run_local(plan, quiet=quiet, on_progress=on_progress)
    else:
        report = launch(plan, quiet=quiet, on_progress=on_progress, launcher=launcher)
    if verify:
        report.output_check = check_outputs(plan)
    return report


def convert(
    source: Any,
    dest: str | os.PathLike,
    mapper: Any = None,
    *,
    shard_size: int | str = "5GB",
    nproc: int = 1,
    rest: str = "keep",
    dtype: Any = None,
    extras: bool = True,
    overwrite: bool = False,
    quiet: bool = False,
    on_progress: ProgressCallback | None = None,
    chunk_size: int | str = DEFAULT_CHUNK,
    to: str = "safetensors",
    verify: bool = False,
    launcher: str = "torchrun",
) -> RunReport:
    """Convert `source` into HF safetensors shards in `dest`, exactly as `wb.plan` describes.

    `nproc > 1` starts torchrun workers; `launcher="local"` starts the same workers without torchrun
    (one machine; they need no process group, so this saves torchrun's start-up of about 1.6 s).
    Inside a torchrun job each rank does its share in place.
    An interrupted run resumes when repeated with the same arguments. `on_progress(rank, done_bytes,
    total_bytes)` is called as bytes are written (return False to cancel); `quiet=True` hides the bar.
    `to='dcp'` writes a torch.distributed.checkpoint folder instead of safetensors shards (see `wb.plan`).
    `verify=True` re-reads every output and compares it with the source: bit-exact for byte-level
    operations, equal to a fresh cast for casts; per tensor in `report.verification`, `report.verified`.
    Returns a `RunReport` (predicted next to measured); raises `PlanError` when the plan has errors
    or a rank fails (naming the rank and the cause; no index is written then).
    """
    options = make_options(shard_size, nproc, rest, dtype, extras, overwrite, chunk_size, to)
    check_launcher(launcher)
    if under_torchrun():
        report = convert_in_place(source, dest, mapper, options, quiet=quiet, on_progress=on_progress)
        if verify and int(os.environ.get("RANK", "0")) == 0:  # one rank re-reads the whole output
            report.output_check = check_outputs(build_plan(resolve_catalog(source), mapper, options, dest, check_dest=False))
        return report
    plan = build_plan(resolve_catalog(source), mapper, options, dest)
    return execute(plan, quiet=quiet, on_progress=on_progress, verify=verify, launcher=launcher)
