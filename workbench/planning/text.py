"""Plain-text and HTML tables for plan and report summaries (no pandas, so the CLI stays fast)."""

from __future__ import annotations

import html
from collections.abc import Sequence


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, indent: str = "  ", limit: int = 20) -> str:
    """Aligned columns; numbers right-aligned; rows past `limit` summarised in one line."""
    shown = [[str(c) for c in row] for row in rows[:limit]]
    widths = [max([len(h)] + [len(r[i]) for r in shown]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in shown) and bool(shown) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    out = [line(list(headers))] + [line(r) for r in shown]
    if len(rows) > limit:
        out.append(f"{indent}... {len(rows) - limit} more rows")
    return "\n".join(out)


def _is_number(text: str) -> bool:
    head = text.split(" ")[0]
    try:
        float(head)
    except ValueError:
        return False
    return True


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, limit: int = 20) -> str:
    """A small HTML table for notebook reprs."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows[:limit])
    more = f"<p>... {len(rows) - limit} more rows</p>" if len(rows) > limit else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"
