"""For people: byte quantities as users write them ('5GB', '500MiB', 5_000_000_000) and read them, shapes
and counts, and plain-text / HTML tables for summaries (no pandas, so the CLI stays fast).

This is the one place that decides how the package writes a size, a shape or a table: the CLI, the
reports' `str()` / `_repr_html_` and the notebook widgets all call it, so the same tensor reads the same
everywhere.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence

from .errors import PlanError

# Decimal units follow the HF tools ("5GB" is 5 * 10**9); binary units are spelled with an "i".
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


_SHOWN_CHARS = 96  # longest value a message shows whole


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
    """A size in binary units, as every table and message of the package writes it: '512 B', '1.5 KiB',
    '756.0 GiB' (whole bytes below 1 KiB, else one decimal; PiB is the largest unit)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"


def format_value(value: object) -> str:
    """`repr(value)` for messages, safe on untrusted input: an integer too long to read is shown by its
    length (Python refuses to print one of thousands of digits), other objects by their type, long text cut."""
    if type(value) is int and value.bit_length() > 64:
        return f"<{'-' if value < 0 else ''}integer of {value.bit_length()} bits>"
    text = repr(value) if isinstance(value, (int, float, str, bool)) or value is None else f"<{type(value).__name__}>"
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def format_shape(shape: Iterable[object] | None) -> str:
    """A shape as people write it: (64, 128) -> '[64, 128]', () -> '[]' (a scalar), None -> '' (unknown).

    Safe on shapes read from untrusted files: huge dimensions show by their length, more than 16 are cut,
    and a value that is not a list of sizes is shown as it is."""
    if shape is None:
        return ""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        return format_value(shape)
    dims = list(shape)
    shown = ", ".join(str(int(d)) if type(d) is not int and _is_int_like(d) else format_value(d) for d in dims[:16])
    return f"[{shown}{', ...' if len(dims) > 16 else ''}]"


def _is_int_like(value: object) -> bool:
    """numpy / torch integer scalars: shown as plain ints."""
    return hasattr(value, "__index__") and not isinstance(value, bool)


def format_count(n: int, noun: str, plural: str | None = None) -> str:
    """A count with its noun: (1, 'file') -> '1 file', (1234, 'tensor') -> '1,234 tensors'."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def format_decimal(n: int) -> str:
    """A size in decimal units as the HF tools write shard sizes (e.g. '5GB', '300KB', '1234B')."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= factor:
            value = n / factor
            return f"{value:g}{unit}" if value == round(value, 2) else f"{value:.2f}{unit}"
    return f"{n}B"


def cell_text(value: object) -> tuple[str, bool]:
    """One table cell as text, and whether it is a number (numbers are right-aligned).

    None and NaN are empty, a tuple is a shape, floats keep six significant digits and integers get
    thousands separators; anything else is `str(value)`.
    """
    if value is None or (isinstance(value, float) and value != value):
        return "", False
    if isinstance(value, tuple):
        return format_shape(value), False
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value), False
    if isinstance(value, float):
        return f"{value:.6g}", True
    return f"{value:,}", True


def text_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    indent: str = "  ",
    limit: int | None = 20,
    right: Iterable[str] | None = None,
    rule: bool = False,
) -> str:
    """Rows as aligned text columns under a header, for terminals and `str()` of reports.

    A column is right-aligned when it is named in `right`, or (without `right`) when every non-empty shown
    cell is a number or starts with one ('1.5 KiB', '16,384'). `rule` draws a dashed line under the header.
    Rows past `limit` (None: no limit) are summarised in one line.
    """
    shown_rows = rows if limit is None else rows[:limit]
    cells = [[cell_text(c) for c in row] for row in shown_rows]
    shown = [[text for text, _ in row] for row in cells]
    widths = [max([len(h)] + [len(r[i]) for r in shown]) for i, h in enumerate(headers)]
    if right is not None:
        named = set(right)
        aligned = [h in named for h in headers]
    else:
        filled = [[(text, num) for text, num in (r[i] for r in cells) if text] for i in range(len(headers))]
        aligned = [bool(column) and all(num or _is_number(text) for text, num in column) for column in filled]

    def line(texts: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(texts, widths, aligned, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    out = [line(list(headers))]
    if rule:
        out.append(line(["-" * w for w in widths]))
    out += [line(r) for r in shown]
    if limit is not None and len(rows) > limit:
        out.append(f"{indent}... {len(rows) - limit} more rows")
    return "\n".join(out)


def _is_number(text: str) -> bool:
    head = text.split(" ")[0].replace(",", "")
    try:
        float(head)
    except ValueError:
        return False
    return True


def html_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    limit: int = 20,
    total: int | None = None,
    noun: str | None = None,
    css_class: str | None = None,
) -> str:
    """Rows as an HTML table for notebook reprs and widgets, at most `limit` of them.

    Cells are written by `cell_text`; number cells get class "num" (right-aligned by a stylesheet such as
    the widgets'). A note above the table counts the rows: with `noun` always ('12 patterns', 'showing
    the first 50 of 4,000 tensors', 'no tensors', and then no table), without it only when rows were
    left out. `total` is the row count when `rows` is already a slice of a longer table.
    """
    total = len(rows) if total is None else total
    shown = rows[:limit]
    if total > len(shown):
        note = f"showing the first {len(shown):,} of {total:,} {noun or 'rows'}"
    elif noun is None:
        note = ""
    else:
        note = f"{total:,} {noun}" if total else f"no {noun}"
    note_html = f'<div class="wb-note">{html.escape(note)}</div>' if note else ""
    if noun is not None and not total:
        return note_html
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = []
    for row in shown:
        tds = []
        for value in row:
            text, numeric = cell_text(value)
            cls = ' class="num"' if numeric else ""
            tds.append(f"<td{cls}>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    table_class = f' class="{html.escape(css_class)}"' if css_class else ""
    return f'{note_html}<table{table_class}><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
