"""Value statistics (chunked), histograms and byte plots."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest
import torch

import workbench as wb
from workbench.iostats import IO

matplotlib.use("Agg")


def finite_reference(t: torch.Tensor) -> dict:
    x = t.to(torch.float64).flatten()
    x = x[torch.isfinite(x)]
    return {"min": float(x.min()), "max": float(x.max()), "mean": float(x.mean()), "std": float(x.std())}


def assert_close_stats(row, ref):
    for key in ("min", "max", "mean", "std"):
        assert math.isclose(row[key], ref[key], rel_tol=1e-9, abs_tol=1e-12), (key, row[key], ref[key])


@pytest.mark.parametrize("chunk_elements", [1, 7, 100, 1 << 22])
def test_stats_match_torch_for_any_chunk_size(llama_sample, chunk_elements):
    ck = wb.open_checkpoint(llama_sample)
    names = ["model.layers.1.self_attn.v_proj.weight", "model.norm.weight"] if chunk_elements == 1 else ck.select("*")
    table = ck.stats(names, chunk_elements=chunk_elements)
    assert list(table.index) == list(names)
    for name in names:
        tensor = ck.load(name)
        row = table.loc[name]
        assert math.isclose(row["min"], float(tensor.min())) and math.isclose(row["max"], float(tensor.max()))
        assert math.isclose(row["mean"], float(tensor.double().mean()), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(row["std"], float(tensor.double().std()), rel_tol=1e-9)
        assert row["nan"] == 0 and row["inf"] == 0
        assert row["numel"] == tensor.numel() and row["dtype"] == "F32"


def test_stats_count_nan_and_inf_and_skip_them(tiny_checkpoint):
    torch.manual_seed(0)
    x = torch.randn(1000)
    x[[3, 500, 999]] = float("nan")
    x[[10, 11]] = float("inf")
    x[700] = float("-inf")
    half = torch.randn(64, 3).to(torch.bfloat16)
    half[0, 0] = float("nan")
    ck = wb.open_checkpoint(tiny_checkpoint({"x": x, "half": half, "ids": torch.arange(-5, 10)}, single_file=True))
    table = ck.stats(["x", "half", "ids"], chunk_elements=64)
    assert table.loc["x", "nan"] == 3 and table.loc["x", "inf"] == 3
    assert_close_stats(table.loc["x"], finite_reference(x))
    assert table.loc["half", "nan"] == 1 and table.loc["half", "inf"] == 0
    assert_close_stats(table.loc["half"], finite_reference(half))
    assert table.loc["ids", "min"] == -5 and table.loc["ids", "max"] == 9 and table.loc["ids", "mean"] == 2.0
    assert table.loc["ids", "dtype"] == "I64"


def test_stats_read_in_bounded_chunks(tiny_checkpoint):
    ck = wb.open_checkpoint(tiny_checkpoint({"big": torch.randn(100, 10), "other": torch.randn(5000)}, single_file=True))
    IO.reset()
    ck.stats("big", chunk_elements=128)
    snap = IO.snapshot()
    assert snap["bytes_read"] == 1000 * 4  # only this tensor, nothing of "other"
    assert snap["read_calls"] == math.ceil(1000 / 128)


def test_stats_of_degenerate_tensors(tiny_checkpoint):
    ck = wb.open_checkpoint(
        tiny_checkpoint({"one": torch.tensor([2.0]), "empty": torch.zeros(0), "nans": torch.full((4,), float("nan"))}, single_file=True)
    )
    table = ck.stats(["one", "empty", "nans"])
    assert table.loc["one", "min"] == 2.0 and math.isnan(table.loc["one", "std"])
    assert math.isnan(table.loc["empty", "mean"]) and table.loc["empty", "nan"] == 0
    assert table.loc["nans", "nan"] == 4 and math.isnan(table.loc["nans", "max"])


def test_stats_by_template(llama_sample):
    table = wb.open_checkpoint(llama_sample).stats("model.layers.{i}.post_attention_layernorm.weight")
    assert list(table.index) == [f"model.layers.{i}.post_attention_layernorm.weight" for i in range(4)]
    assert (table["min"] == 1.0).all() and (table["std"] == 0.0).all()  # RMSNorm weights start at ones


def test_stats_unknown_name(llama_sample):
    with pytest.raises(wb.CheckpointError, match="Did you mean"):
        wb.open_checkpoint(llama_sample).stats("model.norm.weights")


def bar_heights(fig):
    (ax,) = fig.axes
    return [p.get_width() for p in ax.patches], [t.get_text() for t in ax.get_yticklabels()]


def test_plot_bytes_by_file_dtype_layer(llama_sample):
    ck = wb.open_checkpoint(llama_sample)
    widths, labels = bar_heights(ck.plot_bytes(by="file"))
    assert labels == list(ck.files.index)
    assert np.allclose(np.array(widths) * 1024, ck.files["tensor_bytes"].to_numpy())  # KiB axis
    widths, labels = bar_heights(ck.plot_bytes(by="dtype"))
    assert labels == ["F32"] and np.isclose(widths[0] * 1024, 723_200)
    widths, labels = bar_heights(ck.plot_bytes(by="layer"))
    assert labels == ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "model.norm"]
    assert np.isclose(sum(widths) * 1024, 723_200)
    with pytest.raises(wb.WorkbenchError, match="choose one of"):
        ck.plot_bytes(by="colour")


def test_plot_histogram_counts_finite_values(tiny_checkpoint):
    x = torch.linspace(-1, 1, 1001)
    x[0] = float("nan")
    ck = wb.open_checkpoint(tiny_checkpoint({"x": x}, single_file=True))
    fig = ck.plot_histogram("x", bins=10, chunk_elements=97)
    (ax,) = fig.axes
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 10 and sum(heights) == 1000
    assert "x (F32 [1001])" in ax.get_title()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8, torch.bool])
def test_stats_of_every_widened_dtype_match_torch_across_blocks(tiny_checkpoint, dtype):
    from workbench.explore.stats import BLOCK_ELEMENTS

    torch.manual_seed(1)
    values = (torch.randn(BLOCK_ELEMENTS * 2 + 17) * 40).to(dtype) if dtype != torch.bool else torch.rand(BLOCK_ELEMENTS * 2 + 17) > 0.3
    ck = wb.open_checkpoint(tiny_checkpoint({"v": values}, single_file=True))
    row = ck.stats(["v"], chunk_elements=BLOCK_ELEMENTS + 5).loc["v"]  # chunks and blocks that do not line up
    assert_close_stats(row, finite_reference(values))


def test_histogram_counts_equal_numpy_and_a_known_range_reads_once(tiny_checkpoint):
    from workbench.explore.stats import histogram

    torch.manual_seed(2)
    x = torch.randn(100_003)
    x[5] = float("nan")
    x[6] = float("inf")
    ck = wb.open_checkpoint(tiny_checkpoint({"x": x}, single_file=True))
    seen = []
    counts, edges = histogram(ck.catalog, "x", bins=37, chunk_elements=4099, on_read=seen.append)
    finite = x[torch.isfinite(x)].double().numpy()
    expected, expected_edges = np.histogram(finite, bins=37, range=(finite.min(), finite.max()))
    assert np.array_equal(edges, expected_edges) and np.array_equal(counts, expected)
    assert sum(seen) == 2 * x.nbytes  # the range pass, then the counts
    seen.clear()
    counts, _ = histogram(ck.catalog, "x", bins=4, value_range=(-1.0, 1.0), on_read=seen.append)
    assert np.array_equal(counts, np.histogram(finite, bins=4, range=(-1.0, 1.0))[0])  # outside the range: left out
    assert sum(seen) == x.nbytes
