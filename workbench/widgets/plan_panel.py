"""`PlanPanel`: a conversion's dry-run made visible — problems and warnings first, then the predicted
memory timeline and its peak, the source files read (and those never opened), the output layout and
the load of each rank.

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
RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
NOT_OPENED = "not opened"
TABS = ("Memory", "Files read", "Output layout", "Ranks")
TAB_IMAGES = {"Memory": "memory", "Files read": "files_read", "Ranks": "ranks"}  # tab title -> key in `images`


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
    its predicted peak of tensor memory and the number of groups it runs."""
    frame = plan.ranks.copy()
    frame["files"] = frame["files"].map(len)
    frame["source_files"] = frame["source_files"].map(len)
    return frame.rename(columns={"files": "output_files"}).set_index("rank")


def largest_steps_table(plan: Plan, count: int = 10) -> pd.DataFrame:
    """The `count` steps that hold the most tensor bytes (where the predicted peak comes from)."""
    memory = plan.memory
    return memory.sort_values(["held_bytes", "step"], ascending=[False, True]).head(count).set_index("step")


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
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#555", fontsize=10)


def memory_timeline_figure(plan: Plan) -> Any:
    """Tensor bytes each rank holds during each of its steps (schedule order), with the predicted peak."""
    from matplotlib.ticker import MaxNLocator

    memory = plan.memory
    fig = _figure(8.0, 3.2)
    ax = fig.add_subplot()
    ax.set_title(f"Predicted tensor memory per step: peak {format_bytes(plan.peak_bytes)} per process", fontsize=11)
    ax.set_xlabel("step of the rank's schedule")
    scale, unit = byte_unit(plan.peak_bytes)
    ax.set_ylabel(f"tensor data held ({unit})")
    if memory.empty:
        _note(ax, "nothing to run")
        return fig
    longest = 0
    for rank, rows in memory.groupby("rank", sort=True):
        color = RANK_COLORS[int(rank) % len(RANK_COLORS)]
        held = [n / scale for n in rows["held_bytes"]]
        longest = max(longest, len(held))
        who = f"rank {rank} " if plan.nproc > 1 else ""
        ax.step(range(len(held) + 1), held + held[-1:], where="post", color=color, linewidth=1.4, label=f"{who}held".strip())
        peak = plan.rank_peak_bytes(int(rank))
        ax.axhline(peak / scale, color=color, linestyle="--", linewidth=1, label=f"{who}predicted peak {format_bytes(peak)}")
    ax.set_xlim(0, longest)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if plan.peak_bytes == 0:
        ax.set_ylim(0, 1)
        ax.set_yticks([0])
        _note(ax, "byte copies only: no tensor data is held in memory")
    else:
        ax.set_ylim(0, plan.peak_bytes / scale * 1.25)
    ax.legend(fontsize=8, loc="upper right", ncols=2 if plan.nproc > 1 else 1)
    ax.grid(alpha=0.3)
    return fig


def files_read_figure(plan: Plan, table: pd.DataFrame | None = None) -> Any:
    """A bar per source file: its size, and over it the bytes the run reads; unopened files marked."""
    table = source_files_table(plan) if table is None else table
    title = "Source files: bytes the run reads from each"
    if len(table) > MAX_BARS:
        shown = table.sort_values(["bytes_read", "size"], ascending=False).head(MAX_BARS).sort_index()
        title += f" (the {MAX_BARS} most read of {len(table)} files)"
    else:
        shown = table
    fig = _figure(8.0, min(1.4 + 0.3 * len(shown), 14.0))
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    if shown.empty:
        _note(ax, "the source holds no tensor files")
        return fig
    scale, unit = byte_unit(float(shown["size"].max()))
    positions = list(range(len(shown)))
    ax.barh(positions, shown["size"] / scale, color="#dddddd", label="file size")
    colors = ["#4C72B0" if status == "read" else "#bbbbbb" for status in shown["status"]]
    ax.barh(positions, shown["bytes_read"] / scale, color=colors, height=0.5, label="bytes read")
    labels = [f"{name} ({NOT_OPENED})" if status == NOT_OPENED else name
              for name, status in zip(shown.index, shown["status"], strict=True)]
    ax.set_yticks(positions, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return fig


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
    ax.bar(x - 0.2, shown["bytes_read"] / scale, width=0.4, color="#4C72B0", label="bytes read")
    ax.bar(x + 0.2, shown["bytes_written"] / scale, width=0.4, color="#55A868", label="bytes written")
    ax.set_xticks(x, [f"rank {r}" for r in shown.index], fontsize=8)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


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
            "files_read": source_files_table(plan),
            "output_files": plan.output_files.set_index("file"),
            "outputs": plan.outputs,
            "ranks": rank_load_table(plan),
        }
        self.images: dict[str, bytes] = {
            "memory": figure_png(memory_timeline_figure(plan)),
            "files_read": figure_png(files_read_figure(plan, self.tables["files_read"])),
            "ranks": figure_png(rank_load_figure(plan, self.tables["ranks"])),
        }
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
        lines = self.plan.headline()
        body = "<br>".join(html.escape(line) for line in lines)
        return f"<b>Conversion plan</b><div style='font-size:12px;color:var(--jp-ui-font-color2,#555);line-height:1.45'>{body}</div>"

    # --- contents ----------------------------------------------------------------------------------
    def _table(self, key: str, noun: str, formatters: dict[str, Any] | None = None) -> str:
        return frame_table(self.tables[key], max_rows=self.max_rows, noun=noun, formatters=formatters)

    def _section_html(self) -> dict[str, list[str]]:
        """Each tab's content as HTML fragments; the live tabs and the static copy are built from them."""
        size = {c: format_bytes for c in ("size", "bytes_read", "bytes_written", "held_bytes", "peak_bytes", "nbytes")}
        plan = self.plan
        if plan.index is None:
            layout_note = "One file, model.safetensors: no index."
        else:
            layout_note = (f"{len(plan.output_file_list)} shards and model.safetensors.index.json "
                           f"({len(plan.index['weight_map'])} entries, written last as the commit marker).")
        if plan.kept:
            layout_note += f" {len(plan.kept)} shard(s) are kept from an interrupted run of this plan."
        return {
            "Memory": [
                message_html(f"Predicted peak: {format_bytes(plan.peak_bytes)} of tensor data per process. "
                             "Steps holding the most:"),
                self._table("memory", "steps", size),
            ] if plan.peak_bytes else [
                message_html("Predicted peak: 0 B of tensor data: every step moves bytes between files without "
                             "holding tensors in memory."),
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
            for key in TAB_IMAGES.values()
        }
        sections = []
        for title in TABS:
            children: list[widgets.Widget] = []
            if title in TAB_IMAGES:
                children.append(self.image_views[TAB_IMAGES[title]])
            children.append(widgets.HTML("".join(html_parts[title]), layout=widgets.Layout(max_height="420px", overflow="auto")))
            sections.append((title, children))
        return sections

    def _repr_html_(self) -> str:
        parts = [f'<div class="wb-plan-static">{self._headline_html()}', problems_html(self.plan)]
        for title, fragments in self._section_html().items():
            picture = _png_html(self.images[TAB_IMAGES[title]], title) if title in TAB_IMAGES else ""
            parts.append(f"<details open><summary><b>{html.escape(title)}</b></summary>{picture}{''.join(fragments)}</details>")
        return "".join(parts) + "</div>"


__all__ = [
    "PlanPanel", "byte_unit", "files_read_figure", "largest_steps_table", "memory_timeline_figure", "problems_html",
    "rank_load_figure", "rank_load_table", "source_files_table",
]
