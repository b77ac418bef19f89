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
from .launcher import launch
from .progress import Progress, ProgressCallback, live_display
from .rank import run_rank
from .report import RunReport


def run_local(plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None) -> RunReport:
    """Execute a one-process plan in this process."""
    require_runnable(plan)
    started = time.perf_counter()
    prepare_destination(plan)
    total = sum(f.tensor_bytes for f in plan.rank_files(0))
    progress = Progress(total, bar=not quiet, callback=on_progress)
    try:
        result = run_rank(plan, 0, progress)
    except BaseException:
        remove_partials(plan)
        raise
    finally:
        progress.close()
    index_written = finalize_destination(plan)
    return RunReport(
        dest=plan.dest, ranks=[result], seconds=time.perf_counter() - started, predicted_peak_bytes=plan.peak_bytes,
        predicted_files=plan.source_paths(), predicted_bytes_read=plan.bytes_read,
        predicted_bytes_written=plan.bytes_written,
        files=[f.name for f in plan.output_file_list] + (plan.commit_files if index_written else []),
        kept=sorted(plan.kept), extras=list(plan.extras), index_written=index_written,
    )


def execute(plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None) -> RunReport:
    """Run an existing plan (made with a destination): here when nproc is 1, else on torchrun workers."""
    require_runnable(plan)
    display = None if quiet else live_display(plan, on_progress)  # a notebook panel instead of the tqdm bar
    if display is not None:
        return display.run()
    if plan.nproc == 1:
        return run_local(plan, quiet=quiet, on_progress=on_progress)
    return launch(plan, quiet=quiet, on_progress=on_progress)


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
) -> RunReport:
    """Convert `source` into HF safetensors shards in `dest`, exactly as `wb.plan` describes.

    `nproc > 1` starts torchrun workers; inside a torchrun job each rank does its share in place.
    An interrupted run resumes when repeated with the same arguments. `on_progress(rank, done_bytes,
    total_bytes)` is called as bytes are written (return False to cancel); `quiet=True` hides the bar.
    `to='dcp'` writes a torch.distributed.checkpoint folder instead of safetensors shards (see `wb.plan`).
    Returns a `RunReport` (predicted next to measured); raises `PlanError` when the plan has errors
    or a rank fails (naming the rank and the cause; no index is written then).
    """
    options = make_options(shard_size, nproc, rest, dtype, extras, overwrite, chunk_size, to)
    if under_torchrun():
        return convert_in_place(source, dest, mapper, options, quiet=quiet, on_progress=on_progress)
    plan = build_plan(resolve_catalog(source), mapper, options, dest)
    return execute(plan, quiet=quiet, on_progress=on_progress)
