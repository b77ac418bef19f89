"""Matplotlib figures for checkpoints: where the bytes are, and how one tensor's values spread.

Each function returns a `matplotlib.figure.Figure` that pyplot no longer tracks, so returning one from
a notebook cell shows it exactly once and nothing accumulates between calls.
"""

from __future__ import annotations

from typing import Any

MAX_BARS = 60

# Figures are drawn for both light and dark notebooks: a transparent background, and text, axes and ticks in
# a grey that reads on white (3.5:1) and on JupyterLab's dark background (5.3:1) alike.
NEUTRAL_INK = "#888888"
THEME_NEUTRAL_STYLE = {
    "figure.facecolor": "none",
    "axes.facecolor": "none",
    "savefig.facecolor": "none",
    "savefig.transparent": True,
    "text.color": NEUTRAL_INK,
    "axes.labelcolor": NEUTRAL_INK,
    "axes.titlecolor": NEUTRAL_INK,
    "axes.edgecolor": NEUTRAL_INK,
    "xtick.color": NEUTRAL_INK,
    "ytick.color": NEUTRAL_INK,
    "xtick.labelcolor": NEUTRAL_INK,
    "ytick.labelcolor": NEUTRAL_INK,
    "grid.color": NEUTRAL_INK,
    "legend.facecolor": "none",
    "legend.edgecolor": NEUTRAL_INK,
    "legend.labelcolor": NEUTRAL_INK,
}


def _new_figure(width: float, height: float) -> Any:
    import matplotlib.pyplot as plt

    # Made through pyplot so the backend loads (in Jupyter that registers the inline PNG display), then
    # detached from pyplot so it is not shown a second time when the cell ends and is not kept alive.
    with plt.rc_context(THEME_NEUTRAL_STYLE):
        fig = plt.figure(figsize=(width, height), layout="constrained")
    plt.close(fig)
    return fig


def theme_neutral(fig: Any) -> Any:
    """Make a finished figure readable on light and dark backgrounds: transparent figure and axes, and black
    text, spines and ticks turned to the neutral grey (text in a coloured box, such as a graph node's, keeps
    its colour). Returns `fig`."""
    from matplotlib.colors import to_rgba
    from matplotlib.text import Text

    def dark(color: Any) -> bool:
        r, g, b, _ = to_rgba(color)
        return max(r, g, b) < 0.35

    fig.patch.set_alpha(0.0)
    for ax in fig.axes:
        ax.patch.set_alpha(0.0)
        for spine in ax.spines.values():
            if dark(spine.get_edgecolor()):
                spine.set_edgecolor(NEUTRAL_INK)
        ax.tick_params(colors=NEUTRAL_INK, which="both")
        legend = ax.get_legend()
        if legend is not None:
            legend.get_frame().set_alpha(0.0)
    for text in fig.findobj(Text):
        if text.get_bbox_patch() is None and dark(text.get_color()):
            text.set_color(NEUTRAL_INK)
    return fig


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if max_bytes >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def bar_chart_of_bytes(series: Any, title: str) -> Any:
    """A horizontal bar per entry of a Series of byte counts (label -> bytes), first entry on top.

    More than MAX_BARS entries are cut to the largest ones, with the rest summed into one bar.
    """
    import pandas as pd

    if len(series) > MAX_BARS:
        top = series.nlargest(MAX_BARS - 1)
        rest = series.drop(top.index).sum()
        series = pd.concat([series[series.index.isin(top.index)], pd.Series({f"{len(series) - len(top)} others": rest})])
    scale, unit = _unit(float(series.max()) if len(series) else 0.0)
    height = min(1.0 + 0.28 * len(series), 16.0)
    fig = _new_figure(8.0, max(height, 2.0))
    ax = fig.add_subplot()
    labels = [str(label) for label in series.index]
    ax.barh(range(len(series)), series.to_numpy(dtype=float) / scale, color="#4C72B0")
    ax.set_yticks(range(len(series)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return theme_neutral(fig)


def histogram_figure(counts: Any, edges: Any, title: str, log: bool = True) -> Any:
    """Bars of a precomputed histogram (counts per bin between edges)."""
    fig = _new_figure(7.0, 3.5)
    ax = fig.add_subplot()
    widths = edges[1:] - edges[:-1]
    ax.bar(edges[:-1], counts, width=widths, align="edge", color="#55A868")
    if log and counts.any():
        ax.set_yscale("log")
    ax.set_xlabel("value")
    ax.set_ylabel("count")
    ax.set_title(title)
    return theme_neutral(fig)
