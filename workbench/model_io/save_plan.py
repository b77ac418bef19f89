"""Which rank writes which output file of a distributed save, and what each rank holds at each step.

The planner's layout decides the bytes; this decides only who writes them. A file goes to the rank
the planner chose when that rank holds every tensor the file needs (after gathering), otherwise to
the least loaded rank that does, otherwise to the rank holding most of its bytes (the rest is sent
to it). Files that one group writes together stay together. The same rules predict the tensor
bytes each rank holds per step, which the run measures.
"""

from __future__ import annotations

from ..mapper.groups import Group
from ..planning.model import Plan
from ..planning.ranks import file_clusters
from .holdings import Holdings


def assign_writers(plan: Plan, holdings: Holdings, world: int) -> None:
    """Set `rank` on every output file and step of `plan` (before any per-rank view of it is used)."""
    files, steps = plan.output_file_list, plan.steps
    load = [0] * world
    for cluster in file_clusters(files, steps):
        step_ids = sorted({s for k in cluster for s in files[k].steps})
        inputs = [t for s in step_ids for t in steps[s].group.inputs]
        candidates = set(range(world))
        held_bytes = [0] * world
        for info in inputs:
            holders = holdings.holders(info.name)
            candidates &= holders
            for r in holders:
                held_bytes[r] += info.nbytes
        planned = files[cluster[0]].rank
        if planned in candidates:
            rank = planned
        elif candidates:
            rank = min(candidates, key=lambda r: (load[r], r))
        else:
            rank = max(range(world), key=lambda r: (held_bytes[r], -r))
        load[rank] += sum(files[k].tensor_bytes for k in cluster)
        for k in cluster:
            files[k].rank = rank
        for s in step_ids:
            steps[s].rank = rank


def input_route(key: str, writer: int, holdings: Holdings) -> tuple[bool, int | None]:
    """(gather?, sender): whether the key's source group gathers it, and which rank sends it to `writer`
    (None when the writer has it without receiving it)."""
    if writer in holdings.plain.get(key, ()):
        return False, None
    group = holdings.source_group[key]
    return True, (None if writer in group else min(group))


def step_hold(group: Group, writer: int, rank: int, holdings: Holdings) -> int:
    """Tensor bytes `rank` holds while a step runs: gathered or received inputs, computed outputs."""
    held = 0
    for info in group.inputs:
        gathers, sender = input_route(info.name, writer, holdings)
        if not gathers:
            continue
        if rank in holdings.source_group[info.name] and holdings.sharded[info.name]:
            held += info.nbytes  # the full tensor a DTensor gather allocates
        elif sender is not None and rank == writer:
            held += info.nbytes  # received
    if rank == writer and group.recipe is None:
        held += group.bytes_out
    return held


def predicted_peak(plan: Plan, holdings: Holdings, rank: int) -> int:
    """The largest step_hold of `rank` over the steps that run."""
    return max((step_hold(s.group, s.rank, rank, holdings) for s in plan.steps if plan.step_active(s)), default=0)
