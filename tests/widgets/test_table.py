"""DataTable and the Explorer's tables, kernel side, driven like the front end does: set the traits a header
click, a page button or a row click sets, then read what the table sends (cells, row keys) and what the
Explorer shows. Theme-aware styling and figures that read on light and dark backgrounds are checked here too."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest

from workbench.catalog import Catalog, TensorInfo
from workbench.widgets import Explorer
from workbench.widgets.common import TABLE_STYLE, figure_png, frame_table, message_html
from workbench.widgets.table import DataTable


@pytest.fixture
def frame() -> pd.DataFrame:
    names = [f"w{k}" for k in range(23)]
    data = pd.DataFrame({"size": [(k * 7) % 10 for k in range(23)], "kind": ["b", "a"] * 11 + ["c"]}, index=pd.Index(names, name="name"))
    return data


def test_pages_send_only_the_rows_in_view(frame):
    table = DataTable(page_size=10)
    table.show(frame, noun="weights")
    assert table.total == 23 and table.last_page == 2 and table.row_keys == [f"w{k}" for k in range(10)]
    assert [c["name"] for c in table.columns] == ["name", "size", "kind"] and [c["numeric"] for c in table.columns] == [False, True, False]
    table.page = 2  # the "last page" button
    assert table.row_keys == ["w20", "w21", "w22"] and table.cells[0] == ["w20", "0", "b"]
    assert "showing rows 21–23 of 23 weights" in table.value and table.value.count("<tr>") == 4
    table.page_size = 5  # fewer per page: the page stays within range
    assert table.page == 2 and table.row_keys == [f"w{k}" for k in range(10, 15)]
    table.page_size = 50
    assert table.page == 0 and len(table.row_keys) == 23


def test_header_click_sorts_stably_and_reverses(frame):
    table = DataTable(page_size=30)
    table.show(frame)
    table.sort_descending, table.sort_column = True, "size"  # a click on a numeric header: largest first
    sizes = [int(row[1]) for row in table.cells]
    assert sizes == sorted(sizes, reverse=True) and table.page == 0
    nines = [k for k, row in zip(table.row_keys, table.cells, strict=True) if row[1] == "9"]
    assert nines == ["w7", "w17"]  # ties keep their previous order
    table.sort_descending = False
    assert [int(row[1]) for row in table.cells] == sorted(sizes)
    table.sort_column = "kind"
    assert [row[2] for row in table.cells] == sorted(row[2] for row in table.cells)
    table.sort_descending, table.sort_column = True, "name"
    assert table.row_keys[:3] == ["w22", "w21", "w20"]  # natural order: w22 after w9


def test_sort_handler_takes_the_click(frame):
    asked = []
    table = DataTable(sort_handler=lambda column, descending: asked.append((column, descending)) or column == "size")
    table.show(frame)
    table.sort_column = "size"
    assert asked == [("size", False)] and table.row_keys[0] == "w0"  # taken: the table did not reorder itself
    table.sort_column = "kind"
    assert table.cells[0][2] == "a"  # declined: the table sorted


def test_clear_shows_nothing(frame):
    table = DataTable()
    table.show(frame)
    table.clear()
    assert table.value == "" and table.row_keys == [] and table.total == 0


@pytest.fixture
def explorer(llama_sample):
    return Explorer(llama_sample, max_rows=10)


def test_explorer_header_click_sets_the_sort_control(explorer):
    explorer.table.sort_descending, explorer.table.sort_column = True, "nbytes"
    assert explorer.sort_by.value == "nbytes" and explorer.descending.value is True
    assert list(explorer.rows["nbytes"]) == sorted(explorer.rows["nbytes"], reverse=True)
    assert explorer.table.row_keys[0] == explorer.rows.index[0] and explorer.table.sort_column == "nbytes"
    explorer.table.sort_column = "pattern"  # the name column: natural order through the Sort control
    assert explorer.sort_by.value == "name"
    explorer.table.sort_descending, explorer.table.sort_column = False, "count"  # not a Sort key: sorted by the table
    assert explorer.sort_by.value == "name" and explorer.table.row_keys[0] == "lm_head.weight"


def test_explorer_row_click_picks_the_tensor(explorer):
    explorer.table.selected = "model.layers.{i}.mlp.up_proj.weight"  # a folded pattern: its first member
    assert explorer.tensor_picker.value == "model.layers.0.mlp.up_proj.weight"
    assert "model.layers.0.mlp.up_proj.weight" in explorer.details.value
    explorer.fold_toggle.value = False
    explorer.table.selected = "model.layers.1.self_attn.k_proj.weight"
    assert explorer.tensor_picker.value == "model.layers.1.self_attn.k_proj.weight"
    explorer.tensor_picker.value = "model.layers.0.self_attn.k_proj.weight"  # the picker highlights its row
    assert explorer.table.selected == "model.layers.0.self_attn.k_proj.weight"


def test_explorer_pages_offer_their_tensors_in_the_picker(explorer):
    explorer.fold_toggle.value = False
    assert len(explorer.rows) == 39 and explorer.table.last_page == 3
    explorer.table.page = 3
    assert explorer.table.row_keys == list(explorer.rows.index[30:])
    assert list(explorer.tensor_picker.options) == list(explorer.rows.index[30:])
    explorer.filter_box.value = "mlp"  # a new query starts from the first page
    assert explorer.table.page == 0 and len(explorer.table.row_keys) == 10


def test_explorer_diff_row_click_picks_the_tensor(tiny_checkpoint, tiny_tensors):
    import torch

    base = tiny_tensors(layers=2)
    edited = dict(base)
    edited["model.norm.weight"] = torch.ones(base["model.norm.weight"].shape, dtype=torch.bfloat16)
    explorer = Explorer(tiny_checkpoint(base, name="base"), compare=tiny_checkpoint(edited, name="edited"))
    assert explorer.diff_table.row_keys == ["model.norm.weight"]
    explorer.diff_table.selected = "model.norm.weight"
    assert explorer.tensor_picker.value == "model.norm.weight"


def test_bytes_by_layer_table_keeps_layer_order(tmp_path):
    # 12 layers of equal size: a sort by bytes alone shuffled them (0, 2, 1, 3 ...).
    infos = [TensorInfo(f"model.layers.{n}.w.weight", "F32", (4, 4), "a.safetensors") for n in range(12)]
    explorer = Explorer(Catalog.from_infos(infos, root=tmp_path))
    explorer.tabs.selected_index = 1
    assert explorer.bytes_table.row_keys == [f"model.layers.{n}" for n in range(12)]
    assert explorer.bytes_table.selectable is False


def test_html_takes_its_colours_from_the_theme():
    table = frame_table(pd.DataFrame({"x": [1]}))
    assert "#f3f3f3" not in table and "background:var(--jp-layout-color2" in TABLE_STYLE
    assert "color:var(--jp-ui-font-color2" in TABLE_STYLE  # notes: the theme's secondary text colour
    for kind in ("info", "ok", "warning", "error"):
        assert "color:var(--" in message_html("text", kind)
    assert "body[data-jp-theme-light=false]" in message_html("text", "error")


def test_figures_are_transparent_with_neutral_text(llama_sample):
    from matplotlib.image import imread
    from matplotlib.text import Text

    from workbench.explore.checkpoint import open_checkpoint

    fig = open_checkpoint(llama_sample).plot_bytes("layer")
    pixels = imread(io.BytesIO(figure_png(fig)))
    assert pixels.shape[2] == 4 and pixels[0, 0, 3] == 0 and pixels[-1, -1, 3] == 0  # corners see through
    assert np.mean(pixels[..., 3] == 0) > 0.5
    colours = {t.get_color() for t in fig.findobj(Text) if t.get_text()}
    assert colours == {"#888888"}


def test_display_carries_the_page_as_html_and_text(frame):
    table = DataTable(page_size=10)
    table.show(frame, noun="weights")
    data, _ = table._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"] == "<DataTable: rows 1-10 of 23 weights>"
    assert "showing the first 10 of 23 weights" in data["text/html"] and data["text/html"].count("<tr>") == 11


def test_explorer_page_turn_keeps_the_picked_tensor(explorer):
    explorer.fold_toggle.value = False
    explorer.table.selected = explorer.table.row_keys[1]
    picked = explorer.tensor_picker.value
    explorer.table.page = 2
    assert explorer.tensor_picker.value == picked and picked in explorer.details.value
    assert list(explorer.tensor_picker.options[1:]) == list(explorer.rows.index[20:30])


def test_generic_sort_orders_shapes_by_dimensions_and_names_naturally():
    frame = pd.DataFrame({"shape": [(128, 64), (64,), (64, 128), None], "file": ["b.10", "b.9", "a", ""]},
                         index=pd.Index(["layers.10.w", "layers.2.w", "layers.1.w", "norm"], name="name"))
    table = DataTable()
    table.show(frame)
    table.sort_column = "shape"
    assert table.row_keys == ["layers.2.w", "layers.1.w", "layers.10.w", "norm"]  # (64,) < (64, 128) < (128, 64), blank last
    table.sort_column = "name"
    assert table.row_keys == ["layers.1.w", "layers.2.w", "layers.10.w", "norm"]
    table.sort_column = "file"
    assert table.row_keys == ["layers.1.w", "layers.2.w", "layers.10.w", "norm"]  # a, b.9, b.10, blank last


def _contrast(a: str, b: str) -> float:
    def luminance(hex_colour: str) -> float:
        channels = [int(hex_colour[k:k + 2], 16) / 255 for k in (1, 3, 5)]
        r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    light, dark = sorted((luminance(a), luminance(b)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def test_the_selected_row_reads_in_both_themes():
    """Issue 34 item 2: the selected row was white on light blue in JupyterLab Light (the theme's inverse text colour):
    each theme kind gets a fixed text/background pair of at least 4.5:1 (the browser test measures it on the page)."""
    import re

    from workbench.widgets.table import _DATATABLE_CSS

    assert "inverse-font-color" not in _DATATABLE_CSS
    pairs = re.findall(r"(body\[data-jp-theme-light=false\] )?\.wb-datatable \.wb-table tbody tr\.wb-selected\{background:(#\w{6});color:(#\w{3,6})\}",
                       _DATATABLE_CSS)
    assert {bool(dark) for dark, _, _ in pairs} == {False, True}
    for _, background, text in pairs:
        text = text if len(text) == 7 else "#" + "".join(c * 2 for c in text[1:])
        assert _contrast(background, text) >= 4.5, (background, text)
