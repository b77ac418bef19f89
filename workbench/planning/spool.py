"""How much local disk a remote destination's spool needs: the bound `output/remote/spool.SpoolGate` keeps.

A rank's files are open from their first step to their last; the gate lets finished files wait for upload only
while everything fits in `spool_size`, and never waits on a file still being written. So a rank holds at most
`max(spool_size, the most bytes of files open at once)`, and never more than the files it writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import Plan


def open_bytes_peak(plan: Plan, rank: int) -> int:
    """The most bytes of `rank`'s output files open (first step done, last step not yet) at once."""
    files = {f.name: f.size for f in plan.rank_files(rank)}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for position, step in enumerate(plan.rank_steps(rank)):
        for name in step.files:
            if name in files:
                first.setdefault(name, position)
                last[name] = position
    events = sorted([(first[n], 0, files[n]) for n in first] + [(last[n], 1, -files[n]) for n in last])
    held = peak = 0
    for _, _, delta in events:  # at one position, opens (0) come before closes (1)
        held += delta
        peak = max(peak, held)
    return peak


def rank_spool_bytes(plan: Plan, rank: int) -> int:
    """The spool bound of `rank` (see the module docstring)."""
    total = sum(f.size for f in plan.rank_files(rank))
    if not total:
        return 0
    return min(total, max(plan.options.spool_size, open_bytes_peak(plan, rank)))
