"""How ranks tell each other (and the launcher) how they ended, and how failures read to users."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from ..errors import PlanError, WorkbenchError
from ..files import atomic_write, read_regular
from .report import RankResult


class Cancelled(PlanError):
    """The conversion was cancelled: workers stopped, no index written, temporary files removed."""


def describe_failure(exc: BaseException) -> str:
    """A one-paragraph cause: our own errors as they are, anything else with its type and origin."""
    if isinstance(exc, WorkbenchError):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


JOB_FILE = "job.json"  # in the job folder: the plan's inputs, written by the launcher
FINAL_FILE = "final.json"  # rank 0's verdict after every rank finished


def status_path(jobdir: Path, rank: int) -> Path:
    """Where rank `rank` leaves its RankResult in the job folder."""
    return jobdir / f"rank-{rank}.json"


def failure_message(dest: object, results: list[RankResult], *, missing: list[int] = (), detail: str = "") -> str:
    """The error users see when ranks failed: which rank, what cause, and that nothing was committed."""
    causes = [f"rank {r.rank} failed: {(r.error or 'unknown error').rstrip('. ')}" for r in results if not r.ok]
    if missing:
        causes.append(f"rank(s) {', '.join(map(str, missing))} stopped without reporting{detail}")
    cause = "; ".join(causes) or f"the workers stopped{detail}"
    return (
        f"Cannot convert into {dest}: {cause}. No index was written and temporary files were removed; "
        "run the same conversion again to resume (finished shards are kept)."
    )


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so that readers see either nothing or the whole file."""
    atomic_write(path, json.dumps(data))


def read_json(path: Path) -> dict | None:
    """A JSON file's content, or None when absent or unreadable."""
    try:
        return json.loads(read_regular(path))
    except (OSError, ValueError, WorkbenchError):
        return None
