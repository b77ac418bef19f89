"""Explorer widget, driven like a user: set control values, click buttons, read what the widget shows."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from workbench.catalog import Catalog, TensorInfo
from workbench.errors import WorkbenchError
from workbench.widgets import Explorer
from workbench.widgets.explorer import name_mask


def body_rows(table_html: str) -> int:
    """Rows in the <tbody> of a table the widget rendered."""
    body = table_html.split("<tbody>", 1)[1] if "<tbody>" in table_html else ""
    return body.count("<tr>")


@pytest.fixture
def explorer(llama_sample):
    return Explorer(llama_sample)


def test_opens_folded_with_counts_and_ranges(explorer):
    assert "39 of 39 tensors match, folded into 12 patterns" in explorer.count_label.value
    table = explorer.table.value
    assert "model.layers.{i}.mlp.up_proj.weight" in table
    assert "×4" in table and "0-3" in table
    assert body_rows(table) == 12
    assert list(explorer.rows.index[:2]) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert explorer.rows.loc["model.layers.{i}.self_attn.k_proj.weight", "count"] == 4
    assert explorer.rows.loc["model.layers.{i}.self_attn.k_proj.weight", "nbytes"] == 4 * 32 * 64 * 4


@pytest.mark.parametrize(
    ("text", "mode", "matched"),
    [
        ("mlp", "glob", 12),  # a whole segment anywhere in the name
        ("MLP", "glob", 0),  # names are case-sensitive
        ("proj", "glob", 0),  # not a whole segment
        ("*proj*", "glob", 28),
        ("layers.{i}.self_attn.*", "glob", 16),  # the filter box's own example: a template with a glob
        ("*.k_proj.*", "glob", 4),
        ("model.layers.{i}.self_attn.q_proj.weight", "glob", 4),
        (r"layers\.[13]\.", "regex", 18),
        ("norm", "regex", 9),
    ],
)
def test_filter_by_glob_template_substring_and_regex(explorer, text, mode, matched):
    explorer.match_mode.value = mode
    explorer.filter_box.value = text
    assert f"{matched} of 39 tensors match" in explorer.count_label.value
    explorer.fold_toggle.value = False
    assert len(explorer.rows) == matched
    assert body_rows(explorer.table.value) == matched


def test_bad_regex_is_a_message_not_a_traceback(explorer):
    explorer.match_mode.value = "regex"
    explorer.filter_box.value = "(["
    assert "Cannot filter by regex" in explorer.count_label.value
    explorer.filter_box.value = "layers\\.(1"
    assert "Cannot filter by regex &#x27;layers\\.(1&#x27;" in explorer.count_label.value  # as typed: no doubled backslash
    assert explorer.error is not None and explorer.table.value == ""
    assert len(explorer.rows) == 0 and explorer.tensor_picker.options == ()
    explorer.filter_box.value = "lm_head"
    assert explorer.error is None and len(explorer.rows) == 1


def test_name_mask_rejects_bad_regex():
    with pytest.raises(WorkbenchError, match="regex"):
        name_mask(pd.Index(["a"]), "(", "regex")
    assert name_mask(pd.Index(["a.1.b", "a.2.b", "c"]), "a.{i}.b").tolist() == [True, True, False]


def test_filter_with_no_match_explains_the_rule(explorer):
    explorer.filter_box.value = "attn"
    assert "0 of 39 tensors match" in explorer.count_label.value
    assert "write &#x27;*attn*&#x27;" in explorer.count_label.value
    explorer.filter_box.value = "layers.{i"
    assert "malformed placeholder" in explorer.count_label.value and explorer.error is not None


def test_unfolded_sort_orders(tiny_checkpoint):
    explorer = Explorer(tiny_checkpoint(layers=11))
    explorer.fold_toggle.value = False
    explorer.filter_box.value = "*.input_layernorm.weight"
    names = list(explorer.rows.index)
    assert names.index("model.layers.10.input_layernorm.weight") == 10  # natural order: 10 after 9
    explorer.filter_box.value = ""
    explorer.sort_by.value = "nbytes"
    explorer.descending.value = True
    sizes = explorer.rows["nbytes"].tolist()
    assert sizes == sorted(sizes, reverse=True)
    explorer.sort_by.value = "disk"
    explorer.descending.value = False
    assert list(explorer.rows.index) == list(explorer.checkpoint.tensors.index)


def test_table_is_bounded_with_a_count(explorer):
    explorer.fold_toggle.value = False
    explorer.max_rows.value = 5
    assert body_rows(explorer.table.value) == 5
    assert "showing the first 5 of 39 tensors" in explorer.table.value
    assert len(explorer.rows) == 39  # the full table stays available to code


def test_pick_a_tensor_then_stats_and_histogram_on_demand(tiny_checkpoint, tiny_tensors):
    tensors = tiny_tensors(layers=2)
    explorer = Explorer(tiny_checkpoint(tensors))
    explorer.filter_box.value = "*.k_proj.*"
    assert explorer.tensor_picker.options == ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight")
    name = "model.layers.1.self_attn.k_proj.weight"
    explorer.tensor_picker.value = name
    details = explorer.details.value
    assert "F32" in details and "[4, 8]" in details and "model.safetensors" in details
    assert "model.layers.{i}.self_attn.k_proj.weight (×2, 0-1)" in details
    assert explorer.stats_view.value == "" and explorer.histogram_output.outputs == ()  # nothing read yet
    explorer.stats_button.click()
    value = tensors[name]
    for figure in (float(value.min()), float(value.max())):
        assert f"{figure:.6g}" in explorer.stats_view.value
    explorer.histogram_button.click()
    (shown,) = explorer.histogram_output.outputs
    assert "image/png" in shown["data"]
    explorer.tensor_picker.value = "model.layers.0.self_attn.k_proj.weight"
    assert explorer.histogram_output.outputs == () and explorer.stats_view.value == ""


def test_select_shows_a_tensor_hidden_by_the_filter(explorer):
    explorer.filter_box.value = "mlp"
    explorer.select("lm_head.weight")
    assert "lm_head.weight" in explorer.details.value
    with pytest.raises(WorkbenchError, match="lm_head"):
        explorer.select("lm_head.weights")


def test_bytes_plots_by_layer_file_and_dtype(explorer):
    assert explorer.bytes_output.outputs == ()  # drawn only when the tab is opened
    explorer.tabs.selected_index = 1
    assert "image/png" in explorer.bytes_output.outputs[0]["data"]
    assert "model.layers.0" in explorer.bytes_table.value
    explorer.bytes_by.value = "file"
    assert len(explorer.bytes_output.outputs) == 1
    assert explorer.bytes_table.value.count("model-0000") == 3
    explorer.bytes_by.value = "dtype"
    assert "F32" in explorer.bytes_table.value and "706.2 KiB" in explorer.bytes_table.value


def test_compare_shows_added_removed_and_changed(tiny_checkpoint, tiny_tensors):
    import torch

    base = tiny_tensors(layers=2)
    edited = dict(base)
    del edited["lm_head.weight"]
    edited["model.extra.bias"] = torch.zeros(3)
    edited["model.norm.weight"] = base["model.norm.weight"].to(torch.bfloat16)
    edited["model.layers.1.self_attn.k_proj.weight"] = base["model.layers.1.self_attn.k_proj.weight"][:2].clone()
    nudged = base["model.layers.0.mlp.up_proj.weight"].clone()
    nudged[0, 0] += 0.5
    edited["model.layers.0.mlp.up_proj.weight"] = nudged
    explorer = Explorer(tiny_checkpoint(base, name="a"), compare=tiny_checkpoint(edited, name="b"))
    assert explorer.tabs.titles == ("Tensors", "Bytes", "Compare")
    summary = explorer.diff_summary.value
    for part in ("1 added", "1 removed", "1 dtype changed", "1 shape changed"):
        assert part in summary
    assert "values changed" not in summary  # headers only until asked
    explorer.diff_status.value = "removed"
    assert "lm_head.weight" in explorer.diff_table.value and "model.extra.bias" not in explorer.diff_table.value
    explorer.diff_status.value = "all"
    explorer.filter_box.value = "extra"
    assert "model.extra.bias" in explorer.diff_table.value and "lm_head" not in explorer.diff_table.value
    explorer.filter_box.value = ""
    explorer.values_button.click()
    assert "1 values changed" in explorer.diff_summary.value and "(values compared)" in explorer.diff_summary.value
    assert explorer.diff(values=True).loc["model.layers.0.mlp.up_proj.weight", "max_abs_diff"] == pytest.approx(0.5)


def test_display_carries_a_static_html_copy(explorer):
    explorer.filter_box.value = "q_proj"
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "model.layers.{i}.self_attn.q_proj.weight" in bundle["text/html"]
    assert bundle["text/plain"] == "<Explorer of tiny-llama: 39 tensors (hf-sharded)>"


def test_large_catalog_stays_bounded_and_quick():
    infos = [
        TensorInfo(f"model.layers.{layer}.experts.{e}.w{k}.weight", "BF16", (8, 4), f"shard-{layer}.safetensors")
        for layer in range(40)
        for e in range(100)
        for k in (1, 2, 3)
    ]
    explorer = Explorer(Catalog.from_infos(infos, root="/nowhere/big"))
    assert "12,000 of 12,000 tensors match, folded into 3 patterns" in explorer.count_label.value
    assert "i=0-39; j=0-99" in explorer.table.value
    explorer.fold_toggle.value = False
    explorer.filter_box.value = "*.w2.*"
    assert "4,000 of 12,000 tensors match" in explorer.count_label.value
    assert body_rows(explorer.table.value) == 50 and "showing the first 50 of 4,000 tensors" in explorer.table.value
    assert len(explorer.tensor_picker.options) == 50  # bounded work per keystroke; its speed is a benchmark's


def test_widgets_import_and_explorer_do_not_import_torch(llama_sample):
    code = (
        "import sys; import workbench.widgets as w; assert 'torch' not in sys.modules and 'ipywidgets' not in sys.modules;"
        f"e = w.Explorer({str(llama_sample)!r}); e.filter_box.value = 'mlp';"
        f"b = w.MapperBuilder({str(llama_sample)!r}, preset='hf_to_fused');"
        "assert 'torch' not in sys.modules, 'torch imported'; print(sorted(w.__all__))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(r"'Explorer'.*'MapperBuilder'", done.stdout)


def test_natural_rank_matches_layers_natural_key(tiny_checkpoint):
    from workbench.explore.layers import natural_key

    explorer = Explorer(tiny_checkpoint(layers=12))
    index = explorer.checkpoint.tensors.index
    rank = explorer._natural_rank().to_numpy()
    assert list(index[np.argsort(rank)]) == sorted(index, key=natural_key)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_format_columns_show_in_table_and_details(samples_dir):
    explorer = Explorer(samples_dir / "training" / "dcp_pp")
    assert list(explorer.rows.columns[-2:]) == ["chunks", "stage"]
    assert explorer.rows.loc["model.norm.weight", "stage"] == 1  # folded rows keep a value all members share
    assert "<th>stage</th>" in explorer.table.value
    explorer.fold_toggle.value = False
    assert explorer.rows["stage"].to_dict() == explorer.checkpoint.tensors["stage"].to_dict()
    explorer.select("model.head.weight")
    assert "<th>stage</th><td>1</td>" in explorer.details.value and "<th>chunks</th><td>1</td>" in explorer.details.value

    tied = Explorer(samples_dir / "training" / "torch" / "pytorch_model.bin", max_rows=10)
    assert "<th>shared_with</th>" in tied.table.value
    tied.select("lm_head.weight")
    assert "<th>shared_with</th><td>embed.weight</td>" in tied.details.value
    tied.select("norm.weight")  # not shared: no empty row
    assert "shared_with" not in tied.details.value


def test_folded_format_column_counts_differing_values():
    infos = [TensorInfo(f"layers.{i}.w", "F32", (2,)) for i in range(4)] + [TensorInfo("head.w", "F32", (2,))]
    catalog = Catalog.from_infos(infos)
    catalog.columns = {"stage": {f"layers.{i}.w": i // 2 for i in range(4)}, "unit": {f"layers.{i}.w": "block" for i in range(4)}}
    explorer = Explorer(catalog)
    assert explorer.rows.loc["layers.{i}.w", "stage"] == "2 values"
    assert explorer.rows.loc["layers.{i}.w", "unit"] == "block"
    assert explorer.rows.loc["head.w", "stage"] is None or pd.isna(explorer.rows.loc["head.w", "stage"])
    assert "&lt;NA&gt;" not in explorer.table.value and "2 values" in explorer.table.value
    explorer.fold_toggle.value = False
    assert str(explorer.rows["stage"].dtype) == "Int64" and "&lt;NA&gt;" not in explorer.table.value


def test_one_pattern_is_singular_and_the_bytes_tab_has_no_redundant_plot_button(explorer):
    """Issue 34 item 7: "folded into 1 pattern", and the Bytes tab redraws on its own (no "Plot" button shown)."""
    explorer.filter_box.value = "mlp.up_proj"
    assert "folded into 1 pattern " in explorer.count_label.value.replace("—", " ")
    bytes_tab = explorer.tabs.children[1]
    assert explorer.plot_button not in bytes_tab.children and explorer.bytes_by in bytes_tab.children
    explorer.tabs.selected_index = 1  # opening the tab draws
    assert "layer" in explorer.bytes_table.value
    explorer.bytes_by.value = "dtype"  # choosing redraws
    assert "F32" in explorer.bytes_table.value and "layer" not in explorer.bytes_table.value
