"""Which rank writes which output files.

A rank owns whole output files (files joined by a group that spans them go together) and gets a
contiguous run of them in schedule order, so it reads a contiguous range of the source and opens
only those source files. Runs are balanced by bytes moved (read + written).

When whole files cannot be shared evenly (the largest rank would write more than `BALANCE` x the smallest's
bytes, e.g. 64 ranks over a MoE whose stacked expert tensors are 15 GB each) and the output format lets
several ranks write one file (`OutputFormat.shares_files`), the ranks share the schedule instead: rank r writes
the r-th 1/N of the output bytes in schedule order, a step that crosses a boundary cut into parts between its units
(`planning.parts`: pieces, row chunks, byte slices). A file written by several ranks is shared: created whole
before the ranks start, each rank writes and syncs its ranges, the finish renames it (one committer). Cutting
still gives each rank a contiguous stretch of the schedule, so of the source.
"""

from __future__ import annotations

from ..mapper.groups import Problem
from .schedule import SourceAccess, Step
from .sharding import OutputFile

BALANCE = 1.10  # largest / smallest rank's bytes written above which the ranks share files (when the format may)


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


def written_spread(steps: list[Step], nproc: int) -> float:
    """Largest rank's bytes written over the smallest's (the run report's balance; inf when a rank writes nothing)."""
    written = [0] * nproc
    for step in steps:
        written[step.rank] += step.bytes_out
    return max(written) / min(written) if min(written) else float("inf")


def share_ranks(files: list[OutputFile], steps: list[Step], nproc: int, access: SourceAccess, chunk_bytes: int) -> bool:
    """Give the ranks even shares of the output bytes in schedule order (each rank an even split of what the ranks
    before it left), cutting steps into parts at the boundaries (see the module text); renumbers `steps` in place and sets each file's `ranks`. False (nothing
    changed) when cutting does not bring the balance within `BALANCE`."""
    from .parts import part_of, units

    total = sum(step.bytes_out for step in steps)
    if total < nproc:
        return False
    before = [step.rank for step in steps]
    cache: dict = {}  # group id -> its pieces, found once for `units` and every part
    new_steps: list[Step] = []
    rank, start, at = 0, 0, 0  # the rank being filled, where its bytes began, where the next step's begin

    def past_share(position: float) -> bool:  # the current rank's share (an even split of what is left) ends before
        return rank < nproc - 1 and position > start + (total - start) / (nproc - rank)

    for step in steps:
        size = step.bytes_out
        sizes = units(step, access, chunk_bytes, cache) if past_share(at + size) else None
        if sizes is None:  # whole: to the next rank when its middle lies past this rank's share
            if past_share(at + size / 2) and at > start:
                rank, start = rank + 1, at
            step.rank = rank
            new_steps.append(step)
            at += size
            continue
        begin = offset = 0
        for unit in sizes:
            if past_share(at + offset + unit / 2) and at + offset > start:  # the unit's middle lies past the share
                if offset > begin:
                    new_steps.append(part_of(step, begin, offset, access, chunk_bytes, cache))
                    new_steps[-1].rank = rank
                begin = offset
                rank, start = rank + 1, at + offset
            offset += unit
        new_steps.append(part_of(step, begin, offset, access, chunk_bytes, cache))
        new_steps[-1].rank = rank
        at += size
    if written_spread(new_steps, nproc) > BALANCE:
        for step, rank in zip(steps, before, strict=True):
            step.rank = rank
        return False
    for index, step in enumerate(new_steps):
        step.index = index
    steps[:] = new_steps
    position = {f.name: k for k, f in enumerate(files)}
    owners: list[set[int]] = [set() for _ in files]
    for file in files:
        file.steps = []
    for step in steps:
        for name in step.files:
            k = position[name]
            files[k].steps.append(step.index)
            owners[k].add(step.rank)
    for file, ranks in zip(files, owners, strict=True):
        file.rank = steps[file.steps[0]].rank if file.steps else 0
        file.ranks = tuple(sorted(ranks)) if len(ranks) > 1 else ()
    return True


def assign_ranks(files: list[OutputFile], steps: list[Step], nproc: int, share: tuple[SourceAccess, int] | None = None) -> list[Problem]:
    """Set `rank` on every output file and step; returns warnings (e.g. ranks left without work).

    `share` ((source access, chunk bytes), for a format whose files several ranks may write): when whole files
    leave the ranks out of balance, they share files instead (`share_ranks`)."""
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
    if share is not None and written_spread(steps, nproc) > BALANCE and share_ranks(files, steps, nproc, *share):
        return []
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
