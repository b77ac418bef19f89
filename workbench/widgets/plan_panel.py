"""`PlanPanel`: a conversion's dry-run made visible — one headline first (RAM to provision, the peak step
named by its tensor, bytes read and written, shards and their size spread, rank balance), problems and
warnings, then the predicted memory timeline and its peak, the source files read (and those never
opened), the output layout and the load of each rank.

Charts stay readable at any size: with many ranks the memory chart draws every rank's curve in one
colour and highlights the rank that peaks (a three-entry legend outside the plot, never one per rank);
files alike in size and share read are one bar "×N"; a timeline that holds no tensor data is a sentence.
Figures are transparent with mid-grey text, readable on JupyterLab's light and dark themes; the HTML
uses JupyterLab's CSS variables (with light fallbacks for a static copy).

Everything shown comes from the `Plan`, which is computed from headers alone: building the panel
reads no tensor data. The figures are rendered once to PNG, so the static HTML copy (what GitHub or a
notebook without a kernel shows) carries the same pictures as the live widget.
"""

from __future__ import annotations

import base64
import html
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from ..display import format_bytes
from .common import Panel, figure_png, frame_table, labelled, message_html

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from ..planning.model import Plan

FIGURE_DPI = 96  # the PNGs also go into the static copy: readable, yet small enough to keep in a notebook
MAX_BARS = 40  # files or ranks drawn in one bar chart; tables list them all (bounded by max_rows)
# Theme-neutral figure colours: mid-grey text has a contrast of about 4:1 on white and on JupyterLab's dark
# background; the series colours are mid-tones that stay visible on both (figures are transparent).
FIGURE_TEXT = "#808080"
HELD_COLOR = "#3b82f6"
PEAK_COLOR = "#e8590c"
OTHER_RANKS = "#8fa8c8"
READ_COLOR = "#3b82f6"
WRITE_COLOR = "#2f9e44"
HELD_MEANING = "held: tensor bytes in memory while the step runs"
PEAK_MEANING = "peak: the most held at any step (what tensors need)"
NOT_OPENED = "not opened"
TABS = ("Memory", "Files read", "Output layout", "Ranks")
TAB_IMAGES = {"Memory": "memory", "Files read": "files_read", "Ranks": "ranks"}  # tab title -> key in `images`
# HTML colours from JupyterLab's theme (light fallbacks for a static copy outside JupyterLab).
TEXT = "var(--jp-ui-font-color1, #212121)"
MUTED = "var(--jp-ui-font-color2, #616161)"
HEAD_LABEL = f"text-align:left;padding:1px 12px 1px 0;font-weight:600;font-size:12px;color:{TEXT};background:none;white-space:nowrap"
HEAD_VALUE = f"padding:1px 0;font-size:12px;color:{TEXT}"


# --- tables ------------------------------------------------------------------------------------------
def source_files_table(plan: Plan) -> pd.DataFrame:
    """One row per source file holding tensors: its size, the bytes the run reads from it (all ranks),
    the share that is, which ranks open it, how many tensors it feeds, and 'read' or 'not opened'."""
    import pandas as pd

    per_file = plan.files_read.groupby("file").agg(
        bytes_read=("bytes_read", "sum"), tensors=("tensors", "sum"), ranks=("rank", lambda r: ", ".join(map(str, sorted(r)))))
    rows = []
    for rel, info in sorted(plan.source.files.items()):
        read, tensors, ranks = per_file.loc[rel].to_list() if rel in per_file.index else (0, 0, "")
        share = read / info.size if info.size else 0.0
        rows.append((rel, info.size, int(read), share, ranks, int(tensors), "read" if read else NOT_OPENED))
    frame = pd.DataFrame(rows, columns=["file", "size", "bytes_read", "share", "ranks", "tensors", "status"])
    return frame.set_index("file")


def rank_load_table(plan: Plan) -> pd.DataFrame:
    """One row per rank: output files it writes, source files it opens, bytes it reads and writes,
    its predicted peak of tensor memory, the number of groups it runs and its predicted process RSS."""
    frame = plan.ranks.copy()
    frame["rss_bytes"] = [plan.rank_rss_bytes(int(r)) for r in frame["rank"]]
    frame["files"] = frame["files"].map(len)
    frame["source_files"] = frame["source_files"].map(len)
    return frame.rename(columns={"files": "output_files"}).set_index("rank")


def largest_steps_table(plan: Plan, count: int = 10) -> pd.DataFrame:
    """The `count` steps that hold the most tensor bytes (where the predicted peak comes from), each with
    the tensors it makes, its rank and its `rank step`: its place in that rank's schedule, the memory chart's x."""
    memory = plan.memory.copy()
    # where the step sits on the memory chart, whose axis is each rank's own schedule (0 = its first step)
    memory.insert(2, "rank step", memory.groupby("rank", sort=False).cumcount())
    top = memory.sort_values(["held_bytes", "step"], ascending=[False, True]).head(count).set_index("step")
    wanted = set(top.index)
    names = {s.index: _step_names(s) for s in plan.steps if s.index in wanted}
    top.insert(top.columns.get_loc("label"), "tensors", [names.get(i, "") for i in top.index])
    return top


def rss_table(plan: Plan) -> pd.DataFrame:
    """The predicted process memory of the rank that needs the most, part by part (bytes and where each comes from)."""
    import pandas as pd

    from ..planning.rss import rss_parts

    rank = max(range(plan.nproc), key=plan.rank_rss_bytes)
    parts = rss_parts(plan, rank)
    frame = pd.DataFrame([(p.part, p.bytes, p.detail) for p in parts], columns=["part", "bytes", "detail"]).set_index("part")
    frame.loc[f"total (rank {rank})" if plan.nproc > 1 else "total"] = (sum(p.bytes for p in parts), "plan.rss_bytes")
    return frame


# --- figures ------------------------------------------------------------------------------------------
def _figure(width: float, height: float) -> Any:
    import matplotlib.pyplot as plt

    # Detached from pyplot at once: shown only where the panel puts it, never again at the end of a cell.
    fig = plt.figure(figsize=(width, height), dpi=FIGURE_DPI, layout="constrained")
    plt.close(fig)
    return fig


def byte_unit(largest: float) -> tuple[float, str]:
    """The binary unit that suits an axis whose largest value is `largest` bytes: (bytes per unit, name)."""
    for scale, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def _note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color=FIGURE_TEXT, fontsize=10)


def neutral(fig: Any) -> Any:
    """Make a figure readable on light and dark backgrounds: transparent, grey text, ticks, spines and legends."""
    fig.patch.set_facecolor("none")
    for ax in fig.axes:
        ax.set_facecolor("none")
        ax.tick_params(colors=FIGURE_TEXT, which="both")
        for spine in ax.spines.values():
            spine.set_color(FIGURE_TEXT)
        for label in (ax.title, ax.xaxis.label, ax.yaxis.label):
            label.set_color(FIGURE_TEXT)
        for text in ax.texts:
            text.set_color(FIGURE_TEXT)
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]:
        legend.get_frame().set_facecolor("none")
        legend.get_frame().set_edgecolor(FIGURE_TEXT)
        for text in legend.get_texts():
            text.set_color(FIGURE_TEXT)
    return fig


def _step_names(step: Any, count: int = 2) -> str:
    names = [t.name for t in step.group.outputs[:count]]
    more = len(step.group.outputs) - count
    return ", ".join(names) + (f" (+{more} more)" if more > 0 else "")


def memory_timeline_figure(plan: Plan) -> Any | None:
    """Tensor bytes each rank holds during each of its steps (schedule order), the predicted peak, and the
    tensor the peak step makes; None when no step holds tensor data or every step holds the same (the
    panel says so in a sentence).

    Every rank's curve has one colour and the rank that peaks is highlighted, so the legend has three
    entries (outside the plot) whether there are 1 or 64 ranks.
    """
    from matplotlib.ticker import MaxNLocator

    from ..planning.rss import peak_step

    memory = plan.memory
    if memory.empty or plan.peak_bytes == 0 or memory["held_bytes"].nunique() == 1:
        return None  # nothing held, or the same at every step: a sentence says it better than a flat line
    fig = _figure(8.0, 3.6)
    ax = fig.add_subplot()
    ax.set_title(f"Predicted tensor memory per step: peak {format_bytes(plan.peak_bytes)} per process", fontsize=11)
    ax.set_xlabel("step of the rank's schedule (the table's 'rank step')")
    scale, unit = byte_unit(plan.peak_bytes)
    ax.set_ylabel(f"tensor data held ({unit})")
    top = peak_step(plan)
    top_rank = top.rank if top is not None else 0
    longest = 0
    many = plan.nproc > 1
    for rank, rows in memory.groupby("rank", sort=True):
        held = [n / scale for n in rows["held_bytes"]]
        longest = max(longest, len(held))
        if int(rank) == top_rank:
            continue
        ax.step(range(len(held) + 1), held + held[-1:], where="post", color=OTHER_RANKS, linewidth=1.0, alpha=0.8,
                label=f"{HELD_MEANING} (each of {plan.nproc} ranks)" if not ax.get_legend_handles_labels()[0] else None)
    rows = memory[memory["rank"] == top_rank]
    held = [n / scale for n in rows["held_bytes"]]
    who = f" (rank {top_rank}, the one that peaks)" if many else ""
    ax.step(range(len(held) + 1), held + held[-1:], where="post", color=HELD_COLOR, linewidth=1.6, label=HELD_MEANING + who)
    ax.axhline(plan.peak_bytes / scale, color=PEAK_COLOR, linestyle="--", linewidth=1,
               label=f"{PEAK_MEANING}: predicted peak {format_bytes(plan.peak_bytes)}")
    if top is not None:
        position = list(rows["step"]).index(top.index)
        left_half = position < len(held) / 2
        ax.annotate(f"peak: {_step_names(top, 1)}", xy=(position + 0.5, top.held_bytes / scale), xytext=(4 if left_half else -4, 6),
                    textcoords="offset points", ha="left" if left_half else "right", va="bottom", fontsize=8,
                    color=FIGURE_TEXT)
    ax.set_xlim(0, longest)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, plan.peak_bytes / scale * 1.3)
    fig.legend(fontsize=8, loc="outside lower center", ncols=1)
    ax.grid(alpha=0.3)
    return neutral(fig)


def name_range(first: str, last: str) -> str:
    """Two names written once with their differing middle braced: 'model-{00001…00048}-of-00048.safetensors'."""
    import os

    start = len(os.path.commonprefix([first, last]))
    while start and first[start - 1].isdigit():  # whole numbers in the braces: 000{01…48}, not 0000{1…8}
        start -= 1
    tail = len(os.path.commonprefix([first[start:][::-1], last[start:][::-1]]))
    while tail and first[len(first) - tail].isdigit():
        tail -= 1
    return f"{first[:start]}{{{first[start:len(first) - tail]}…{last[start:len(last) - tail]}}}{first[len(first) - tail:]}"


def file_groups(table: pd.DataFrame) -> pd.DataFrame:
    """Source files alike in status, size (to two significant digits) and share read (to 1 %), one row per
    kind: a label naming the first and last file and how many ("×N"), the mean size and bytes read. A 405B
    checkpoint's 191 shards make three rows."""
    import pandas as pd

    if table.empty:
        return pd.DataFrame(columns=["label", "count", "size", "bytes_read", "status"])
    keys = [
        (status, round(size, -max(0, len(str(int(size))) - 2)) if size else 0, round(share, 2))
        for size, share, status in zip(table["size"], table["share"], table["status"], strict=True)
    ]
    groups: dict[tuple, list[str]] = {}
    for key, name in zip(keys, table.index, strict=True):
        groups.setdefault(key, []).append(name)
    rows = []
    for names in groups.values():
        part = table.loc[names]
        status = part["status"].iloc[0]
        label = names[0] if len(names) == 1 else f"{name_range(names[0], names[-1])} (×{len(names)})"
        if status == NOT_OPENED:
            label += f" ({NOT_OPENED})"
        rows.append((label, len(names), float(part["size"].mean()), float(part["bytes_read"].mean()), status))
    return pd.DataFrame(rows, columns=["label", "count", "size", "bytes_read", "status"])


def files_read_figure(plan: Plan, table: pd.DataFrame | None = None) -> Any:
    """A bar per kind of source file (files alike in size and share read are one bar "×N"): its size, and
    over it the bytes the run reads; unopened files marked."""
    table = source_files_table(plan) if table is None else table
    grouped = file_groups(table)
    title = "Source files: bytes the run reads from each"
    if len(grouped) > MAX_BARS:
        shown = grouped.sort_values(["bytes_read", "size"], ascending=False).head(MAX_BARS)
        title += f" (the {MAX_BARS} most read kinds of {len(table)} files)"
    else:
        shown = grouped
    if len(grouped) < len(table):
        title += f"\n{len(table)} files, alike ones drawn once (×N)"
    fig = _figure(8.0, min(1.6 + 0.3 * len(shown), 14.0))
    ax = fig.add_subplot()
    fig.suptitle(title, fontsize=11, color=FIGURE_TEXT)  # over the figure: long file names narrow the axes
    if shown.empty:
        _note(ax, "the source holds no tensor files")
        return neutral(fig)
    scale, unit = byte_unit(float(shown["size"].max()))
    positions = list(range(len(shown)))
    ax.barh(positions, shown["size"] / scale, color=FIGURE_TEXT, alpha=0.3, label="file size")
    colors = [READ_COLOR if status == "read" else FIGURE_TEXT for status in shown["status"]]
    ax.barh(positions, shown["bytes_read"] / scale, color=colors, height=0.5, label="bytes read")
    ax.set_yticks(positions, list(shown["label"]), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit + (" (mean of each ×N bar)" if (shown["count"] > 1).any() else ""))
    fig.legend(fontsize=8, loc="outside lower center", ncols=2)
    ax.grid(axis="x", alpha=0.3)
    return neutral(fig)


def rank_load_figure(plan: Plan, table: pd.DataFrame | None = None) -> Any:
    """Bytes each rank reads and writes (side by side), to see how evenly the work is spread."""
    import numpy as np

    table = rank_load_table(plan) if table is None else table
    shown = table.head(MAX_BARS)
    fig = _figure(8.0, 2.8)
    ax = fig.add_subplot()
    more = f" (first {MAX_BARS} of {len(table)})" if len(table) > MAX_BARS else ""
    ax.set_title(f"Work per rank{more}", fontsize=11)
    scale, unit = byte_unit(float(max(shown["bytes_read"].max(), shown["bytes_written"].max(), 0)))
    x = np.arange(len(shown))
    ax.bar(x - 0.2, shown["bytes_read"] / scale, width=0.4, color=READ_COLOR, label="bytes read")
    ax.bar(x + 0.2, shown["bytes_written"] / scale, width=0.4, color=WRITE_COLOR, label="bytes written")
    ax.set_xticks(x, [f"rank {r}" for r in shown.index], fontsize=8)
    ax.set_ylabel(unit)
    fig.legend(fontsize=8, loc="outside right upper")
    ax.grid(axis="y", alpha=0.3)
    return neutral(fig)


# --- the headline ------------------------------------------------------------------------------------
def headline_facts(plan: Plan) -> list[tuple[str, str]]:
    """The few numbers a panel opens with, as (label, text): RAM to provision, the peak step named by its
    tensor, bytes read and written, shards and their size spread, rank balance."""
    from ..planning.rss import peak_step, rank_libraries

    facts = []
    ram = format_bytes(plan.rss_bytes) + " per process"
    if plan.nproc > 1:
        ram += f" × {plan.nproc} ranks"
    libraries = sorted({rank_libraries(plan, r) for r in range(plan.nproc)})
    imported = [name for name in libraries if name != "none"]
    ram += f" (predicted peak RSS: Python, {' and '.join(imported) if imported else 'no numpy or torch'}, tensors)"
    facts.append(("RAM to provision", ram))
    top = peak_step(plan)
    if top is None or not top.held_bytes:
        facts.append(("Peak step", "none: every step copies bytes between files, no tensor data is held"))
    else:
        position = [s.index for s in plan.steps if s.rank == top.rank and plan.step_active(s)].index(top.index)
        where = f"rank {top.rank}'s step {position}" if plan.nproc > 1 else f"rank step {position}"
        facts.append(("Peak step", f"{format_bytes(top.held_bytes)} of tensors at step {top.index} ({where} on the "
                                   f"memory chart; {top.kind}: {_step_names(top)})"))
    reads = plan.reads()
    facts.append(("Reads / writes", f"{format_bytes(plan.bytes_read)} from {len(reads)} of {len(plan.source.files)} "
                                    f"source files / {format_bytes(plan.bytes_written)}"))
    sizes = [f.size for f in plan.output_file_list]
    if sizes:
        spread = format_bytes(min(sizes)) if min(sizes) == max(sizes) else f"{format_bytes(min(sizes))} – {format_bytes(max(sizes))}"
        facts.append(("Output", f"{len(sizes)} shard{'s' if len(sizes) != 1 else ''}, {spread} each"
                                + (" (already complete at the destination: nothing is written)" if plan.complete
                                   else f" ({len(plan.kept)} kept from an interrupted run)" if plan.kept else "")))
    if plan.nproc > 1:
        written = [plan.rank_bytes_written(r) for r in range(plan.nproc)]
        mean = sum(written) / len(written)
        idle = sum(1 for n in written if n == 0)
        balance = (f"the busiest rank writes {max(written) / mean:.2f}× the mean ({format_bytes(max(written))})"
                   if mean else "no rank writes anything")
        facts.append(("Rank balance", balance + (f"; {idle} rank(s) idle" if idle else "")))
    else:
        facts.append(("Rank balance", "one process"))
    return facts


# --- the panel ----------------------------------------------------------------------------------------
def problems_html(plan: Plan) -> str:
    """Errors then warnings, one coloured line each (naming the op and tensor), or an all-clear line."""
    if not plan.problems:
        return message_html("No problems: the plan can run.", "ok")
    lines = []
    if not plan.ok:
        lines.append(message_html(f"{len(plan.errors)} error(s): this conversion cannot run until they are fixed.", "error"))
    for problem in plan.errors + plan.warnings:
        where = " — ".join(part for part in (problem.op, problem.tensor) if part)
        text = f"{problem.severity}: {problem.message}" + (f" [{where}]" if where else "")
        lines.append(message_html(text, problem.severity))
    return "".join(lines)


def _png_html(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" style="max-width:100%" src="data:image/png;base64,{data}"/>'


class PlanPanel(Panel):
    """The dry-run of a conversion (`wb.plan(...)`) as a notebook panel.

    Problems and warnings sit at the top; tabs show the memory timeline with the predicted peak,
    the source files read (table and bar chart; files never opened are marked), the output layout
    (shards and tensors) and the load of each rank. `images` holds the PNG of each figure, `tables`
    the DataFrames shown; `max_rows` bounds every table.
    """

    def __init__(self, plan: Plan, *, max_rows: int = 50) -> None:
        from ..planning.model import Plan as PlanType

        if not isinstance(plan, PlanType):
            from ..errors import PlanError

            raise PlanError(
                f"Cannot show a PlanPanel for {type(plan).__name__}: it takes a plan. Make one with "
                "wb.plan(source, mapper, ...) and pass it in."
            )
        self.plan = plan
        self.max_rows = max_rows
        self.tables: dict[str, pd.DataFrame] = {
            "memory": largest_steps_table(plan),
            "rss": rss_table(plan),
            "files_read": source_files_table(plan),
            "output_files": plan.output_files.set_index("file"),
            "outputs": plan.outputs,
            "ranks": rank_load_table(plan),
        }
        self.images: dict[str, bytes] = {}
        timeline = memory_timeline_figure(plan)
        if timeline is not None:  # no tensor data held: the Memory tab says so in a sentence, not a flat chart
            self.images["memory"] = figure_png(timeline)
        self.images["files_read"] = figure_png(files_read_figure(plan, self.tables["files_read"]))
        self.images["ranks"] = figure_png(rank_load_figure(plan, self.tables["ranks"]))
        self.headline = labelled(widgets.HTML(self._headline_html()), "wb-plan-headline")
        self.problems_view = labelled(widgets.HTML(problems_html(plan)), "wb-plan-problems")
        sections = self._sections()
        self.tabs = labelled(
            widgets.Tab(children=[widgets.VBox(children) for _, children in sections], titles=[t for t, _ in sections]),
            "wb-plan-tabs",
        )
        super().__init__([self.headline, self.problems_view, self.tabs])
        self.add_class("wb-plan")

    # --- identity ----------------------------------------------------------------------------------
    def _describe(self) -> str:
        plan = self.plan
        status = "ok" if plan.ok else f"{len(plan.errors)} error(s)"
        return (f"PlanPanel: {len(plan.steps)} groups -> {len(plan.output_file_list)} files on {plan.nproc} rank(s), "
                f"peak {format_bytes(plan.peak_bytes)}, {status}")

    def _headline_html(self) -> str:
        facts = "".join(
            f"<tr><th style='{HEAD_LABEL}'>{html.escape(label)}</th><td style='{HEAD_VALUE}'>{html.escape(text)}</td></tr>"
            for label, text in headline_facts(self.plan)
        )
        details = "<br>".join(html.escape(line) for line in self.plan.headline())
        return (f"<div class='wb-plan-head' style='color:{TEXT}'><b>Conversion plan</b>"
                f"<table class='wb-plan-facts' style='border-collapse:collapse;margin:2px 0'>{facts}</table>"
                f"<details><summary style='color:{MUTED};font-size:12px'>details</summary>"
                f"<div style='font-size:12px;color:{MUTED};line-height:1.45'>{details}</div></details></div>")

    # --- contents ----------------------------------------------------------------------------------
    def _table(self, key: str, noun: str, formatters: dict[str, Any] | None = None) -> str:
        return frame_table(self.tables[key], max_rows=self.max_rows, noun=noun, formatters=formatters)

    def _section_html(self) -> dict[str, list[str]]:
        """Each tab's content as HTML fragments; the live tabs and the static copy are built from them."""
        size = {c: format_bytes for c in ("size", "bytes_read", "bytes_written", "held_bytes", "peak_bytes", "nbytes", "rss_bytes",
                                          "bytes")}
        plan = self.plan
        if plan.index is None:
            layout_note = "One file, model.safetensors: no index."
        else:
            layout_note = (f"{len(plan.output_file_list)} shards and model.safetensors.index.json "
                           f"({len(plan.index['weight_map'])} entries, written last as the commit marker).")
        if plan.complete:
            layout_note += " The destination already holds this conversion's finished output: running it writes nothing."
        elif plan.kept:
            layout_note += f" {len(plan.kept)} shard(s) are kept from an interrupted run of this plan."
        return {
            "Memory": [
                message_html(f"Every step holds {format_bytes(plan.peak_bytes)} of tensor data, so there is no "
                             "memory chart.") if "memory" not in self.images else "",
                message_html(f"Predicted peak: {format_bytes(plan.peak_bytes)} of tensor data per process, "
                             f"{format_bytes(plan.rss_bytes)} of process memory (RSS) with Python and its libraries. "
                             "held_bytes is what one step keeps in memory while it runs (its input buffers, cast arena "
                             "and outputs); peak_bytes is the most held by that rank so far: the largest is what "
                             "tensors need. Steps holding the most:"),
                self._table("memory", "steps", size),
                message_html("Process memory (RSS) to provision, part by part:"),
                self._table("rss", "parts", size),
            ] if plan.peak_bytes else [
                message_html(f"Predicted peak: 0 B of tensor data: every step moves bytes between files without "
                             f"holding tensors in memory, so there is no memory chart. Process memory (RSS): "
                             f"{format_bytes(plan.rss_bytes)} per process, part by part:"),
                self._table("rss", "parts", size),
            ],
            "Files read": [
                message_html(f"The run opens {int((self.tables['files_read']['status'] == 'read').sum())} of "
                             f"{len(self.tables['files_read'])} source files and reads {format_bytes(plan.bytes_read)}."),
                self._table("files_read", "source files", {**size, "share": lambda v: f"{v:.0%}"}),
            ],
            "Output layout": [
                message_html(layout_note),
                self._table("output_files", "output files", size),
                self._table("outputs", "output tensors", size),
            ],
            "Ranks": [self._table("ranks", "ranks", size)],
        }

    def _sections(self) -> list[tuple[str, list[widgets.Widget]]]:
        html_parts = self._section_html()
        picture_layout = {"max_width": "100%", "align_self": "flex-start"}  # natural size, never stretched
        self.image_views: dict[str, widgets.Image] = {
            key: labelled(widgets.Image(value=self.images[key], format="png", layout=widgets.Layout(**picture_layout)),
                          f"wb-plan-{key.replace('_', '-')}-plot")
            for key in TAB_IMAGES.values() if key in self.images
        }
        sections = []
        for title in TABS:
            children: list[widgets.Widget] = []
            if TAB_IMAGES.get(title) in self.image_views:
                children.append(self.image_views[TAB_IMAGES[title]])
            children.append(widgets.HTML("".join(html_parts[title]), layout=widgets.Layout(max_height="420px", overflow="auto")))
            sections.append((title, children))
        return sections

    def _repr_html_(self) -> str:
        parts = [f'<div class="wb-plan-static">{self._headline_html()}', problems_html(self.plan)]
        for title, fragments in self._section_html().items():
            picture = _png_html(self.images[TAB_IMAGES[title]], title) if TAB_IMAGES.get(title) in self.images else ""
            parts.append(f"<details open><summary><b>{html.escape(title)}</b></summary>{picture}{''.join(fragments)}</details>")
        return "".join(parts) + "</div>"


__all__ = [
    "PlanPanel", "byte_unit", "file_groups", "files_read_figure", "headline_facts", "name_range", "neutral", "largest_steps_table", "memory_timeline_figure", "problems_html",
    "rank_load_figure", "rank_load_table", "rss_table", "source_files_table",
]
