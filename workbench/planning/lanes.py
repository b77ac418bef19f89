"""Copy lanes: a byte-copy rank's output files shared between two threads.

Kernel copies into one file take turns on that file's lock; copies into different files run on different cores
at once (1 GiB into four files on this project's 2-core VM: 0.65-0.77 s on two threads against 0.90-1.0 s on
one, each file synced). So a rank whose steps are all byte copies of local files, writing two or more files,
gives its files to two lanes, balanced by bytes in the order they are first written. Each lane runs its steps
in schedule order with its own copy queue and writers. A file is written by one lane only, so the bytes are
those of a one-lane run; the rank reports one result. Decided here from the plan (and the processors of the
process that runs it), done by `engine.rank`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from ..output import direct_io
from .schedule import COPY, Step
from .sharding import OutputFile

if TYPE_CHECKING:  # pragma: no cover
    from .model import Plan

LANES = 2
LANE_MIN_BYTES = 64 << 20  # below this in a lane the second thread costs more than it saves
_DECIDED: WeakKeyDictionary[Plan, dict[int, list[list[Step]] | None]] = WeakKeyDictionary()  # asked by summary, rss, engine


def available_cpus(ranks_here: int = 1) -> int:
    """The processors each of `ranks_here` ranks on this machine may count on (those this process may run on,
    shared out). Under a launcher, LOCAL_WORLD_SIZE (torchrun, the local launcher) says how many ranks share them."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", ranks_here)))
    except ValueError:
        pass
    return cpus // max(1, ranks_here)


def split_lanes(steps: Sequence[Step], files: Mapping[str, OutputFile], *, local_raw: bool,
                ranks_here: int = 1) -> list[list[Step]] | None:
    """The rank's steps in two lanes of whole files, or None when one lane is the better choice: steps that are not
    all byte copies of raw local bytes (`local_raw`), fewer than two files, one processor, or too little to copy."""
    if not local_raw or len(files) < LANES or available_cpus(ranks_here) < LANES:
        return None
    if any(step.kind != COPY for step in steps):
        return None
    lane_of: dict[str, int] = {}
    load = [0] * LANES
    for step in steps:
        for name in step.files:
            if name in files and name not in lane_of:
                lane = load.index(min(load))
                lane_of[name] = lane
                load[lane] += files[name].size
    if min(load) < LANE_MIN_BYTES:
        return None
    lanes: list[list[Step]] = [[] for _ in range(LANES)]
    for step in steps:
        owners = {lane_of[name] for name in step.files if name in lane_of}
        if len(owners) > 1:  # a step writing into files of both lanes: keep the rank on one thread
            return None
        lanes[owners.pop() if owners else 0].append(step)
    return lanes


def rank_lanes(plan: Plan, rank: int) -> list[list[Step]] | None:
    """The copy lanes `rank` runs `plan`'s steps in, or None for one lane. Not with direct writes (each lane would
    hold its own buffers) nor with a reader between the files and the bytes (URLs, pickled checkpoints)."""
    decided = _DECIDED.setdefault(plan, {})
    if rank not in decided:
        decided[rank] = _decide(plan, rank)
    return decided[rank]


def _decide(plan: Plan, rank: int) -> list[list[Step]] | None:
    reader = plan.source.reader
    local_raw = getattr(reader, "raw_in_place", False) is True and getattr(reader, "locate", None) is not None
    if direct_io.enabled():
        return None
    return split_lanes(plan.rank_steps(rank), {f.name: f for f in plan.rank_files(rank)}, local_raw=local_raw,
                       ranks_here=plan.nproc)  # a local launch; a launcher's LOCAL_WORLD_SIZE says better
