"""A plan told to people: the headline lines panels show, the text summary (`str(plan)`) and notebook HTML.

`Plan` holds the data; these functions word it. Plain strings and `display`'s tables, no pandas.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ..display import format_bytes, format_count, format_decimal, html_table, text_table
from .extras import COPIED, GENERATED, SKIPPED, UPDATED
from .lanes import rank_lanes
from .schedule import COMPUTE, COPY, PIECES, ROWS

if TYPE_CHECKING:  # pragma: no cover
    from .model import Plan


def headline(plan: Plan) -> list[str]:
    """The summary's first lines (source, status, groups, reads and writes, memory): what panels show on top."""
    src = plan.source
    kinds: dict[str, int] = {}
    for s in plan.steps:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    kind_text = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    n_files = len(plan.output_file_list)
    reads = plan.reads()
    status = "OK" if plan.ok else f"{len(plan.errors)} error(s): cannot run"
    if plan.ok and plan.complete:
        status = f"OK: already complete, nothing to do ({plan.dest} holds this conversion's finished output)"
    where = plan.dest if plan.dest is not None else "(no destination)"
    if plan.remote is not None:
        where = f"{plan.remote.url} (through the local spool {plan.dest})"
    lines = [
        f"Plan: {src.location} ({src.format}, {len(src.files)} files, {len(src)} tensors, {format_bytes(src.total_bytes)})"
        f" -> {where}" + plan.output_format.label,
        f"status: {status}",
        f"groups: {len(plan.steps)} ({kind_text or 'none'}); outputs: {sum(f.n_tensors for f in plan.output_file_list)} "
        f"tensors, {format_bytes(plan.total_size)} in {format_count(n_files, 'file')} "
        + (f"(shard size {format_decimal(plan.options.shard_size)})" if plan.options.shard_size < 1 << 60 else "(no size limit)"),
        f"reads: {len(reads)} of {len(src.files)} source files, {format_bytes(sum(reads.values()))}; "
        + _writes(plan),
        *_download_lines(plan),
        f"RAM to provision: {format_bytes(plan.rss_bytes)} per process (predicted RSS); "
        f"peak tensor memory: {format_bytes(plan.peak_bytes)} per process; ranks: {plan.nproc}"
        + f"; {library_note(plan)}",
    ]
    if plan.remote is not None:
        from .spool import WHOLE_NO_HOLES, spool_route

        held = ("whole files waiting for upload: the spool folder cannot punch holes, so a file leaves it only once "
                "uploaded whole; --shard-size bounds a file" if spool_route(plan) == WHOLE_NO_HOLES
                else "finished files or parts waiting for upload")
        lines.append(f"local disk to provision: {format_bytes(plan.spool_bytes)} per rank (spool of {held}, "
                     f"--spool-size {format_bytes(plan.options.spool_size)}); the index is uploaded last")
    lines += _dequantised_lines(plan)
    lines += _extras_lines(plan)
    lines += _metadata_lines(plan)
    if plan.copied_objects:
        lines.append(f"non-tensor entries copied verbatim: {len(plan.copied_objects)}")
    return lines


def _dequantised_lines(plan: Plan) -> list[str]:
    """With quantised weights dequantised (`mapper.presets.quantized.DEQUANTIZING`): how many tensors are, an example,
    and how many are only copied, so a dry-run says which work is arithmetic and which is bytes. Binding such an op
    imported its module (its `infer`), so a plan without it imports nothing here."""
    import sys

    quantized = sys.modules.get("workbench.mapper.presets.quantized")
    if quantized is None or all(step.kind == COPY for step in plan.steps):
        return []
    dequantising = quantized.DEQUANTIZING
    dequantised: list[str] = []
    copied = 0
    for step in plan.steps:
        leaves = step.group.op.leaves() if hasattr(step.group.op, "leaves") else [step.group.op]
        if any(getattr(leaf, "fn", None) in dequantising for leaf in leaves):
            dequantised += [t.name for t in step.group.outputs]
        elif step.kind == COPY:
            copied += len(step.group.outputs)
    if not dequantised:
        return []
    return [f"dequantised: {len(dequantised)} tensors (e.g. {min(dequantised)}); copied as they are: {copied} tensors "
            "(plan.groups: label and kind per group)"]


def _writes(plan: Plan) -> str:
    """What the run writes, and why not more: finished shards of an interrupted run are kept; a finished
    conversion at the destination means nothing is written at all."""
    if plan.ok and plan.complete:
        return "writes: nothing (the destination already holds this conversion's finished output)"
    return f"writes: {format_bytes(plan.bytes_written)}" + (f" ({len(plan.kept)} shard(s) kept from an interrupted run)" if plan.kept else "")


def library_note(plan: Plan) -> str:
    """Which libraries the run imports, in words (`Plan.library_note`): start-up of torch costs seconds per process."""
    if plan.needs_torch:
        return "torch needed"
    if any(s.kind == ROWS for s in plan.steps):
        return "tensors converted by numpy in row chunks (no torch)"
    if any(s.kind != COPY for s in plan.steps):
        return "casts by numpy (torch only for chunks holding NaN)"
    lanes = max((len(lanes) for r in range(plan.nproc) if (lanes := rank_lanes(plan, r)) is not None), default=1)
    return "byte copies only (no torch)" + (f", {lanes} copy lanes per rank" if lanes > 1 else "")


def _download_lines(plan: Plan) -> list[str]:
    downloads = plan.downloads
    if downloads is None:
        return []
    total = sum(n for n, _ in downloads.values())
    requests = sum(k for _, k in downloads.values())
    per_file = ", ".join(f"{rel} {format_bytes(n)} in {k}" for rel, (n, k) in list(downloads.items())[:6])
    more = f" ... ({len(downloads)} files)" if len(downloads) > 6 else ""
    return [f"downloads: {format_bytes(total)} in {requests} range request(s) from {len(downloads)} file(s)"
            + (f" ({per_file}{more})" if per_file else "")]


def _extras_lines(plan: Plan) -> list[str]:
    lines = []
    copied = [e.path for e in plan.extra_files if e.action == COPIED and not e.reason]
    if copied:
        shown = ", ".join(copied[:20]) + (f" ... ({len(copied)} files)" if len(copied) > 20 else "")
        lines.append(f"extras copied: {shown}")
    lines += [f"extra copied unchanged: {e.path} ({e.reason})" for e in plan.extra_files if e.action == COPIED and e.reason]
    lines += [f"extra updated: {e.path} ({e.reason})" for e in plan.extra_files if e.action == UPDATED]
    lines += [f"extra generated: {e.path} ({e.reason})" for e in plan.extra_files if e.action == GENERATED]
    skipped = [e for e in plan.extra_files if e.action == SKIPPED]
    if skipped:
        lines.append("extras skipped: " + "; ".join(f"{e.path} ({e.reason})" for e in skipped[:10])
                     + (f" ... ({len(skipped)} in all)" if len(skipped) > 10 else ""))
    return lines


def _metadata_lines(plan: Plan) -> list[str]:
    meta = plan.header_metadata
    if meta is None or not meta.interesting:
        return []
    if not plan.output_format.keeps_header_metadata:
        return [f"source header metadata: dropped (a {plan.output_format.title} output has no header metadata)"]
    kept = sorted(k for k in meta.kept if k != "format")
    lines = [f"source header metadata kept: {', '.join(kept) if kept else 'none'}"]
    if meta.dropped:
        lines.append("source header metadata dropped: " + "; ".join(f"{k} ({why})" for k, why in sorted(meta.dropped.items())))
    return lines


def _file_rows(plan: Plan) -> list[tuple]:
    return [(f.name, format_bytes(f.size), f.n_tensors, f.rank, "kept" if f.kept else "") for f in plan.output_file_list]


def _read_rows(plan: Plan) -> list[tuple]:
    rows = []
    for rank in range(plan.nproc):
        for rel, n in plan.reads(rank).items():
            rows.append((rel, rank, format_bytes(n)))
    return rows


def summary(plan: Plan) -> str:
    """A text summary (`str(plan)`): headline numbers, output files, source files read, problems."""
    parts = ["\n".join(headline(plan))]
    if plan.output_file_list:
        parts.append("output files:\n" + text_table(["file", "size", "tensors", "rank", ""], _file_rows(plan)))
    reads = _read_rows(plan)
    if reads:
        parts.append("source files read:\n" + text_table(["file", "rank", "bytes read"], reads))
    for title, columns, rows in plan.output_details:
        parts.append(f"{title}:\n" + text_table(columns, rows))
    if plan.problems:
        parts.append("problems:\n" + "\n".join(f"  {p.severity}: {p.message}" for p in plan.problems))
    return "\n".join(parts)


def plan_html(plan: Plan) -> str:
    """The plan as HTML for a notebook (`Plan._repr_html_`): headline, problems, files, format tables, compute groups."""
    head = "".join(f"<div>{html.escape(line)}</div>" for line in headline(plan))
    parts = [f"<div><b>Conversion plan</b>{head}</div>"]
    if plan.problems:
        items = "".join(
            f"<li style='color:{'#b00' if p.severity == 'error' else '#a60'}'>{html.escape(p.severity)}: "
            f"{html.escape(p.message)}</li>"
            for p in plan.problems
        )
        parts.append(f"<ul>{items}</ul>")
    parts.append("<details open><summary>output files</summary>"
                 + html_table(["file", "size", "tensors", "rank", ""], _file_rows(plan)) + "</details>")
    parts.append("<details><summary>source files read</summary>"
                 + html_table(["file", "rank", "bytes read"], _read_rows(plan)) + "</details>")
    for title, columns, rows in plan.output_details:
        parts.append(f"<details><summary>{html.escape(title)}</summary>" + html_table(columns, rows) + "</details>")
    compute = [s for s in plan.steps if s.kind in (COMPUTE, PIECES)][:20]
    if compute:
        rows = [(s.index, s.group.label + (" (piece by piece)" if s.kind == PIECES else ""), format_bytes(s.held_bytes))
                for s in compute]
        parts.append("<details><summary>compute groups</summary>" + html_table(["step", "group", "held"], rows) + "</details>")
    return "".join(parts)
