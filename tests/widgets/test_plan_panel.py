"""PlanPanel: the dry-run as a panel — problems on top, memory timeline with the predicted peak, files read
(and not opened), output layout, per-rank load, and a static HTML copy. No kernel, no browser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench import mapper as M
from workbench.display import format_bytes
from workbench.errors import PlanError
from workbench.mapper import presets
from workbench.planning.rss import peak_step
from workbench.widgets import PlanPanel
from workbench.widgets.plan_panel import (
    FIGURE_TEXT,
    file_groups,
    files_read_figure,
    headline_facts,
    memory_timeline_figure,
    source_files_table,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fused_cast_plan(llama_sample: Path):
    """Fuse q/k/v and gate/up, cast to bf16 in 16 KiB chunks, two ranks: memory is held, work is split."""
    fused = presets.hf_to_fused(llama_sample / "config.json")
    return wb.plan(llama_sample, fused, shard_size="300KB", nproc=2, dtype="bf16", chunk_size="16KiB")


@pytest.fixture(scope="module")
def panel(fused_cast_plan) -> PlanPanel:
    return PlanPanel(fused_cast_plan)


def test_panel_shows_headline_all_clear_and_the_four_views(panel: PlanPanel, fused_cast_plan) -> None:
    assert panel.children[1] is panel.problems_view  # problems come right after the headline, above the tabs
    assert "No problems" in panel.problems_view.value
    assert "706.2 KiB" in panel.headline.value and "ranks: 2" in panel.headline.value
    assert [panel.tabs.get_title(i) for i in range(4)] == ["Memory", "Files read", "Output layout", "Ranks"]
    assert set(panel.images) == {"memory", "files_read", "ranks"}
    assert all(png.startswith(PNG) for png in panel.images.values())
    assert panel.image_views["memory"].value == panel.images["memory"]
    assert "RAM to provision" in panel.headline.value
    assert repr(panel) == "<PlanPanel: 27 groups -> 2 files on 2 rank(s), peak 48.0 KiB, ok>"


def test_memory_view_names_the_predicted_peak_and_the_steps_behind_it(panel: PlanPanel, fused_cast_plan) -> None:
    steps = panel.tables["memory"]
    first = next(s for s in fused_cast_plan.steps if s.index == steps.index[0])
    assert steps["tensors"].iloc[0].startswith(first.group.outputs[0].name)  # each step named by the tensors it makes
    rss = panel.tables["rss"]
    assert rss["bytes"].iloc[-1] == fused_cast_plan.rss_bytes == rss["bytes"].iloc[:-1].sum()
    assert rss.loc["tensor peak", "bytes"] == fused_cast_plan.peak_bytes
    assert steps["held_bytes"].iloc[0] == fused_cast_plan.peak_bytes == 48 * 1024  # each input cast by itself, piece by piece (the concatenation is never held in float32)
    assert steps["held_bytes"].is_monotonic_decreasing
    memory_html = panel.tabs.children[0].children[1].value
    assert "Predicted peak: 48.0 KiB" in memory_html


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_memory_timeline_draws_each_ranks_held_bytes_one_peak_line_and_names_the_peak_tensor(fused_cast_plan) -> None:
    fig = memory_timeline_figure(fused_cast_plan)
    ax = fig.axes[0]
    assert "KiB" in ax.get_ylabel()
    lines = ax.get_lines()
    curves = [line for line in lines if line.get_linestyle() == "-"]
    peaks = [line for line in lines if line.get_linestyle() == "--"]
    assert len(curves) == 2 and len(peaks) == 1  # one curve per rank, one predicted peak
    tops = sorted(max(curve.get_ydata()) for curve in curves)
    assert tops == pytest.approx(sorted(fused_cast_plan.rank_peak_bytes(r) / 1024 for r in range(2)))
    assert list(peaks[0].get_ydata()) == pytest.approx([fused_cast_plan.peak_bytes / 1024] * 2)
    peak = peak_step(fused_cast_plan)
    assert any(peak.group.outputs[0].name in t.get_text() for t in ax.texts)  # the peak is named by its tensor
    legend = " ".join(_legend_texts(fig))
    assert "predicted peak 48.0 KiB" in legend and "held: tensor bytes in memory while the step runs" in legend


def test_eight_ranks_keep_a_three_entry_legend_outside_the_chart(llama_sample: Path) -> None:
    plan = wb.plan(llama_sample, shard_size="100KB", nproc=8, dtype="bf16", chunk_size="16KiB")
    fig = memory_timeline_figure(plan)
    busy = plan.memory["rank"].nunique()
    assert busy >= 4 and len(fig.axes[0].get_lines()) == busy + 1  # a curve per rank with work, one peak line
    assert len(_legend_texts(fig)) == 3 and fig.axes[0].get_legend() is None
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the figure is detached from pyplot: give it a canvas that can lay it out
    canvas.draw()
    renderer = canvas.get_renderer()
    plot_area = fig.axes[0].get_window_extent(renderer)
    assert not _overlaps(fig.legends[0].get_window_extent(renderer), plot_area)


def test_figures_are_transparent_with_neutral_text(panel: PlanPanel) -> None:
    from io import BytesIO

    from matplotlib.image import imread

    for png in panel.images.values():
        pixels = imread(BytesIO(png))
        assert pixels.shape[2] == 4 and pixels[0, 0, 3] == 0  # a transparent corner: the theme shows through
    fig = memory_timeline_figure(panel.plan)
    assert fig.axes[0].title.get_color() == FIGURE_TEXT and fig.patch.get_facecolor()[3] == 0


def test_byte_copy_plan_says_no_tensor_data_is_held_in_a_sentence_not_a_chart(llama_sample: Path) -> None:
    plan = wb.plan(llama_sample)
    assert memory_timeline_figure(plan) is None
    panel = PlanPanel(plan)
    assert "memory" not in panel.images and set(panel.image_views) == {"files_read", "ranks"}
    memory_html = panel.tabs.children[0].children[0].value
    assert "Predicted peak: 0 B" in memory_html and "no memory chart" in memory_html
    assert "held_bytes" not in memory_html and "interpreter" in memory_html  # no steps table, only the RSS parts
    assert panel._repr_html_().count("data:image/png;base64,") == 2


def test_alike_files_are_one_bar_and_the_headline_names_the_spread(tmp_path: Path) -> None:
    from workbench.output.safetensors import save_tensors

    src = tmp_path / "many"
    src.mkdir()
    weight_map = {}
    for k in range(48):
        name = f"model-{k + 1:05d}-of-00048.safetensors"
        save_tensors(src / name, {f"layers.{k}.weight": torch.zeros(64, 64)})
        weight_map[f"layers.{k}.weight"] = name
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    plan = wb.plan(src, shard_size="40KB")
    groups = file_groups(source_files_table(plan))
    assert len(groups) == 1 and groups["count"].iloc[0] == 48
    assert groups["label"].iloc[0] == "model-{00001…00048}-of-00048.safetensors (×48)"
    fig = files_read_figure(plan)
    assert len(fig.axes[0].get_yticklabels()) == 1 and "48 files" in fig.get_suptitle()
    facts = dict(headline_facts(plan))
    assert facts["Output"] == f"{len(plan.output_file_list)} shards, {format_bytes(plan.output_file_list[0].size)} each"


def test_headline_answers_how_much_ram_and_what_peaks(panel: PlanPanel, fused_cast_plan) -> None:
    facts = dict(headline_facts(fused_cast_plan))
    assert list(facts) == ["RAM to provision", "Peak step", "Reads / writes", "Output", "Rank balance"]
    assert facts["RAM to provision"].startswith(f"{format_bytes(fused_cast_plan.rss_bytes)} per process × 2 ranks")
    peak = peak_step(fused_cast_plan)
    assert format_bytes(peak.held_bytes) in facts["Peak step"] and peak.group.outputs[0].name in facts["Peak step"]
    assert format_bytes(fused_cast_plan.bytes_read) in facts["Reads / writes"]
    assert "busiest rank writes" in facts["Rank balance"]
    head = panel.headline.value
    assert head.index("RAM to provision") < head.index("details")  # the answer first, the long summary folded
    assert "var(--jp-ui-font-color1" in head and "#555" not in head


def test_files_read_table_matches_the_plan(panel: PlanPanel, fused_cast_plan) -> None:
    table = panel.tables["files_read"]
    assert list(table.index) == sorted(fused_cast_plan.source.files)
    assert table["bytes_read"].sum() == fused_cast_plan.bytes_read
    assert (table["status"] == "read").all()
    readers = [str(r) for r in range(fused_cast_plan.nproc) if "model-00003-of-00003.safetensors" in fused_cast_plan.reads(r)]
    assert table.loc["model-00003-of-00003.safetensors", "ranks"] == ", ".join(readers)  # the ranks that open it
    html = panel.tabs.children[1].children[1].value
    assert "opens 3 of 3 source files" in html and "model-00003-of-00003.safetensors" in html


def test_files_never_opened_are_shown_as_such(llama_sample: Path) -> None:
    plan = wb.plan(llama_sample, M.Rename("model.embed_tokens.weight", "embed.weight"), rest="drop")
    table = source_files_table(plan)
    assert table["status"].to_dict() == {
        "model-00001-of-00003.safetensors": "read",
        "model-00002-of-00003.safetensors": "not opened",
        "model-00003-of-00003.safetensors": "not opened",
    }
    assert table.loc["model-00001-of-00003.safetensors", "bytes_read"] == 64 * 1024
    panel = PlanPanel(plan)
    assert "opens 1 of 3 source files" in panel.tabs.children[1].children[1].value
    assert "not opened" in panel._repr_html_()


def test_output_layout_and_rank_load(panel: PlanPanel, fused_cast_plan) -> None:
    layout = panel.tabs.children[2].children[0].value
    assert "2 shards and model.safetensors.index.json" in layout
    assert "model.layers.0.self_attn.qkv_proj.weight" in layout and "[128, 64]" in layout
    for name in fused_cast_plan.output_files["file"]:
        assert name in layout
    ranks = panel.tables["ranks"]
    assert list(ranks.index) == [0, 1]
    assert ranks["bytes_written"].sum() == fused_cast_plan.bytes_written
    assert ranks["bytes_read"].sum() == fused_cast_plan.bytes_read
    assert ranks["output_files"].to_list() == [len(fused_cast_plan.rank_files(r)) for r in (0, 1)]  # a shared file counts for both
    assert list(ranks["peak_bytes"]) == [fused_cast_plan.rank_peak_bytes(r) for r in (0, 1)]


def test_errors_and_warnings_sit_at_the_top(llama_sample: Path) -> None:
    typo = wb.plan(llama_sample, M.Rename("model.layers.{i}.self_attn.o_prj.weight", "o.{i}"))
    panel = PlanPanel(typo)
    text = panel.problems_view.value
    assert "1 error(s): this conversion cannot run" in text and "o_prj" in text and "wb-error" in text
    assert "o_proj" in text  # the message's suggestion reaches the user

    oversized = PlanPanel(wb.plan(llama_sample, shard_size="10KB"))
    assert "wb-warning" in oversized.problems_view.value and "larger than the shard size" in oversized.problems_view.value
    assert "wb-error" not in oversized.problems_view.value


def test_static_html_carries_problems_tables_and_figures(panel: PlanPanel) -> None:
    static = panel._repr_html_()
    assert static.count("data:image/png;base64,") == 3
    for title in ("Memory", "Files read", "Output layout", "Ranks"):
        assert f"<summary><b>{title}</b></summary>" in static
    assert "No problems" in static and "Predicted peak: 48.0 KiB" in static
    bundle = panel._repr_mimebundle_()
    assert bundle["text/html"] == static and "application/vnd.jupyter.widget-view+json" in bundle


def test_panel_refuses_what_is_not_a_plan(llama_sample: Path) -> None:
    with pytest.raises(PlanError, match="wb.plan"):
        PlanPanel(llama_sample)


def test_the_memory_table_numbers_steps_as_the_chart_axis_does(panel: PlanPanel, fused_cast_plan) -> None:
    """Issue 34 item 7: the chart's x is each rank's own schedule; the table's 'rank step' is that same number."""
    steps = panel.tables["memory"]
    for index, row in steps.iterrows():
        schedule = [s.index for s in fused_cast_plan.steps if s.rank == row["rank"] and fused_cast_plan.step_active(s)]
        assert schedule.index(index) == row["rank step"]
    top = steps.index[0]
    assert f"at step {top} (rank {steps['rank'].iloc[0]}&#x27;s step {steps['rank step'].iloc[0]} on the memory chart" in panel.headline.value
