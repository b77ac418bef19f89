"""`Explorer`: browse a checkpoint's tensors in a notebook — filter, fold layers, sort, pick a tensor for
its details and (on request) value statistics and histogram, see where the bytes are, and diff against
a second checkpoint.

Everything shown comes from `workbench.explore.checkpoint.Checkpoint`; the widget only chooses what to ask for and
keeps tables bounded (the first `max_rows` rows and a count), so a 100k-tensor checkpoint stays usable.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd

from ..display import format_bytes, format_count, format_shape
from ..errors import WorkbenchError
from ..explore.layers import PLACEHOLDERS, Fold, fold_name
from ..names import name_filter, no_match_hint
from .background import BackgroundTask
from .common import (
    TABLE_STYLE,
    Panel,
    fit_narrow,
    frame_table,
    labelled,
    message_html,
    replace_output,
    set_options,
)
from .table import DataTable

MATCH_MODES = ("glob", "regex")
SORT_KEYS = {
    "name": "name (natural order)",
    "disk": "on-disk order",
    "nbytes": "bytes",
    "numel": "elements",
    "dtype": "dtype",
    "file": "file",
}
DEFAULT_ROWS = 50
MAX_PICKS = 1000  # tensors offered in the picker (members of the shown rows)
LIVE_FILTER_LIMIT = 20_000  # above this many tensors the filter applies on Enter, not on every keystroke
TABLE_HEIGHT = "420px"
# Table columns whose header click sorts through the Sort control (the others sort as plain values).
HEADER_SORT_KEYS = {"pattern": "name", "name": "name", "nbytes": "nbytes", "numel": "numel", "dtype": "dtype", "file": "file"}
ROW_COLUMNS = ["dtype", "shape", "numel", "nbytes", "file"]  # then the format's own columns (stage, chunks ...)
_DIGITS = re.compile(r"[0-9]+")
BACKGROUND_BYTES = 32 << 20  # clicked reads larger than this run in the background (bar, Cancel)
READ_CHUNK_ELEMENTS = 1 << 19  # elements per chunk of a clicked read (2 MiB of F32): Cancel is honoured within one chunk


def name_mask(names: pd.Index, text: str, mode: str = "glob") -> np.ndarray:
    """Which names a filter keeps: in 'glob' mode the package's one filter rule (`workbench.names.name_filter`:
    the whole name or a run of its dotted segments, with `*` globs and `{i}` placeholders, so
    `layers.{i}.self_attn.*` keeps `model.layers.0.self_attn.q_proj.weight`); in 'regex' mode `re.search`.

    Raises WorkbenchError for an invalid regular expression or a malformed placeholder.
    """
    text = text.strip()
    if not text:
        return np.ones(len(names), dtype=bool)
    if mode == "regex":
        try:
            pattern = re.compile(text)
        except re.error as exc:
            raise WorkbenchError(f"Cannot filter by regex '{text}': {exc}. Fix the expression or switch to glob.") from None
        return np.fromiter((pattern.search(n) is not None for n in names), dtype=bool, count=len(names))
    keep = name_filter(text)
    return np.fromiter((keep(n) for n in names), dtype=bool, count=len(names))


def _is_blank(value: Any) -> bool:
    """True for a missing or empty per-tensor fact (None, NaN, <NA>, '')."""
    return value is None or value == "" or (not isinstance(value, (str, tuple, list)) and bool(pd.isna(value)))


def _cell_or_blank(value: Any) -> Any:
    """A format column's cell, with missing values (None, NaN, <NA>) as an empty cell."""
    if value is None or isinstance(value, (str, tuple, list)):
        return "" if value is None else value
    return "" if pd.isna(value) is True else value


def _shared_values(column: pd.Series, patterns: pd.Series) -> pd.Series:
    """A format column folded by layer pattern: the value all members share, else 'k values'."""
    frame = pd.DataFrame({"value": column.astype(object).to_numpy(), "pattern": patterns.to_numpy()})
    grouped = frame.groupby("pattern", sort=False)["value"]
    distinct = grouped.nunique(dropna=False)
    first = grouped.first()
    return first.where(distinct <= 1, distinct.map(lambda k: f"{k} values")).astype(object)


class Explorer(Panel):
    """An interactive view of one checkpoint (and optionally its differences from `compare`).

    `checkpoint` and `compare` are paths, `Checkpoint`s or `Catalog`s. Controls are public attributes
    (`filter_box`, `match_mode`, `fold_toggle`, `sort_by`, `descending`, `max_rows`, `tensor_picker`,
    `stats_button`, `histogram_button`, `bytes_by`, `plot_button`, `diff_status`, `values_button`,
    `verify_button`), so a notebook or a test can drive it like a user. `rows` is the full filtered table;
    `table` (a `DataTable`) shows it a page at a time (`max_rows` per page): a header click sorts, a row
    click picks that tensor (the first matching member of a folded pattern) for the details below.
    Large reads run in the background: `task` (stats, histograms), `diff_task` (values), `verify_task`.
    """

    def __init__(self, checkpoint: Any, compare: Any = None, *, max_rows: int = DEFAULT_ROWS) -> None:
        from ..explore.checkpoint import open_checkpoint

        self.checkpoint = open_checkpoint(checkpoint)
        self.other = open_checkpoint(compare) if compare is not None else None
        self._templates: pd.Series | None = None
        self._natural: pd.Series | None = None
        self._numbers: list[tuple[int, ...]] = []
        self._ranges: dict[str, str] = {}
        self._stats_cache: dict[str, pd.DataFrame] = {}
        self._diff_cache: dict[bool, pd.DataFrame] = {}
        self._bytes_drawn: str | None = None
        self.rows: pd.DataFrame = self.checkpoint.tensors.iloc[:0]
        self.error: str | None = None
        self._quiet = False

        live = len(self.checkpoint) <= LIVE_FILTER_LIMIT
        self.filter_box = labelled(
            widgets.Text(
                placeholder="filter: mlp, *.mlp.*, layers.{i}.self_attn.*, or a regex",
                description="Filter",
                continuous_update=live,
                layout=widgets.Layout(width="420px"),
            ),
            "wb-explorer-filter",
        )
        self.match_mode = labelled(widgets.Dropdown(options=MATCH_MODES, value="glob", layout=widgets.Layout(width="90px")), "wb-explorer-mode")
        self.fold_toggle = labelled(widgets.Checkbox(value=True, description="fold layers (×N)", indent=False), "wb-explorer-fold")
        self.sort_by = labelled(
            widgets.Dropdown(options=[(label, key) for key, label in SORT_KEYS.items()], value="name", description="Sort",
                             layout=widgets.Layout(width="240px")),
            "wb-explorer-sort",
        )
        self.descending = widgets.Checkbox(value=False, description="descending", indent=False, layout=widgets.Layout(width="110px"))
        self.max_rows = labelled(
            widgets.BoundedIntText(value=max_rows, min=1, max=10_000, description="Per page", layout=widgets.Layout(width="160px")),
            "wb-explorer-per-page",
        )
        self.count_label = labelled(widgets.HTML(), "wb-explorer-count")
        self.table = DataTable(page_size=max_rows, css_class="wb-explorer-table", sort_handler=self._sort_from_header)
        self._matched: pd.DataFrame = self.rows
        self._syncing_selection = False
        self._refreshing = False

        self.tensor_picker = labelled(
            widgets.Dropdown(options=[], value=None, description="Tensor", layout=widgets.Layout(width="560px")), "wb-explorer-pick"
        )
        self.stats_button = labelled(widgets.Button(description="Value stats", icon="calculator", tooltip="read the tensor and compute min/max/mean/std"), "wb-explorer-stats")
        self.histogram_button = labelled(widgets.Button(description="Histogram", icon="bar-chart", tooltip="read the tensor and plot its values"), "wb-explorer-hist")
        self.details = labelled(widgets.HTML(), "wb-explorer-details")
        self.stats_view = widgets.HTML()
        self.histogram_output = widgets.Output()
        self.task = labelled(BackgroundTask(), "wb-explorer-task")  # value stats and histograms of large tensors

        self.bytes_by = labelled(widgets.ToggleButtons(options=["layer", "file", "dtype"], value="layer", description="Bytes by"), "wb-explorer-bytes-by")
        # not shown: choosing "Bytes by" or opening the tab draws the chart; kept for code that clicks it
        self.plot_button = widgets.Button(description="Plot", icon="refresh")
        self.bytes_table = DataTable(page_size=20, css_class="wb-explorer-bytes-table", selectable=False)
        self.bytes_output = labelled(widgets.Output(), "wb-explorer-bytes-chart")

        tensors_tab = widgets.VBox(
            [
                widgets.HBox([self.filter_box, self.match_mode, self.fold_toggle]),
                widgets.HBox([self.sort_by, self.descending, self.max_rows]),
                self.count_label,
                self.table,
                widgets.HBox([self.tensor_picker, self.stats_button, self.histogram_button]),
                self.task,
                self.details,
                self.stats_view,
                self.histogram_output,
            ]
        )
        bytes_tab = widgets.VBox([self.bytes_by, self.bytes_output, self.bytes_table])
        children: list[widgets.Widget] = [tensors_tab, bytes_tab]
        titles = ["Tensors", "Bytes"]
        if self.other is not None:
            self.diff_status = labelled(widgets.Dropdown(options=["all"], value="all", description="Show"), "wb-explorer-diff-status")
            self.values_button = labelled(
                widgets.Button(description="Compare values", icon="balance-scale", tooltip="read both sides and compare tensor values"),
                "wb-explorer-values",
            )
            self.diff_summary = widgets.HTML()
            self.diff_table = DataTable(page_size=max_rows, css_class="wb-explorer-diff")
            self.diff_task = labelled(BackgroundTask(), "wb-explorer-diff-task")  # comparing values of large checkpoints
            children.append(widgets.VBox([widgets.HBox([self.diff_status, self.values_button]), self.diff_task,
                                          self.diff_summary, self.diff_table]))
            titles.append("Compare")
        self.tabs = widgets.Tab(children=children, titles=titles)
        header = widgets.HTML(self._header_html())
        self.verify_button = labelled(widgets.Button(description="Verify", icon="check", tooltip="check headers, index and "
                                                     "file sizes; with a checksum sidecar, re-hash every tensor"), "wb-explorer-verify")
        self.verify_task = labelled(BackgroundTask(), "wb-explorer-verify-task")  # re-hashing tensors against a checksum sidecar
        self.verify_view = labelled(widgets.HTML(), "wb-explorer-verified")
        self.verify_button.on_click(lambda _: self.verify())
        parts = [widgets.HBox([header, self.verify_button]), self.verify_task, self.verify_view, self.tabs]
        fit_narrow(*parts)
        super().__init__(parts)
        self.add_class("wb-explorer")

        for control in (self.filter_box, self.match_mode, self.fold_toggle, self.sort_by, self.descending):
            control.observe(self._on_query_change, names="value")
        widgets.link((self.max_rows, "value"), (self.table, "page_size"))
        self.table.observe(self._on_page_shown, names="row_keys")
        self.table.observe(self._on_row_click, names="selected")
        self.tensor_picker.observe(self._on_pick, names="value")
        self.task.on_state(lambda _running: self._sync_read_buttons())  # one read at a time
        self.stats_button.on_click(lambda _: self.show_stats())
        self.histogram_button.on_click(lambda _: self.show_histogram())
        self.plot_button.on_click(lambda _: self.plot_bytes(force=True))
        self.bytes_by.observe(lambda _: self.plot_bytes(), names="value")
        self.tabs.observe(self._on_tab, names="selected_index")
        if self.other is not None:
            self.diff_status.observe(lambda _: None if self._quiet else self.refresh_diff(), names="value")
            self.values_button.on_click(lambda _: self.refresh_diff(values=True))
            widgets.link((self.max_rows, "value"), (self.diff_table, "page_size"))
            self.diff_table.observe(self._on_diff_row_click, names="selected")
        self.refresh()

    # --- identity ----------------------------------------------------------------------------------
    def _describe(self) -> str:
        ck = self.checkpoint
        other = f", compared with {self.other.path.name}" if self.other is not None else ""
        return f"Explorer of {ck.path.name}: {len(ck):,} tensors ({ck.format}){other}"

    def _header_html(self) -> str:
        ck = self.checkpoint
        other = ""
        if self.other is not None:
            other = f" — compared with <code>{html.escape(self.other.location)}</code>"
        return (
            f"<b>Explorer</b> <code>{html.escape(ck.location)}</code> ({html.escape(ck.format)}){other}<br>"
            f'{TABLE_STYLE}<span class="wb-note">{html.escape(ck.headline())}</span>'
        )

    # --- the table ---------------------------------------------------------------------------------
    def _template_of(self) -> pd.Series:
        """Each tensor's layer template (computed once for all names)."""
        if self._templates is None:
            index = self.checkpoint.tensors.index
            folded = [fold_name(n) for n in index]
            self._templates = pd.Series([t for t, _ in folded], index=index, dtype=object)
            self._numbers = [numbers for _, numbers in folded]
        return self._templates

    def _natural_rank(self) -> pd.Series:
        """Each tensor's position in natural name order ('layers.10' after 'layers.9'), computed once."""
        if self._natural is None:
            index = self.checkpoint.tensors.index
            padded = pd.Series(index, dtype=object).str.replace(_DIGITS, lambda m: m.group().zfill(20), regex=True)
            order = np.argsort(padded.to_numpy(dtype=str), kind="stable")
            rank = np.empty(len(index), dtype=np.int64)
            rank[order] = np.arange(len(index))
            self._natural = pd.Series(rank, index=index)
        return self._natural

    def _filtered(self) -> pd.DataFrame:
        tensors = self.checkpoint.tensors
        mask = name_mask(tensors.index, self.filter_box.value, self.match_mode.value)
        return tensors[mask]

    def _fold(self, tensors: pd.DataFrame) -> pd.DataFrame:
        templates = self._template_of().reindex(tensors.index)
        natural = self._natural_rank().reindex(tensors.index)
        grouped = tensors.assign(pattern=templates.to_numpy(), _rank=natural.to_numpy(), _pos=np.arange(len(tensors))).groupby(
            "pattern", sort=False
        )
        folded = grouped.agg(
            count=("numel", "size"),
            dtype=("dtype", "first"),
            shape=("shape", "first"),
            numel=("numel", "first"),
            nbytes=("nbytes", "sum"),
            file=("file", "first"),
            _rank=("_rank", "min"),
            _pos=("_pos", "min"),
        )
        folded.index.name = "pattern"
        for column in self.checkpoint.format_columns:
            folded[column] = _shared_values(tensors[column], templates)
        return folded

    def _sorted(self, frame: pd.DataFrame, folded: bool) -> pd.DataFrame:
        """Rows ordered by the chosen key; ties keep natural name order whatever the direction."""
        key = self.sort_by.value
        natural = (frame["_rank"] if folded else self._natural_rank().reindex(frame.index)).to_numpy()
        if key == "name":
            primary = natural
        elif key == "disk":
            primary = frame["_pos"].to_numpy() if folded else np.arange(len(frame))
        else:
            primary = pd.Series(frame[key].to_numpy()).rank(method="dense").to_numpy()
        if self.descending.value:
            primary = -primary
        return frame.iloc[np.lexsort((natural, primary))]

    def refresh(self) -> None:
        """Recompute the table, counts and picker from the current control values."""
        try:
            matched = self._filtered()
        except WorkbenchError as exc:
            self.error = exc.message
            self.rows = self.checkpoint.tensors.iloc[:0]
            self.count_label.value = message_html(exc.message, "error")
            self._matched = self.rows
            self.table.clear()
            self._set_picks([])
            return
        self.error = None
        folded = self.fold_toggle.value
        if folded:
            rows = self._sorted(self._fold(matched), folded=True)
            self.rows = rows.drop(columns=["_rank", "_pos"])
        else:
            self.rows = self._sorted(matched, folded=False)[[*ROW_COLUMNS, *self.checkpoint.format_columns]]
        self._matched = matched
        total = len(self.checkpoint)
        noun = "patterns" if folded else "tensors"
        count = f"{len(matched):,} of {total:,} tensors match"
        if folded:
            count += f", folded into {format_count(len(self.rows), 'pattern')}"
        count += f" — {format_bytes(int(matched['nbytes'].sum()))}"
        hint = no_match_hint(self.filter_box.value) if not len(matched) and self.match_mode.value == "glob" else ""
        if hint:
            count += f". {hint}"
        self.count_label.value = message_html(count)
        self._refreshing = True
        try:
            self._show_rows(noun)
        finally:
            self._refreshing = False
        self._offer_page(keep_pick=False)
        if self.other is not None:
            self.refresh_diff()

    def _show_rows(self, noun: str) -> None:
        """Hand `rows` to the table; cells are written per page (ranges, shapes, sizes of the rows in view)."""
        shown = self.rows
        formatters: dict[str, Any] = {"nbytes": format_bytes, "shape": format_shape}
        for column in self.checkpoint.format_columns:  # <NA> of nullable columns shows as an empty cell
            formatters[column] = _cell_or_blank
        if "count" in shown.columns:
            formatters["count"] = lambda n: f"×{n}"
            formatters["range"] = self._range_of
            shown = shown.drop(columns=["file"])
            shown.insert(1, "range", shown.index.to_numpy())
        key = self.sort_by.value
        column = {"name": shown.index.name or "", "disk": ""}.get(key, key)
        self.table.show(shown, formatters=formatters, noun=noun, sort_column=column, descending=self.descending.value)

    def _sort_from_header(self, column: str, descending: bool) -> bool:
        """A header click on a column the Sort control knows: set the control (one refresh), else decline."""
        key = HEADER_SORT_KEYS.get(column)
        if key is None or key not in SORT_KEYS:
            return False
        self._quiet = True
        try:
            self.sort_by.value = key
            self.descending.value = descending
        finally:
            self._quiet = False
        self.refresh()
        return True

    def _on_page_shown(self, _change: Any) -> None:
        """The table shows other rows (a page turn or a sort): offer their tensors, keeping the picked one."""
        if not self._refreshing:
            self._offer_page(keep_pick=True)

    def _offer_page(self, keep_pick: bool) -> None:
        """Offer the tensors of the rows in view in the picker (and the picked tensor too when `keep_pick`)."""
        if self.error is not None:
            return
        names = self._pick_names(self.table.page_frame(), self._matched, self.fold_toggle.value)
        current = self.tensor_picker.value
        if keep_pick and current is not None and current not in names:
            names = [current, *names]
        self._set_picks(names)

    def _on_row_click(self, change: Any) -> None:
        key = change["new"]
        if self._syncing_selection or not key:
            return
        if key in self.checkpoint:
            self.select(key)
        else:
            members = self._members(key, self._matched)
            if members:
                self.select(members[0])

    def _on_diff_row_click(self, change: Any) -> None:
        if change["new"] in self.checkpoint:
            self.select(change["new"])

    def _positions(self, pattern: str) -> np.ndarray:
        """Positions (in `.tensors`) of a template's members, in natural name order."""
        templates = self._template_of()
        positions = np.flatnonzero(templates.to_numpy() == pattern)
        return positions[np.argsort(self._natural_rank().to_numpy()[positions], kind="stable")]

    def _members(self, pattern: str, matched: pd.DataFrame | None = None) -> list[str]:
        names = self.checkpoint.tensors.index[self._positions(pattern)]
        if matched is not None and len(matched) != len(self.checkpoint):
            names = names[names.isin(matched.index)]
        return list(names)

    def _range_of(self, pattern: str) -> str:
        if "{" not in pattern:
            return ""
        if pattern not in self._ranges:
            positions = self._positions(pattern)
            indices = tuple(self._numbers[k] for k in positions)
            names = tuple(self.checkpoint.tensors.index[positions])
            fold = Fold(pattern, PLACEHOLDERS[: len(indices[0])], names, indices)
            self._ranges[pattern] = fold.index_range()
        return self._ranges[pattern]

    def _pick_names(self, shown: pd.DataFrame, matched: pd.DataFrame, folded: bool) -> list[str]:
        if not folded:
            return list(shown.index[:MAX_PICKS])
        names: list[str] = []
        for pattern in shown.index:
            names.extend(self._members(pattern, matched))
            if len(names) >= MAX_PICKS:
                break
        return names[:MAX_PICKS]

    def _set_picks(self, names: list[str]) -> None:
        current = self.tensor_picker.value
        keep = current if current in names else None
        set_options(self.tensor_picker, names, keep)
        if keep is None:
            self._on_pick(None)

    def _on_query_change(self, _change: Any) -> None:
        if not self._quiet:
            self.refresh()

    # --- one tensor ----------------------------------------------------------------------------------
    def select(self, name: str) -> None:
        """Show `name`'s details (it becomes the picked tensor even if the filter hides it)."""
        if name not in self.checkpoint:
            raise self.checkpoint._unknown(name)
        if name not in self.tensor_picker.options:
            self.tensor_picker.options = [name, *self.tensor_picker.options]
        self.tensor_picker.value = name

    def _on_pick(self, _change: Any) -> None:
        name = self.tensor_picker.value
        self.stats_view.value = ""
        self.histogram_output.outputs = ()
        self._sync_read_buttons()
        self.details.value = "" if name is None else self._details_html(name)
        self._syncing_selection = True  # highlight the row of the picked tensor (its pattern when folded)
        try:
            self.table.selected = "" if name is None else name if name in self.table.row_keys else str(self._template_of()[name])
        finally:
            self._syncing_selection = False
        if name is not None and name in self._stats_cache:
            self.stats_view.value = self._stats_html(self._stats_cache[name])

    def _sync_read_buttons(self) -> None:
        """Value stats and Histogram are clickable when a tensor is picked and no read of them is running."""
        disabled = self.tensor_picker.value is None or self.task.running
        self.stats_button.disabled = disabled
        self.histogram_button.disabled = disabled

    def _details_html(self, name: str) -> str:
        row = self.checkpoint.tensors.loc[name]
        template = self._template_of()[name]
        fold = ""
        if template != name:
            fold = f"{template} (×{len(self._members(template))}, {self._range_of(template)})"
        facts = [
            ("name", name),
            ("dtype", row["dtype"]),
            ("shape", format_shape(row["shape"])),
            ("elements", f"{int(row['numel']):,}"),
            ("bytes", f"{int(row['nbytes']):,} ({format_bytes(int(row['nbytes']))})"),
            ("file", str(row["file"])),
            ("byte range", f"[{int(row['begin']):,}, {int(row['end']):,})"),
        ]
        if fold:
            facts.append(("layer pattern", fold))
        for column in self.checkpoint.format_columns:
            value = row[column]
            if not _is_blank(value):
                facts.append((column, value))
        cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
        return f'{TABLE_STYLE}<table class="wb-table wb-details">{cells}</table>'

    def _stats_html(self, stats: pd.DataFrame) -> str:
        shown = stats[["min", "max", "mean", "std", "nan", "inf"]]
        return frame_table(shown, max_rows=5, noun="tensor")

    def _in_background(self, nbytes: int, background: bool | None) -> bool:
        return nbytes > BACKGROUND_BYTES if background is None else background

    def show_stats(self, *, background: bool | None = None) -> pd.DataFrame | None:
        """Compute (once, reading the tensor in chunks) and show the picked tensor's value statistics.

        Tensors over `BACKGROUND_BYTES` (or any with `background=True`) are read in a thread with a bar and
        Cancel (`task`); then this returns None and the result shows when ready (`task.wait()` blocks).
        Reads over 1 GiB wait for "Read anyway".
        """
        name = self.tensor_picker.value
        if name is None:
            return None
        if name in self._stats_cache:
            self.stats_view.value = self._stats_html(self._stats_cache[name])
            return self._stats_cache[name]
        nbytes = int(self.checkpoint.tensors.at[name, "nbytes"])

        def work(on_read: Any = None) -> pd.DataFrame:
            return self.checkpoint.stats(name, chunk_elements=READ_CHUNK_ELEMENTS, on_read=on_read)

        def done(stats: pd.DataFrame) -> None:
            self._stats_cache[name] = stats
            if self.tensor_picker.value == name:
                self.stats_view.value = self._stats_html(stats)

        def failed(exc: BaseException) -> None:
            if self.tensor_picker.value == name and isinstance(exc, WorkbenchError):
                self.stats_view.value = message_html(exc.message, "error")

        if self._in_background(nbytes, background):
            self.task.run(work, total_bytes=nbytes, what=f"value stats of {name}", on_done=done, on_error=failed)
            return None
        try:
            stats = work()
        except WorkbenchError as exc:
            failed(exc)
            return None
        done(stats)
        return stats

    def show_histogram(self, *, background: bool | None = None) -> Any:
        """Read the picked tensor in chunks (twice: range, then counts; once when its value stats are known)
        and show a histogram of its values.

        Large tensors are read in the background as for `show_stats` (then this returns None).
        """
        from ..explore.stats import histogram_bytes

        name = self.tensor_picker.value
        if name is None:
            return None
        known = self._stats_cache.get(name)  # value stats already read: their min and max spare the first pass
        value_range = None
        if known is not None and math.isfinite(known["min"].iloc[0]) and math.isfinite(known["max"].iloc[0]):
            value_range = (float(known["min"].iloc[0]), float(known["max"].iloc[0]))
        nbytes = histogram_bytes(self.checkpoint.catalog, name, value_range)

        def work(on_read: Any = None) -> Any:
            return self.checkpoint.plot_histogram(name, chunk_elements=READ_CHUNK_ELEMENTS, on_read=on_read, value_range=value_range)

        def done(fig: Any) -> None:
            if self.tensor_picker.value == name:
                replace_output(self.histogram_output, fig)

        def failed(exc: BaseException) -> None:
            if self.tensor_picker.value == name and isinstance(exc, WorkbenchError):
                replace_output(self.histogram_output, exc.message)

        if self._in_background(nbytes, background):
            self.task.run(work, total_bytes=nbytes, what=f"a histogram of {name}", on_done=done, on_error=failed)
            return None
        try:
            fig = work()
        except WorkbenchError as exc:
            failed(exc)
            return None
        done(fig)
        return fig

    # --- verify -------------------------------------------------------------------------------------------
    def verify(self, *, background: bool | None = None) -> Any:
        """Check the checkpoint on disk (`workbench.explore.verify.verify`): headers, index, file sizes, and, when a
        checksum sidecar lies beside it, every tensor's SHA-256 against it (never writes one). Re-hashing runs in
        the background with a bar and Cancel (`verify_task`) as for `show_stats`; then this returns None."""
        from ..explore.checksums import default_sidecar
        from ..explore.verify import verify
        from ..formats.remote import is_remote

        location = self.checkpoint.location
        sidecar = None if is_remote(location) else default_sidecar(self.checkpoint.path)
        checksums = sidecar is not None and sidecar.is_file()
        total = int(self.checkpoint.tensors["nbytes"].sum()) if checksums else 0

        def work(on_read: Any = None) -> Any:
            return verify(location, checksums=checksums, on_read=on_read)

        def done(report: Any) -> None:
            kind = "ok" if report.ok and not report.warnings else "warning" if report.ok else "error"
            lines = [report.summary(), *(str(f) for f in report.findings[:20])]
            if not checksums:
                lines.append("No checksum sidecar beside it: tensor bytes were not re-hashed (record one with "
                             f"`workbench verify {location} --checksums`).")
            self.verify_view.value = "".join(message_html(line, kind) for line in lines)

        def failed(exc: BaseException) -> None:
            text = exc.message if isinstance(exc, WorkbenchError) else f"{type(exc).__name__}: {exc}"
            self.verify_view.value = message_html(text, "error")

        self.verify_view.value = ""
        if checksums and self._in_background(total, background):
            self.verify_task.run(work, total_bytes=total, what=f"checksums of {self.checkpoint.path.name}", on_done=done, on_error=failed)
            return None
        try:
            report = work()
        except WorkbenchError as exc:
            failed(exc)
            return None
        done(report)
        return report

    # --- bytes --------------------------------------------------------------------------------------
    def _on_tab(self, change: Any) -> None:
        if change["new"] == 1:
            self.plot_bytes()

    def plot_bytes(self, force: bool = False) -> None:
        """Draw the bar chart of bytes by the chosen grouping (only when visible or asked for)."""
        by = self.bytes_by.value
        if not force and (self.tabs.selected_index != 1 or self._bytes_drawn == by):
            return
        series = self.checkpoint.bytes_by(by)
        replace_output(self.bytes_output, self.checkpoint.plot_bytes(by))
        frame = pd.DataFrame({"bytes": series, "size": series.map(format_bytes)})
        frame.index.name = by
        # In the chart's order (layers in natural order: 0, 1, 2, ... 10); a click on "bytes" sorts by size.
        self.bytes_table.show(frame, noun=f"{by}s")
        self._bytes_drawn = by

    # --- diff ---------------------------------------------------------------------------------------
    def diff(self, values: bool = False) -> pd.DataFrame:
        """The full diff against `compare` (computed once; `values=True` reads and compares tensor data)."""
        if self.other is None:
            raise WorkbenchError("Cannot diff: this Explorer has no second checkpoint. Pass compare=path when creating it.")
        if values not in self._diff_cache:
            self._diff_cache[values] = self.checkpoint.diff(self.other, values=values)
        return self._diff_cache[values]

    def _diff_values_in_background(self, background: bool | None) -> bool:
        """Start comparing values in the background (`diff_task`) when the read is large; True when started
        or waiting for confirmation (the table then keeps showing the header-only diff until it ends)."""
        from ..explore.diff import values_bytes

        assert self.other is not None
        nbytes = values_bytes(self.checkpoint.catalog, self.other.catalog)
        if not self._in_background(nbytes, background):
            return False

        def work(on_read: Any) -> pd.DataFrame:
            assert self.other is not None
            return self.checkpoint.diff(self.other, values=True, chunk_elements=READ_CHUNK_ELEMENTS, on_read=on_read)

        def done(frame: pd.DataFrame) -> None:
            self._diff_cache[True] = frame
            self.refresh_diff(values=True)

        self.diff_task.run(work, total_bytes=nbytes, what=f"values of {self.other.path.name}", on_done=done)
        return True

    def refresh_diff(self, values: bool | None = None, *, background: bool | None = None) -> None:
        """Show the differences (filtered by the name filter and the status choice).

        `values=True` compares tensor data; large comparisons run in the background with a bar and Cancel
        (`diff_task`) as for `show_stats`, showing the header-only differences meanwhile.
        """
        if self.other is None:
            return
        if values is None:
            values = True in self._diff_cache
        if values and True not in self._diff_cache and self._diff_values_in_background(background):
            values = False
        try:
            frame = self.diff(values=values)
        except WorkbenchError as exc:
            self.diff_summary.value = message_html(exc.message, "error")
            return
        counts = frame["status"].value_counts()
        present = [s for s in frame["status"].cat.categories if counts.get(s, 0)]
        options = ["all", *present]
        if list(self.diff_status.options) != options:
            keep = self.diff_status.value if self.diff_status.value in options else "all"
            self._quiet = True
            try:
                set_options(self.diff_status, options, keep)
            finally:
                self._quiet = False
        if self.error is None:
            frame = frame[name_mask(frame.index, self.filter_box.value, self.match_mode.value)]
        status = self.diff_status.value
        if status != "all":
            frame = frame[frame["status"] == status]
        parts = [f"{counts[s]:,} {s}" for s in present]
        summary = " · ".join(parts) if parts else "no differences in names, dtypes or shapes"
        if values:
            summary += " (values compared)"
        self.diff_summary.value = message_html(summary, "ok" if not parts else "info")
        shown = frame.assign(status=frame["status"].astype(str))
        self.diff_table.show(shown, formatters={"shape": format_shape, "other_shape": format_shape}, noun="differences")

    # --- static copy ----------------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        parts = [f'<div class="wb-explorer-static">{self._header_html()}', self.count_label.value, self.table.value]
        if self.other is not None:
            parts += ["<b>Compared</b>", self.diff_summary.value]
        return "".join(parts) + "</div>"
