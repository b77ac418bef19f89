"""`workbench.display`: the one place that writes sizes, shapes, counts and tables for people."""

from __future__ import annotations

import ast
from pathlib import Path

import pandas as pd

from workbench.cli import commands as cli
from workbench.display import cell_text, format_bytes, format_count, format_shape, html_table, text_table
from workbench.widgets.common import TABLE_STYLE, frame_table

PACKAGE = Path(__file__).resolve().parents[2] / "workbench"


def test_format_bytes_binary_units_one_decimal() -> None:
    values = (0, 1023, 1024, 1536, 5 << 20, 723_200, 811_706_777_600, 3 << 40, 2 << 50)
    assert [format_bytes(n) for n in values] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "706.2 KiB", "756.0 GiB", "3.0 TiB", "2.0 PiB",
    ]
    assert format_bytes(1536.0) == "1.5 KiB" and format_bytes(-2048) == "-2.0 KiB"


def test_format_shape_and_count() -> None:
    assert format_shape((64, 128)) == "[64, 128]"
    assert format_shape(()) == "[]"  # a scalar
    assert format_shape(None) == ""
    assert format_shape([pd.Series([3]).iloc[0], 4]) == "[3, 4]"  # numpy integers print as plain numbers
    assert format_count(1, "file") == "1 file"
    assert format_count(3, "file") == "3 files"
    assert format_count(12_000, "tensor") == "12,000 tensors"
    assert format_count(2, "entry", "entries") == "2 entries"


def test_cell_text() -> None:
    assert cell_text(None) == ("", False)
    assert cell_text(float("nan")) == ("", False)
    assert cell_text((2, 3)) == ("[2, 3]", False)
    assert cell_text(16384) == ("16,384", True)
    assert cell_text(0.123456789) == ("0.123457", True)
    assert cell_text(True) == ("True", False)
    assert cell_text("1.0 KiB") == ("1.0 KiB", False)


def test_text_table_aligns_numbers_and_limits_rows() -> None:
    rows = [("a.safetensors", "1.0 KiB", 3), ("bb.safetensors", "12.5 MiB", 1200), ("c", None, 0)]
    assert text_table(["file", "size", "tensors"], rows).splitlines() == [
        "  file                size  tensors",
        "  a.safetensors    1.0 KiB        3",
        "  bb.safetensors  12.5 MiB    1,200",
        "  c                               0",
    ]
    long = text_table(["n"], [(i,) for i in range(25)], limit=20).splitlines()
    assert len(long) == 22 and long[-1] == "  ... 5 more rows"


def test_text_table_as_the_cli_draws_it() -> None:
    rows = [("lm_head.weight", "F32", "[256, 64]", "16,384", "64.0 KiB"), ("model.norm.weight", "F32", "[64]", "64", None)]
    out = text_table(["name", "dtype", "shape", "numel", "size"], rows, indent="", limit=None, rule=True, right=("numel", "size"))
    assert out.splitlines() == [
        "name               dtype  shape       numel      size",
        "-----------------  -----  ---------  ------  --------",
        "lm_head.weight     F32    [256, 64]  16,384  64.0 KiB",
        "model.norm.weight  F32    [64]           64",
    ]


def test_html_table_plain_and_styled() -> None:
    plain = html_table(["file", "tensors"], [("a<b>", 1200)])
    assert plain == (
        "<table><thead><tr><th>file</th><th>tensors</th></tr></thead>"
        '<tbody><tr><td>a&lt;b&gt;</td><td class="num">1,200</td></tr></tbody></table>'
    )
    cut = html_table(["n"], [(i,) for i in range(30)], limit=20)
    assert cut.startswith('<div class="wb-note">showing the first 20 of 30 rows</div><table>') and cut.count("<tr>") == 21
    styled = html_table(["n"], [(1,), (2,)], noun="tensors", css_class="wb-table")
    assert styled.startswith('<div class="wb-note">2 tensors</div><table class="wb-table">')
    assert html_table(["n"], [], noun="tensors") == '<div class="wb-note">no tensors</div>'


def test_widget_tables_are_display_tables_with_the_widget_style() -> None:
    frame = pd.DataFrame({"shape": [(2, 3), (4,)], "numel": [6, 4], "nbytes": [24, 16]}, index=pd.Index(["a", "b"], name="name"))
    out = frame_table(frame, max_rows=1, formatters={"nbytes": format_bytes}, noun="tensors")
    assert out == TABLE_STYLE + (
        '<div class="wb-note">showing the first 1 of 2 tensors</div><table class="wb-table"><thead><tr><th>name</th>'
        '<th>shape</th><th>numel</th><th>nbytes</th></tr></thead><tbody><tr><td>a</td><td>[2, 3]</td><td class="num">6</td>'
        "<td>24 B</td></tr></tbody></table>"
    )


def test_cli_writes_sizes_and_tables_through_display() -> None:
    assert not hasattr(cli, "human_bytes") and not hasattr(cli, "render_table")
    assert cli.format_bytes is format_bytes and cli.text_table is text_table


def test_one_home_for_sizes_shapes_and_tables() -> None:
    """No module but display.py defines a size formatter, a shape formatter or a table renderer."""
    owned = {"format_bytes", "human_bytes", "format_shape", "shape_text", "render_table", "text_table", "html_table"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "display.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name in owned:
                found.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert found == []
