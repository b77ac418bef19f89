"""`wb.convert` called inside a torchrun job the user started: every rank does its share in place.

Rank 0 plans with the destination checks and prepares the folder; the other ranks re-plan without
them and prove (by fingerprint) they run the same plan. Statuses are gathered over the process group
(gloo works on CPU), so a failing rank never leaves the others waiting, and rank 0 writes the index
only when every rank succeeded. Every rank returns the same report or raises the same error.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

from ..engine.finalize import finalize_destination, prepare_destination, remove_partials
from ..engine.progress import Progress, ProgressCallback
from ..engine.rank import run_rank
from ..engine.report import RankResult, RunReport, remote_names
from ..engine.source_guard import snapshot_for
from ..engine.status import describe_failure, failure_message
from ..errors import PlanError
from ..output.lock import DestinationLock, lock_destination
from ..output.remote import is_url
from ..planning.build import build_plan
from ..planning.model import PlanOptions
from ..planning.sources import resolve_catalog


def under_torchrun() -> bool:
    """True in a process started by torchrun (or with an initialised process group)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return True
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _broadcast(dist, value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def convert_in_place(source: Any, dest: Any, mapper: Any, options: PlanOptions, *, quiet: bool = False,
                     on_progress: ProgressCallback | None = None) -> RunReport:
    """Run this rank's share of the conversion and agree with the other ranks on the outcome."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    try:
        return _run(dist, source, dest, mapper, options, quiet, on_progress)
    finally:
        if created:
            dist.destroy_process_group()


def _run(dist, source, dest, mapper, options, quiet, on_progress) -> RunReport:
    locks: list[DestinationLock] = []  # rank 0 holds the destination's lock for the whole job
    try:
        return _run_locked(dist, source, dest, mapper, options, quiet, on_progress, locks)
    finally:
        for lock in locks:
            lock.release()


def _run_locked(dist, source, dest, mapper, options, quiet, on_progress, locks: list[DestinationLock]) -> RunReport:
    rank, world = dist.get_rank(), dist.get_world_size()
    options = replace(options, nproc=world)
    started = time.perf_counter()
    catalog = resolve_catalog(source)
    verdict = None
    plan = None
    if rank == 0:
        try:
            plan = build_plan(catalog, mapper, options, dest)
            verdict = {"errors": [p.message for p in plan.errors], "kept": sorted(plan.kept), "fingerprint": plan.fingerprint,
                       "complete": plan.complete}
            if plan.ok and not plan.complete:
                snapshot_for(plan)
                locks.append(lock_destination(plan.dest))
                prepare_destination(plan)
        except Exception as exc:
            verdict = {"errors": [describe_failure(exc)], "kept": [], "fingerprint": ""}
    verdict = _broadcast(dist, verdict)
    if verdict["errors"]:
        raise PlanError(f"Cannot convert into {dest}: " + " ".join(verdict["errors"]))
    if verdict.get("complete"):  # every rank: the destination already holds this conversion, finished
        if plan is None:
            plan = build_plan(catalog, mapper, options, dest, check_dest=False, kept=verdict["kept"])
        return RunReport.nothing_to_do(plan)
    try:
        if plan is None:
            plan = build_plan(catalog, mapper, options, dest, check_dest=False, kept=verdict["kept"])
            if plan.fingerprint != verdict["fingerprint"]:
                raise PlanError(f"Cannot run rank {rank}: its plan differs from rank 0's (different source or mapper on this rank?).")
        progress = Progress(plan.rank_output_bytes(rank), rank=rank,
                            bar=not quiet and rank == 0, callback=on_progress)
        try:
            result = run_rank(plan, rank, progress)
        finally:
            progress.close()
    except Exception as exc:
        result = RankResult(rank, ok=False, error=describe_failure(exc))
    gathered = [None] * world
    dist.all_gather_object(gathered, result.to_dict())
    results = [RankResult.from_dict(r) for r in gathered]
    records: list = [None] * world  # a remote destination's local upload records, for rank 0 (no shared folder)
    if is_url(str(dest)):
        mine = []
        if plan is not None and plan.remote is not None and result.ok:
            try:
                mine = plan.remote.records()
            except Exception as exc:  # noqa: BLE001 - reported as this rank's failure below
                mine = {"error": describe_failure(exc)}
        dist.all_gather_object(records, mine)
    outcome = None
    if rank == 0:
        outcome = {"ok": all(r.ok for r in results), "index": False, "error": ""}
        if outcome["ok"]:
            try:
                if plan.remote is not None:
                    failed = [r["error"] for r in records if isinstance(r, dict)]
                    if failed:
                        raise PlanError(failed[0])
                    plan.remote.adopt([e for r in records if isinstance(r, list) for e in r])
                outcome["index"] = finalize_destination(plan)
            except Exception as exc:
                outcome = {"ok": False, "index": False, "error": describe_failure(exc)}
        else:
            remove_partials(plan)
    outcome = _broadcast(dist, outcome)
    if not outcome["ok"]:
        detail = f"; finishing failed: {outcome['error']}" if outcome["error"] else ""
        raise PlanError(failure_message(dest, results, detail=detail))
    return RunReport(
        dest=plan.dest, ranks=results, seconds=time.perf_counter() - started, predicted_peak_bytes=plan.peak_bytes,
        predicted_files=plan.source_paths(), predicted_bytes_read=plan.bytes_read, predicted_bytes_written=plan.bytes_written,
        files=[f.name for f in plan.output_file_list] + (plan.commit_files if outcome["index"] else []),
        kept=sorted(plan.kept), extras=list(plan.extras),
        index_written=outcome["index"], launcher="in place", **remote_names(plan),
    )
