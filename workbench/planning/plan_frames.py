"""A plan's tables as pandas DataFrames: outputs, files read, extras, output files, groups, memory, ranks, RSS.

`Plan` holds the data and answers per-rank questions; these functions lay that data out as tables. The plan
imports this module on the first table asked for, so runs that never show a table (the engine, the command line)
never import pandas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from .rss import rss_parts

if TYPE_CHECKING:  # pragma: no cover
    from .model import Plan

RANK_COLUMNS = ("rank", "files", "source_files", "bytes_read", "bytes_written", "peak_bytes", "groups")


def outputs_frame(plan: Plan) -> pd.DataFrame:
    """One row per output tensor: dtype, shape, nbytes, file, offset, rank, group label (`Plan.outputs`)."""
    placement = plan.placement
    rows = []
    for step in plan.steps:
        if step.part is not None and step.part[0]:  # a later part of a tensor several ranks write: listed once
            continue
        labels = getattr(step.group.recipe, "labels", None)  # a span run (`planning.span_runs`): each member's
        for k, t in enumerate(step.group.outputs):
            file, offset = placement[t.name]
            rows.append((t.name, t.dtype, t.shape, t.nbytes, file, offset, step.rank, step.group.label if labels is None else labels[k]))
    frame = pd.DataFrame(rows, columns=["name", "dtype", "shape", "nbytes", "file", "offset", "rank", "group"])
    return frame.set_index("name")


def files_read_frame(plan: Plan) -> pd.DataFrame:
    """One row per (source file, rank) the run opens: bytes read and tensors used from it (`Plan.files_read`)."""
    rows: dict[tuple[str, int], list[int]] = {}
    for step in plan.steps:
        if not plan.step_active(step):
            continue
        used: dict[str, int] = {}
        for t in step.group.inputs:
            used[t.file] = used.get(t.file, 0) + 1
        for rel, n in step.reads.items():
            row = rows.setdefault((rel, step.rank), [0, 0])
            row[0] += n
            row[1] += used.get(rel, 0)
    source = plan.source
    data = [
        (rel, rank, n, k, source.files[rel].size if rel in source.files else None, plan.source_location(rel))
        for (rel, rank), (n, k) in sorted(rows.items())
    ]
    frame = pd.DataFrame(data, columns=["file", "rank", "bytes_read", "tensors", "file_size", "path"])
    file_sources = getattr(source, "file_sources", None)
    if file_sources:  # several sources (workbench.formats.multi): say which one each file belongs to
        frame.insert(0, "source", frame["file"].map(file_sources))
    return frame


def extras_frame(plan: Plan) -> pd.DataFrame:
    """One row per non-tensor file or folder beside the weights: path, action, bytes, reason (`Plan.extras_table`)."""
    data = [(e.path, e.action, e.size, e.reason) for e in plan.extra_files]
    return pd.DataFrame(data, columns=["path", "action", "bytes", "reason"])


def output_files_frame(plan: Plan) -> pd.DataFrame:
    """One row per output shard: size, tensors, rank, whether it is kept from an earlier run (`Plan.output_files`)."""
    data = [(f.name, f.size, f.n_tensors, f.rank, f.kept) for f in plan.output_file_list]
    return pd.DataFrame(data, columns=["file", "size", "tensors", "rank", "kept"])


def groups_frame(plan: Plan) -> pd.DataFrame:
    """The schedule: one row per step in execution order with its bytes and memory (`Plan.groups`)."""
    data = [
        (
            s.index, s.rank, s.group.label, s.kind, len(s.group.inputs), len(s.group.outputs), s.group.bytes_in,
            s.group.bytes_out, s.bytes_read, s.held_bytes, ", ".join(s.files), ", ".join(s.reads), plan.step_active(s),
        )
        for s in plan.steps
    ]
    columns = ["step", "rank", "label", "kind", "inputs", "outputs", "bytes_in", "bytes_out", "bytes_read",
               "held_bytes", "files", "reads_from", "runs"]
    return pd.DataFrame(data, columns=columns).set_index("step")


def memory_frame(plan: Plan) -> pd.DataFrame:
    """The memory timeline per rank: tensor bytes held during each step and the running peak (`Plan.memory`)."""
    data, peaks = [], {}
    for s in plan.steps:
        if not plan.step_active(s):
            continue
        peaks[s.rank] = max(peaks.get(s.rank, 0), s.held_bytes)
        data.append((s.index, s.rank, s.group.label, s.kind, s.held_bytes, peaks[s.rank]))
    return pd.DataFrame(data, columns=["step", "rank", "label", "kind", "held_bytes", "peak_bytes"])


def ranks_frame(plan: Plan) -> pd.DataFrame:
    """One row per rank: files it writes and opens, bytes it moves, its predicted peak memory (`Plan.ranks`)."""
    rows = []
    for rank in range(plan.nproc):
        files = plan.rank_files(rank)
        reads = plan.reads(rank)
        rows.append((rank, [f.name for f in files], list(reads), sum(reads.values()), plan.rank_bytes_written(rank),
                     plan.rank_peak_bytes(rank), len(plan.rank_steps(rank))))
    return pd.DataFrame(rows, columns=list(RANK_COLUMNS))


def problems_frame(plan: Plan) -> pd.DataFrame:
    """Problems as a table: severity, op, tensor, message (`Plan.problems_frame`)."""
    return pd.DataFrame([(p.severity, p.op, p.tensor, p.message) for p in plan.problems],
                        columns=["severity", "op", "tensor", "message"])


def rss_frame(plan: Plan) -> pd.DataFrame:
    """The predicted RSS part by part, one bytes column per rank and the largest rank's `detail` (`Plan.rss_breakdown`)."""
    per_rank = {r: rss_parts(plan, r) for r in range(plan.nproc)}
    largest = max(per_rank, key=lambda r: sum(p.bytes for p in per_rank[r]))
    frame = pd.DataFrame({f"rank {r}" if plan.nproc > 1 else "bytes": [p.bytes for p in parts] for r, parts in per_rank.items()},
                         index=pd.Index([p.part for p in per_rank[largest]], name="part"))
    frame["detail"] = [p.detail for p in per_rank[largest]]
    return frame
