"""For people: byte quantities as users write them ('5GB', '500MiB', 5_000_000_000) and read them, and
plain-text / HTML tables for summaries (no pandas, so the CLI stays fast)."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

from .errors import PlanError

# Decimal units follow the HF tools ("5GB" is 5 * 10**9); binary units are spelled with an "i".
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, what: str = "shard size") -> int:
    """Bytes from an int or a string like '5GB' (decimal, as HF) or '500MiB' (binary); must be positive."""
    if isinstance(value, bool):
        raise PlanError(f"Cannot use {what} {value!r}: it must be a number of bytes or a string like '5GB'.")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise PlanError(
                f"Cannot use {what} {value!r}: it is not a size. Write bytes as an integer or a string such as "
                "'5GB' (decimal, like the HF tools) or '500MiB' (binary)."
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise PlanError(f"Cannot use {what} {value!r}: it must be an int or a string like '5GB'.")
    if size <= 0:
        raise PlanError(f"Cannot use {what} {value!r}: it must be larger than zero.")
    return size


def format_bytes(n: int | float) -> str:
    """A short human-readable size in binary units (e.g. '1.5 MiB')."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def format_decimal(n: int) -> str:
    """A size in decimal units as the HF tools write shard sizes (e.g. '5GB', '300KB', '1234B')."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= factor:
            value = n / factor
            return f"{value:g}{unit}" if value == round(value, 2) else f"{value:.2f}{unit}"
    return f"{n}B"


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
