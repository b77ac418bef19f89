"""Helpers shared by the notebook widgets: DataFrames as bounded, styled HTML tables (drawn by
`workbench.display.html_table`), status messages, writing into Outputs, and a panel base class whose
display carries a static HTML copy.

Widgets write into `Output` widgets by replacing or appending to `outputs` (never `with out:`), so the
same callbacks work under pytest, under nbclient and in a live JupyterLab.
"""

from __future__ import annotations

import html
import io
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as widgets

from ..display import html_table

# Colours come from JupyterLab's theme variables (light, dark or any other theme), with light fallbacks for
# viewers without them (nbviewer, GitHub). Status colours have no theme variable that reads well on both
# backgrounds, so their dark variants hang on the attribute JupyterLab puts on <body> for dark themes.
# The widgets' tab labels: JupyterLab Light greys the inactive ones to 4.4:1 on their tab; ours read at >= 4.5:1.
INK_STYLE = (
    "<style>body[data-jp-theme-light=false]{--wb-ink-good:#81c784;--wb-ink-warn:#ffb74d;--wb-ink-bad:#ef9a9a}"
    ":is(.wb-explorer,.wb-builder,.wb-plan,.wb-run) .lm-TabBar-tab{color:var(--jp-ui-font-color1,#222)!important}</style>"
)
MESSAGE_COLORS = {
    "info": "var(--jp-ui-font-color2,#555)",
    "ok": "var(--wb-ink-good,#2e7d32)",
    "warning": "var(--wb-ink-warn,#a35f00)",
    "error": "var(--wb-ink-bad,#c62828)",
}
TABLE_CSS = (
    ".wb-table{border-collapse:collapse;font-family:var(--jp-code-font-family,monospace);font-size:12px;"
    "color:var(--jp-ui-font-color1,#222);background:var(--jp-layout-color0,#fff)}"
    ".wb-table th,.wb-table td{padding:1px 8px;line-height:1.35;border-bottom:1px solid var(--jp-border-color2,#ddd);"
    "text-align:left;white-space:nowrap}"
    ".wb-table th{background:var(--jp-layout-color2,#eee);color:var(--jp-ui-font-color1,#222);position:sticky;top:0}"
    ".wb-table td.num,.wb-table th.num{text-align:right}"
    ".wb-note{color:var(--jp-ui-font-color2,#666);font-size:12px;margin:2px 0}"
)
TABLE_STYLE = f"<style>{TABLE_CSS}</style>"


def message_html(text: str, kind: str = "info") -> str:
    """One line of status text, coloured by kind ('info', 'ok', 'warning', 'error') to read in the notebook's theme."""
    color = MESSAGE_COLORS.get(kind, MESSAGE_COLORS["info"])
    return f'{INK_STYLE}<div class="wb-message wb-{kind}" style="color:{color};margin:2px 0">{html.escape(text)}</div>'


def frame_table(
    frame: Any,
    *,
    max_rows: int = 50,
    formatters: Mapping[str, Callable[[Any], str]] | None = None,
    noun: str = "rows",
    index: bool = True,
    total: int | None = None,
) -> str:
    """A DataFrame as a styled `display.html_table` of at most `max_rows` rows, with a 'showing N of M' note.

    Only the shown rows are formatted, so a 100k-row frame costs the same as a 50-row one. `formatters`
    write chosen columns (column -> function of the cell); the index is the first column when `index`.
    `total` overrides M when `frame` is already a slice of a longer table.
    """
    formatters = dict(formatters or {})
    shown = frame.iloc[:max_rows]
    columns = list(shown.columns)
    headers = ([shown.index.name or ""] if index else []) + [str(c) for c in columns]
    rows = []
    for label, values in zip(shown.index, shown.itertuples(index=False, name=None), strict=True):
        row: list[object] = [str(label)] if index else []
        for column, value in zip(columns, values, strict=True):
            formatter = formatters.get(column)
            row.append(value if formatter is None else formatter(value))
        rows.append(row)
    total = len(frame) if total is None else total
    return TABLE_STYLE + html_table(headers, rows, limit=max_rows, total=total, noun=noun, css_class="wb-table")


def figure_png(fig: Any) -> bytes:
    """A matplotlib figure rendered to PNG bytes at its own dpi (independent of the notebook's backend), on a
    transparent background with neutral-grey text so that it reads in light and dark notebook themes."""
    from ..explore.plots import theme_neutral

    buffer = io.BytesIO()
    theme_neutral(fig)
    fig.savefig(buffer, format="png", dpi="figure", transparent=True)
    return buffer.getvalue()


def replace_output(output: widgets.Output, *objects: Any) -> None:
    """Make `output` show exactly `objects` (display objects, figures, or strings as stdout text)."""
    output.outputs = ()
    for obj in objects:
        append_output(output, obj)


def append_output(output: widgets.Output, obj: Any) -> None:
    """Append one object to `output`: a str as stdout text, a matplotlib figure as a PNG, else its display."""
    from IPython.display import HTML, Image

    if isinstance(obj, str):
        output.append_stdout(obj if obj.endswith("\n") else obj + "\n")
    elif hasattr(obj, "savefig"):
        output.append_display_data(Image(data=figure_png(obj), format="png"))
    elif hasattr(obj, "_repr_html_") and not isinstance(obj, widgets.Widget):
        output.append_display_data(HTML(obj._repr_html_()))
    else:
        output.append_display_data(obj)


def output_text(output: widgets.Output) -> str:
    """Everything an Output shows as text (stdout, text/html, text/plain), for tests and fallbacks."""
    parts = []
    for item in output.outputs:
        if item.get("output_type") == "stream":
            parts.append(item.get("text", ""))
        else:
            data = item.get("data", {})
            parts.append(data.get("text/html") or data.get("text/plain") or "")
    return "\n".join(parts)


def set_options(picker: widgets.Widget, options: list[Any], value: Any = None) -> None:
    """Give a selection widget new options and then select `value` (None clears the selection).

    Changing options makes ipywidgets select the first one, so the value is set afterwards rather than
    inside `hold_trait_notifications` (which would validate it against the old options).
    """
    picker.options = options
    values = [o[1] if isinstance(o, tuple) else o for o in options]
    picker.value = value if value in values else None


def labelled(widget: widgets.Widget, css_class: str) -> widgets.Widget:
    """Tag a control with a stable DOM class (browser tests and custom CSS find it by that name)."""
    widget.add_class(css_class)
    return widget


class Panel(widgets.VBox):
    """A VBox whose display also carries a static HTML copy of its current state.

    JupyterLab renders the live widget; viewers without a widget manager (GitHub, nbviewer, a
    notebook opened before its kernel runs) render the HTML instead of a 'Loading widget...' line.
    Subclasses implement `_repr_html_` and `_describe` (the one-line text form).
    """

    def _describe(self) -> str:
        return type(self).__name__

    def _repr_html_(self) -> str:
        return html.escape(self._describe())

    def __repr__(self) -> str:
        return f"<{self._describe()}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        data = super()._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = repr(self)
        data["text/html"] = self._repr_html_()
        return data


def fit_narrow(*roots: widgets.Widget) -> None:
    """Keep every control whole in a narrow notebook (760 px and less): rows wrap instead of pushing their
    last controls out of view, buttons keep the width of their text (a shrunk flex item ellipsises it), and
    fields sized in pixels shrink to the row they sit in. Walks `roots` and their children as built."""
    stack = list(roots)
    while stack:
        widget = stack.pop()
        layout = getattr(widget, "layout", None)
        if isinstance(widget, widgets.HBox):
            layout.flex_flow = "row wrap"
        elif isinstance(widget, widgets.Button):
            layout.flex = "0 0 auto"
            if layout.width and layout.width.endswith("px"):
                layout.min_width, layout.width = layout.width, "auto"
        elif layout is not None and layout.width and layout.width.endswith("px"):
            layout.max_width = "100%"
        stack.extend(getattr(widget, "children", ()))
