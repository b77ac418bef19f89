"""`DataTable`: a DataFrame as an interactive table in the notebook — pages, sortable headers, rows that can
be clicked (the widget's `selected` says which) and a copy button for each row's name.

The kernel keeps the frame, sorts it and sends one page of formatted cells (an `anywidget` front end draws
it), so a 100k-row table costs the browser one page and the kernel a slice. `value` is the same page as
static HTML: what a notebook without a widget manager shows, and what tests read.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import pandas as pd
import traitlets

from ..display import cell_text, html_table
from .common import TABLE_CSS, TABLE_STYLE

DEFAULT_PAGE_SIZE = 50

# The interactive parts: a pager, a highlighted selected row, sort arrows, and a copy button that shows on hover.
_DATATABLE_CSS = TABLE_CSS + (
    ".wb-datatable{color:var(--jp-ui-font-color1,#222)}"
    ".wb-datatable-scroll{max-height:420px;overflow:auto;max-width:100%}"
    ".wb-datatable .wb-table td{max-width:44em;overflow:hidden;text-overflow:ellipsis}"
    ".wb-datatable .wb-table th{cursor:pointer;user-select:none}"
    ".wb-datatable .wb-table th:hover{background:var(--jp-layout-color3,#ddd)}"
    ".wb-datatable .wb-table th.wb-sorted-asc::after{content:' ▲';font-size:9px}"
    ".wb-datatable .wb-table th.wb-sorted-desc::after{content:' ▼';font-size:9px}"
    ".wb-datatable.wb-selectable .wb-table tbody tr{cursor:pointer}"
    ".wb-datatable .wb-table tbody tr:hover{background:var(--jp-layout-color2,#f3f3f3)}"
    # A fixed pair per theme kind: a theme's inverse text colour is white in JupyterLab Light, unreadable on
    # its light brand blue (1.4:1); dark text on light blue, white on dark blue read at >= 7:1.
    ".wb-datatable .wb-table tbody tr.wb-selected{background:#bbdefb;color:#0d1b2a}"
    "body[data-jp-theme-light=false] .wb-datatable .wb-table tbody tr.wb-selected{background:#0d47a1;color:#fff}"
    ".wb-copy-name{border:none;background:none;color:inherit;cursor:pointer;padding:0 4px 0 0;opacity:0.35;font-size:11px}"
    ".wb-datatable tr:hover .wb-copy-name{opacity:1}"
    ".wb-datatable-pager{display:flex;gap:4px;align-items:center;font-size:12px;margin:3px 0;"
    "color:var(--jp-ui-font-color1,#222)}"
    ".wb-datatable-pager button{border:1px solid var(--jp-border-color1,#bbb);background:var(--jp-layout-color1,#fff);"
    "color:var(--jp-ui-font-color1,#222);border-radius:2px;cursor:pointer;min-width:24px}"
    ".wb-datatable-pager button:disabled{opacity:0.4;cursor:default}"
)


class DataTable(anywidget.AnyWidget):
    """A paged, sortable, clickable table of a DataFrame (the index is the first column and each row's key).

    `show(frame, ...)` replaces the contents. A header click sorts: `sort_handler(column, descending)` may
    take it (and call `show` with its own order, returning True); otherwise the table sorts by the raw
    values of that column, stably. A row click sets `selected` to the row's key (observe it to react).
    """

    _esm = Path(__file__).with_name("table.js")
    _css = _DATATABLE_CSS

    columns = traitlets.List(traitlets.Dict()).tag(sync=True)
    cells = traitlets.List(traitlets.List(traitlets.Unicode())).tag(sync=True)
    row_keys = traitlets.List(traitlets.Unicode()).tag(sync=True)
    total = traitlets.Int(0).tag(sync=True)
    page = traitlets.Int(0).tag(sync=True)
    page_size = traitlets.Int(DEFAULT_PAGE_SIZE).tag(sync=True)
    sort_column = traitlets.Unicode("").tag(sync=True)
    sort_descending = traitlets.Bool(False).tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)
    note = traitlets.Unicode("").tag(sync=True)
    noun = traitlets.Unicode("rows").tag(sync=True)
    copyable = traitlets.Bool(True).tag(sync=True)
    selectable = traitlets.Bool(True).tag(sync=True)

    def __init__(self, *, page_size: int = DEFAULT_PAGE_SIZE, css_class: str | None = None, copyable: bool = True,
                 selectable: bool = True, sort_handler: Callable[[str, bool], bool] | None = None) -> None:
        super().__init__(page_size=page_size, copyable=copyable and selectable, selectable=selectable)
        if css_class:
            self.add_class(css_class)
        self.sort_handler = sort_handler
        self.frame: pd.DataFrame | None = None
        self._formatters: dict[str, Callable[[Any], str]] = {}
        self._index = True
        self._quiet = False
        self.observe(self._on_page, names=["page", "page_size"])
        self.observe(self._on_sort, names=["sort_column", "sort_descending"])

    # --- contents ------------------------------------------------------------------------------------
    def show(
        self,
        frame: pd.DataFrame,
        *,
        formatters: Mapping[str, Callable[[Any], str]] | None = None,
        noun: str = "rows",
        index: bool = True,
        sort_column: str = "",
        descending: bool = False,
        keep_page: bool = False,
        note: str = "",
    ) -> None:
        """Show `frame` (already in the order wanted), from the first page unless `keep_page`.

        `sort_column` / `descending` only mark which header the order follows (the caller sorted).
        """
        self.frame = frame
        self._formatters = dict(formatters or {})
        self._index = index
        names = ([frame.index.name or ""] if index else []) + [str(c) for c in frame.columns]
        numeric = ([False] if index else []) + [self._numeric(frame[c]) for c in frame.columns]
        with self.hold_sync():
            self._quiet = True
            try:
                self.columns = [{"name": n, "label": n, "numeric": bool(k)} for n, k in zip(names, numeric, strict=True)]
                self.noun = noun
                self.note = note
                self.total = len(frame)
                self.sort_column = sort_column
                self.sort_descending = descending
                self.page = min(self.page, self.last_page) if keep_page else 0
            finally:
                self._quiet = False
            self._send_page()

    def clear(self, note: str = "") -> None:
        """Show nothing (and `note`, e.g. why)."""
        self.frame = None
        with self.hold_sync():
            self._quiet = True
            try:
                self.columns, self.cells, self.row_keys, self.total, self.page = [], [], [], 0, 0
                self.note = note
            finally:
                self._quiet = False

    @property
    def last_page(self) -> int:
        """Index of the last page (0 when everything fits on one)."""
        return max(0, (self.total - 1) // max(1, self.page_size))

    def page_frame(self) -> pd.DataFrame:
        """The rows of the page in view, unformatted."""
        if self.frame is None:
            return pd.DataFrame()
        size = max(1, self.page_size)
        return self.frame.iloc[self.page * size : (self.page + 1) * size]

    def shown_keys(self) -> list[str]:
        """The keys (index labels, as text) of the rows in view, top to bottom."""
        return list(self.row_keys)

    @property
    def value(self) -> str:
        """The page in view as a static HTML table with a 'showing ...' note ('' when nothing is shown)."""
        if self.frame is None:
            return ""
        headers = [c["label"] for c in self.columns]
        size = max(1, self.page_size)
        rows = self._page_rows()
        table = html_table(headers, rows, limit=size, total=self.total, noun=self.noun, css_class="wb-table")
        if self.page:
            start = self.page * size
            where = f"showing rows {start + 1:,}–{start + len(rows):,} of {self.total:,} {self.noun}"
            table = f'<div class="wb-note">{html.escape(where)}</div>' + table.split("</div>", 1)[1]
        note = f'<div class="wb-note">{html.escape(self.note)}</div>' if self.note else ""
        return TABLE_STYLE + note + table

    def __repr__(self) -> str:
        if self.frame is None:
            return "<DataTable: empty>"
        start = self.page * max(1, self.page_size)
        return f"<DataTable: rows {start + 1 if self.total else 0:,}-{start + len(self.row_keys):,} of {self.total:,} {self.noun}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict] | None:
        """The live table where a widget manager runs, and the page as static HTML (and text) where none does."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        data["text/html"] = self.value
        return data, metadata

    # --- kernel side of the user's clicks ------------------------------------------------------------
    def _on_page(self, change: Any) -> None:
        if self._quiet or self.frame is None:
            return
        if change["name"] == "page_size":
            self._quiet = True
            try:
                self.page = min(self.page, self.last_page)
            finally:
                self._quiet = False
        self._send_page()

    def _on_sort(self, _change: Any) -> None:
        if self._quiet or self.frame is None or not self.sort_column:
            return
        column, descending = self.sort_column, self.sort_descending
        if self.sort_handler is not None and self.sort_handler(column, descending):
            return
        frame = self.frame
        if self._index and column == (frame.index.name or ""):
            values = pd.Series(frame.index, index=frame.index)
        elif column in frame.columns:
            values = frame[column]
        else:
            return
        keys = _sort_keys(values)
        order = np.lexsort((np.arange(len(keys)), -keys if descending else keys))  # ties keep the current order
        self.show(frame.iloc[order], formatters=self._formatters, noun=self.noun, index=self._index,
                  sort_column=column, descending=descending, note=self.note)

    # --- formatting ----------------------------------------------------------------------------------
    def _page_rows(self) -> list[list[object]]:
        shown = self.page_frame()
        columns = list(shown.columns)
        rows = []
        for label, values in zip(shown.index, shown.itertuples(index=False, name=None), strict=True):
            row: list[object] = [str(label)] if self._index else []
            for column, value in zip(columns, values, strict=True):
                formatter = self._formatters.get(column)
                row.append(value if formatter is None else formatter(value))
            rows.append(row)
        return rows

    def _send_page(self) -> None:
        shown = self.page_frame()
        rows = self._page_rows()
        with self.hold_sync():
            self.cells = [[cell_text(v)[0] for v in row] for row in rows]
            self.row_keys = [str(k) for k in shown.index]

    @staticmethod
    def _numeric(column: pd.Series) -> bool:
        return pd.api.types.is_numeric_dtype(column.dtype) and not pd.api.types.is_bool_dtype(column.dtype)


_DIGITS = re.compile(r"[0-9]+")


def _sort_keys(values: pd.Series) -> np.ndarray:
    """Dense ranks of a column: numbers by value, shapes dimension by dimension, text in natural order
    ('layers.2' before 'layers.10'); blanks last."""
    if pd.api.types.is_numeric_dtype(values.dtype) and not pd.api.types.is_bool_dtype(values.dtype):
        return values.rank(method="dense", na_option="bottom").to_numpy()
    cells = values.to_numpy(dtype=object)
    blank = np.fromiter((v is None or v == "" or (isinstance(v, float) and v != v) for v in cells), dtype=bool, count=len(cells))
    if any(isinstance(v, (tuple, list)) for v in cells[~blank][:1]):
        keys = [(0, tuple(v)) if isinstance(v, (tuple, list)) else (1, ()) for v in cells]
    else:
        keys = [(0, _DIGITS.sub(lambda m: m.group().zfill(20), str(v))) for v in cells]
    for position in np.flatnonzero(blank):
        keys[position] = (2, ())
    order = sorted(range(len(keys)), key=keys.__getitem__)
    ranks = np.empty(len(keys), dtype=np.int64)
    rank = 0
    for k, position in enumerate(order):
        if k and keys[position] != keys[order[k - 1]]:
            rank += 1
        ranks[position] = rank
    return ranks
