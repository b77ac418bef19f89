"""The notebooks in a real JupyterLab, driven by headless chromium: run all cells, use the widgets like a
user (type a filter, choose in dropdowns, click), check they rendered as widgets, and save screenshots
(to a temporary folder; `make screenshots` refreshes docs/; look at them: a widget shown as text would still be in the DOM)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_harness import (
    ALL_RAN,
    KERNEL_READY,
    PANEL,
    JupyterLab,
    LabFolder,
    browser_available,
    lab_folder,
    open_notebook,
    screenshot_dir,
)

REPO = Path(__file__).resolve().parents[2]
UNAVAILABLE = browser_available()

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

# Outputs (and prompt numbers) saved in the file are cleared first, so ALL_RAN sees only this run. Run-all is
# started without awaiting it in page.evaluate (which has no timeout); completion is polled with ALL_RAN.
RUN_ALL = """async () => {
  await window.galata.app.commands.execute('notebook:clear-all-cell-outputs');
  window.galata.app.commands.execute('notebook:run-all-cells');
}"""


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    # Render every cell (no lazy windowing), so widgets in late cells are in the DOM to be found and scrolled to.
    no_windowing = {"@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"}}
    with lab_folder(lab_server, Path(__file__).stem, samples=("tiny-llama", "tiny-bert"), settings=no_windowing) as folder:
        shutil.copytree(REPO / "notebooks", folder.root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        yield folder



def run_notebook(browser: object, lab: LabFolder, notebook: str) -> object:
    """Open a notebook, wait for its kernel, run every cell and wait until all have run."""
    page = browser.new_page(viewport={"width": 1500, "height": 1500})  # type: ignore[attr-defined]
    open_notebook(page, lab, f"notebooks/{notebook}")
    page.wait_for_function(KERNEL_READY, timeout=60_000)
    page.evaluate(RUN_ALL)
    try:
        page.wait_for_function(ALL_RAN, timeout=120_000)
    except Exception:
        page.screenshot(path=str(lab.state / f"{notebook}.timeout.png"))
        raise
    return page


def assert_rendered_as_widget(page: object, selector: str, raw_text: str) -> None:
    panel = page.locator(PANEL)  # type: ignore[attr-defined]
    widget = panel.locator(selector)
    try:
        widget.wait_for(timeout=30_000)
    except Exception:
        page.screenshot(path=str(Path(tempfile.gettempdir()) / "workbench-browser-failure.png"))  # type: ignore[attr-defined]
        raise AssertionError(f"{selector} is not on the page: the widget did not render") from None
    assert widget.count() == 1
    assert widget.locator(".widget-button").count() > 0 and panel.locator(".jupyter-widgets").count() > 0
    text = panel.inner_text()
    assert "Loading widget" not in text and "Error displaying widget" not in text
    assert raw_text not in text, f"the widget shows as text ({raw_text!r})"


def screenshot(widget: object, name: str) -> Path:
    path = screenshot_dir() / name
    widget.scroll_into_view_if_needed()  # type: ignore[attr-defined]
    widget.screenshot(path=str(path))  # type: ignore[attr-defined]
    return path


def test_explorer_filters_and_picks_in_jupyterlab(browser: object, lab: LabFolder) -> None:
    page = run_notebook(browser, lab, "01_explore.ipynb")
    try:
        assert_rendered_as_widget(page, ".wb-explorer", "<Explorer of")
        explorer = page.locator(f"{PANEL} .wb-explorer")
        explorer.scroll_into_view_if_needed()
        box = explorer.locator(".wb-explorer-filter input")
        box.fill("")
        box.type("mlp")
        box.press("Enter")
        # The picker is updated last after a filter change; once it lists only mlp tensors, the table is there too.
        page.wait_for_function(
            "() => { const s = document.querySelector('.wb-explorer-pick select');"
            " return s && s.options.length === 12 && [...s.options].every(o => o.text.includes('.mlp.')); }",
            timeout=20_000,
        )
        assert "12 of 39 tensors match, folded into 3 patterns" in explorer.locator(".wb-explorer-count").inner_text()
        assert "model.layers.{i}.mlp.up_proj.weight" in explorer.locator(".wb-explorer-table").inner_text()
        explorer.locator(".wb-explorer-pick select").select_option(label="model.layers.1.mlp.up_proj.weight")
        explorer.locator(".wb-explorer-stats").click()
        explorer.locator(".wb-explorer-details").filter(has_text="[128, 64]").wait_for(timeout=20_000)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.wb-explorer table.wb-table')].some(t => t.innerText.includes('std'))",
            timeout=30_000,
        )
        screenshot(explorer, "explorer.png")
    finally:
        page.close()  # type: ignore[attr-defined]


def test_builder_adds_an_operation_and_exports_in_jupyterlab(browser: object, lab: LabFolder) -> None:
    page = run_notebook(browser, lab, "02_build_mapper.ipynb")
    try:
        assert_rendered_as_widget(page, ".wb-builder", "<MapperBuilder over")
        builder = page.locator(f"{PANEL} .wb-builder")
        builder.scroll_into_view_if_needed()
        steps = builder.locator(".wb-builder-steps select option")
        assert steps.count() == 2  # the two Concat steps the notebook added
        builder.locator(".wb-builder-op button").filter(has_text="Cast").click()
        builder.locator(".wb-builder-suggest select").select_option(label="model.norm.weight")
        builder.locator(".wb-builder-add-source").click()
        page.wait_for_function(
            "() => document.querySelector('.wb-builder-sources textarea').value.trim() === 'model.norm.weight'", timeout=20_000
        )
        builder.locator(".wb-builder-add").click()
        # The form message is set last after a click; once it shows, the kernel's earlier updates have arrived too.
        builder.locator(".wb-builder-form-message").filter(has_text="Added step 3").wait_for(timeout=20_000)
        assert builder.locator(".wb-builder-steps option").filter(has_text="cast model.norm.weight → BF16").count() == 1
        preview = builder.locator(".wb-builder-preview")
        page.wait_for_function(
            "() => /model\\.norm\\.weight\\s+×?1?\\s*BF16/.test(document.querySelector('.wb-builder-preview').innerText)", timeout=20_000
        )
        assert "qkv_proj" in preview.inner_text()

        builder.locator(".lm-TabBar-tab", has_text="Export").click()
        assert builder.locator(".wb-clipboard-button").is_visible()  # the HTML snippet's button survived rendering
        code = builder.locator(".wb-builder-code-area textarea")
        assert "M.Cast('model.norm.weight', 'BF16')" in code.input_value()
        builder.locator(".wb-builder-save-path input").fill("browser_mapper.py")
        builder.locator(".wb-builder-save-path input").press("Enter")
        builder.locator(".wb-builder-save").click()
        # The notebook's own save left a "Saved ..." message: wait for the one naming this file.
        builder.locator(".wb-builder-export-message").filter(has_text="browser_mapper.py").wait_for(timeout=20_000)
        saved = lab.root / "notebooks" / "browser_mapper.py"
        namespace: dict = {}
        exec(saved.read_text(), namespace)
        assert "model.norm.weight" in repr(namespace["mapper"]) and "BF16" in repr(namespace["mapper"])

        builder.locator(".lm-TabBar-tab", has_text="Graph").click()
        builder.locator(".wb-builder-graph svg.wbg").wait_for(timeout=30_000)  # the graph is SVG with real text
        graph_text = builder.locator(".wb-builder-graph svg.wbg").inner_html()
        assert "×4" in graph_text and "[128, 64]" in graph_text, graph_text[:500]
        builder.locator(".lm-TabBar-tab", has_text="Preview").click()
        screenshot(builder, "builder.png")
    finally:
        page.close()  # type: ignore[attr-defined]
