"""The MapperBuilder's Merge form in a real JupyterLab (issue 32 item 6): over two sources, click Merge, choose
SLERP, type a gradient for `t`; the per-layer table shows the values each layer uses, an unknown method is a
message, and the added step is exported as `M.MergeModels(...)`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_harness import (
    KERNEL_READY,
    PANEL,
    JupyterLab,
    LabFolder,
    browser_available,
    code_notebook,
    lab_folder,
    open_notebook,
    screenshot_dir,
)

UNAVAILABLE = browser_available()

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

# Two sources (the sample twice: the form reads names and shapes only).
CELL = ("from workbench.widgets import MapperBuilder\n"
        "sample = 'sample_checkpoints/tiny-llama'\n"
        "MapperBuilder({'ft1': sample, 'ft2': sample})")
EXPORTED = "M.MergeModels('slerp', ['ft1', 'ft2'], base_model='ft1', parameters={'t': [0, 0.5, 1]})"


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem, {"merge.ipynb": code_notebook([CELL])}) as folder:
        yield folder


def test_slerp_merge_by_clicking_shows_the_layer_table_and_exports(browser: object, lab: LabFolder) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1600})  # type: ignore[attr-defined]
    try:
        open_notebook(page, lab, "merge.ipynb")
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        page.evaluate("() => { window.galata.app.commands.execute('notebook:run-all-cells'); }")
        builder = page.locator(f"{PANEL} .wb-builder")
        builder.wait_for(timeout=60_000)
        builder.locator(".wb-builder-op button").filter(has_text="Merge").first.click()
        form = builder.locator(".wb-merge-form")
        form.wait_for(state="visible", timeout=20_000)
        assert form.locator(".wb-merge-models select").evaluate("s => [...s.selectedOptions].map(o => o.text)") == ["ft1", "ft2"]

        method = form.locator(".wb-merge-method input")
        method.fill("slurp")
        message = form.locator(".wb-merge-message")
        message.filter(has_text="unknown method").wait_for(timeout=20_000)
        method.fill("slerp")
        message.filter(has_text="t is required").wait_for(timeout=20_000)
        assert form.locator(".wb-merge-base select").evaluate("s => s.options[s.selectedIndex].text") == "ft1"
        form.locator(".wb-merge-param-t input").fill("0, 0.5, 1")
        message.filter(has_text="39 tensors merged").wait_for(timeout=20_000)
        rows = form.locator(".wb-merge-table tr").evaluate_all("rows => rows.map(r => [...r.cells].map(c => c.innerText.trim()))")
        assert rows[0] == ["layer", "t"], rows
        assert rows[1:6] == [["outside layers", "0"], ["0", "0"], ["1", "0.3333"], ["2", "0.6667"], ["3", "1"]], rows
        form.scroll_into_view_if_needed()
        form.screenshot(path=str(screenshot_dir() / "builder-merge.png"))

        builder.locator(".wb-builder-add").click()
        builder.locator(".wb-builder-form-message").filter(has_text="Added step 1: merge ft1 + ft2 by slerp").wait_for(timeout=20_000)
        builder.locator(".lm-TabBar-tab", has_text="Export").click()
        code = builder.locator(".wb-builder-code-area textarea").input_value()
        assert EXPORTED in code, code
    finally:
        page.close()  # type: ignore[attr-defined]
