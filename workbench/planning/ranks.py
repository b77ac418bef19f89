"""Which rank writes which output files.

A rank owns whole output files (files joined by a group that spans them go together) and gets a
contiguous run of them in schedule order, so it reads a contiguous range of the source and opens
only those source files. Runs are balanced by bytes moved (read + written).
"""

from __future__ import annotations

from ..mapper.groups import Problem
from .schedule import Step
from .sharding import OutputFile


def file_clusters(files: list[OutputFile], steps: list[Step]) -> list[list[int]]:
    """Indexes of output files that must share a rank (a step writes to all of them), in file order."""
    position = {f.name: k for k, f in enumerate(files)}
    parent = list(range(len(files)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for step in steps:
        if len(step.files) < 2:  # writes one file: joins nothing
            continue
        ks = [position[name] for name in step.files]
        for k in ks[1:]:
            a, b = root(ks[0]), root(k)
            if a != b:
                parent[max(a, b)] = min(a, b)
    clusters: dict[int, list[int]] = {}
    for k in range(len(files)):
        clusters.setdefault(root(k), []).append(k)
    return [clusters[r] for r in sorted(clusters)]


def _parts_needed(loads: list[int], capacity: int) -> int:
    parts, filled = 1, 0
    for load in loads:
        if filled and filled + load > capacity:
            parts, filled = parts + 1, 0
        filled += load
    return parts


def _pack(loads: list[int], capacity: int) -> list[list[int]]:
    parts: list[list[int]] = [[]]
    filled = 0
    for k, load in enumerate(loads):
        if parts[-1] and filled + load > capacity:
            parts.append([])
            filled = 0
        parts[-1].append(k)
        filled += load
    return parts


def _split_best(part: list[int], loads: list[int]) -> tuple[list[int], list[int]]:
    total = sum(loads[k] for k in part)
    best, best_cut, left = None, 1, 0
    for cut in range(1, len(part)):
        left += loads[part[cut - 1]]
        worst = max(left, total - left)
        if best is None or worst < best:
            best, best_cut = worst, cut
    return part[:best_cut], part[best_cut:]


def balanced_runs(loads: list[int], nproc: int) -> list[list[int]]:
    """Split items (in order) into at most `nproc` contiguous runs minimising the largest run's load."""
    if not loads:
        return []
    lo, hi = max(loads), sum(loads)
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_needed(loads, mid) <= nproc:
            hi = mid
        else:
            lo = mid + 1
    runs = _pack(loads, lo)
    while len(runs) < nproc:  # same largest load, but give idle ranks a share when a run can split
        splittable = [i for i, run in enumerate(runs) if len(run) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: (sum(loads[k] for k in runs[i]), -i))
        runs[i : i + 1] = list(_split_best(runs[i], loads))
    return runs


def assign_ranks(files: list[OutputFile], steps: list[Step], nproc: int) -> list[Problem]:
    """Set `rank` on every output file and step; returns warnings (e.g. ranks left without work)."""
    if nproc == 1:  # one rank does everything: no loads to balance
        for file in files:
            file.rank = 0
        for step in steps:
            step.rank = 0
        return []
    clusters = file_clusters(files, steps)
    loads = []
    for cluster in clusters:
        step_ids = files[cluster[0]].steps if len(cluster) == 1 else sorted({s for k in cluster for s in files[k].steps})
        load = 0
        for s in step_ids:
            step = steps[s]
            load += sum(step.reads.values()) + step.bytes_out
        loads.append(load or 1)
    runs = balanced_runs(loads, nproc)
    for rank, run in enumerate(runs):
        for c in run:
            for k in clusters[c]:
                files[k].rank = rank
                for s in files[k].steps:
                    steps[s].rank = rank
    problems = []
    if nproc > len(runs):
        problems.append(
            Problem(
                "warning",
                f"Only {len(runs)} of {nproc} ranks get work: a rank writes whole output files and there are "
                f"{len(files)}. Lower the shard size to spread the work, or use fewer processes.", kind="ranks",
            )
        )
    return problems
