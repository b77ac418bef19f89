"""One rank in this process: `run_local(plan)` executes a one-process plan here, with a text bar or a callback.

What `wb.convert` does when `nproc` is 1, and what the notebook RunPanel's Start button runs in its thread;
it lives with the launchers (N ranks elsewhere) so that front ends reach it without going through the
orchestrator (`conversion.py`), which in turn may show those front ends.
"""

from __future__ import annotations

import time

from ..engine.finalize import finalize_destination, prepare_destination, remove_partials, require_runnable
from ..engine.progress import Progress, ProgressCallback
from ..engine.rank import run_rank, write_failure
from ..engine.report import RunReport, remote_names
from ..engine.source_guard import snapshot_for
from ..output.lock import DestinationLock
from ..planning.model import Plan


def run_local(plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None) -> RunReport:
    """Execute a one-process plan in this process.

        report = run_local(wb.plan("llama/", dest="out/"), quiet=True)
    """
    require_runnable(plan)
    started = time.perf_counter()
    snapshot_for(plan)  # the source as it is before anything is written
    with DestinationLock(plan.dest):
        prepare_destination(plan)
        total = plan.rank_output_bytes(0)
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
        kept=sorted(plan.kept), extras=list(plan.extras), index_written=index_written, **remote_names(plan),
    )
