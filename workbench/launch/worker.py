"""The conversion worker: `python -m workbench.launch.worker JOBDIR`, started by torchrun or by the
local launcher (`local_run`), which set RANK and WORLD_SIZE alike.

Each rank re-plans from the job, checks the fingerprint, runs its share, prints JSON progress lines,
and leaves a status file (`rank-R.json`: success, or the error text). Rank 0 then waits for every
rank's status and, only if all succeeded, copies extras and writes the index (the commit marker).
No process group is needed, so byte-copy conversions never import torch in the workers.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..engine.finalize import finalize_destination
from ..engine.progress import PROGRESS_TAG, Progress
from ..engine.rank import run_rank
from ..engine.report import RankResult
from ..engine.status import FINAL_FILE, JOB_FILE, describe_failure, read_json, status_path, write_json_atomic
from ..errors import PlanError
from .job import Job, replan
from .processes import start_time

POLL_SECONDS = 0.02


def wait_for_statuses(jobdir: Path, world: int) -> list[RankResult]:
    """Block until every rank left its status (the launcher stops us if a rank dies without one)."""
    while True:
        found = [read_json(status_path(jobdir, r)) for r in range(world)]
        if all(s is not None for s in found):
            return [RankResult.from_dict(s) for s in found]
        time.sleep(POLL_SECONDS)


def run_worker(jobdir: Path, rank: int, world: int) -> int:
    """One rank's whole life; returns the process exit code."""
    import json

    # The start tick lets the launcher tell this process from a later one given the same pid (launch.processes).
    started = start_time()
    os.write(1, (json.dumps({PROGRESS_TAG: "start", "rank": rank, "pid": os.getpid(), "started": started}) + "\n").encode())
    plan = None
    try:
        job = Job.from_json((jobdir / JOB_FILE).read_text(encoding="utf-8"))
        plan = replan(job)
        if plan.nproc != world:
            raise PlanError(f"Cannot run rank {rank}: the plan is for {plan.nproc} processes but {world} were started.")
        progress = Progress(plan.rank_output_bytes(rank), rank=rank, json_lines=True)
        result = run_rank(plan, rank, progress)
        progress.close()
    except Exception as exc:
        result = RankResult(rank, ok=False, error=describe_failure(exc))
    write_json_atomic(status_path(jobdir, rank), result.to_dict())
    if not result.ok:
        return 1
    if rank == 0:
        statuses = wait_for_statuses(jobdir, world)
        final: dict = {"ok": all(s.ok for s in statuses), "index_written": False}
        if final["ok"]:
            try:
                final["index_written"] = finalize_destination(plan)
            except Exception as exc:
                final = {"ok": False, "error": describe_failure(exc)}
        write_json_atomic(jobdir / FINAL_FILE, final)
        return 0 if final["ok"] else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: rank and world size come from the launcher's environment (RANK, WORLD_SIZE)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workbench.launch.worker JOBDIR (started by workbench's launcher)", file=sys.stderr)
        return 2
    return run_worker(Path(args[0]), int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))


if __name__ == "__main__":
    sys.exit(main())
