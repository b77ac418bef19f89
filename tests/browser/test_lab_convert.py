"""Notebook 03 in a real JupyterLab, driven by headless chromium: run every cell, then check that the
2-rank RunPanel rendered as a widget with one bar per rank, both bars full and green, the status "Done"
and the report shown; save a screenshot run_panel.png (to a temporary folder; `make screenshots` refreshes docs/)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_harness import (
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

# Fired, not awaited: evaluate() has no timeout, and the command's promise does not always settle.
RUN_ALL = "() => { window.galata.app.commands.execute('notebook:run-all-cells'); }"
# The notebook's context and kernel are ready (the idle indicator alone can come before the kernel is connected).
KERNEL_READY = """async () => {
  const widget = window.galata.app.shell.currentWidget;
  const ready = (async () => {
    await widget.context.ready;
    await widget.sessionContext.ready;
    await widget.sessionContext.session.kernel.info;
    return 'ready';
  })();
  return await Promise.race([ready, new Promise(done => setTimeout(() => done('timed out'), 60000))]);
}"""
# Every code cell has run: each prompt shows a number (not '*' for running, not empty for queued).
ALL_RAN = """() => {
  const panel = [...document.querySelectorAll('.jp-NotebookPanel')].find(p => !p.classList.contains('lm-mod-hidden'));
  if (!panel) return false;
  const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim());
  return prompts.length > 0 && prompts.every(t => /^\\[\\d+\\]:$/.test(t));
}"""
# Tracebacks shown in the notebook (warnings on stderr are not errors).
ERRORS = """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) [data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(o => o.innerText).filter(t => t.includes('Traceback')).map(t => t.slice(-2000))"""
PROMPTS = """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')]
  .map(p => p.textContent.trim()).join(' ')"""
# Per RunPanel on the page: its rank count, each bar's fill (% width) and style classes, and its status text.
RUN_PANELS = """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .wb-run')].map(panel => ({
  bars: [...panel.querySelectorAll('.wb-run-bar')].map(bar => {
    const fill = bar.querySelector('.progress-bar');
    return {width: fill ? fill.style.width : null, classes: fill ? fill.className : '', label: bar.innerText.trim()};
  }),
  labels: [...panel.querySelectorAll('.wb-run-bar-label')].map(label => label.innerText.trim()),
  status: (panel.querySelector('.wb-run-status') || {innerText: ''}).innerText,
  report: (panel.querySelector('.wb-run-report') || {innerText: ''}).innerText,
}))"""


def run_all_cells(page: object) -> None:
    """Clear every output, run all cells, and wait until each has run; fail with the errors shown if not."""
    assert page.evaluate(KERNEL_READY) == "ready", "the notebook's kernel did not become ready"  # type: ignore[attr-defined]
    page.evaluate("() => window.galata.app.commands.execute('notebook:clear-all-cell-outputs')")  # type: ignore[attr-defined]
    page.wait_for_function(f"() => !/\\d/.test(({PROMPTS})())", timeout=10_000)  # type: ignore[attr-defined]
    page.evaluate(RUN_ALL)  # type: ignore[attr-defined]
    # Run-all stops at a cell that raises: stop waiting as soon as an error shows.
    page.wait_for_function(f"() => ({ALL_RAN})() || ({ERRORS})().length > 0", timeout=180_000)  # type: ignore[attr-defined]
    errors = page.evaluate(ERRORS)  # type: ignore[attr-defined]
    assert not errors, f"a cell failed ({page.evaluate(PROMPTS)}): {errors}"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem) as folder:
        (folder.root / "notebooks").mkdir()
        shutil.copy(REPO / "notebooks" / "03_convert.ipynb", folder.root / "notebooks")
        yield folder



def test_run_panel_bars_reach_done_in_jupyterlab(browser: object, lab: LabFolder) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1400})  # type: ignore[attr-defined]
    try:
        open_notebook(page, lab, "notebooks/03_convert.ipynb")
        page.wait_for_selector(f"{PANEL} .jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        run_all_cells(page)
        notebook_text = page.locator(PANEL).inner_text()
        assert "Loading widget" not in notebook_text and "Error displaying widget" not in notebook_text
        assert "<RunPanel:" not in notebook_text, "a RunPanel shows as text, not as a widget"
        assert "Traceback" not in notebook_text
        panels = page.evaluate(RUN_PANELS)
        two_ranks = [p for p in panels if len(p["bars"]) == 2]
        assert len(two_ranks) == 1, f"expected one 2-rank RunPanel, found {panels}"
        shown = two_ranks[0]
        for rank, bar in enumerate(shown["bars"]):
            assert f"rank {rank}" in bar["label"]
            assert bar["width"] == "100%", f"rank {rank}'s bar is at {bar['width']}"
            assert "progress-bar-success" in bar["classes"]
        assert all("(100%)" in label for label in shown["labels"])
        assert "Done in" in shown["status"] and "index written" in shown["status"]
        assert "predicted" in shown["report"] and "measured" in shown["report"] and "files opened" in shown["report"]
        assert len(panels) == 3  # the local run, the 2-rank run, and the panel wb.convert showed

        widget = page.locator(f"{PANEL} .wb-run").filter(has=page.locator(".wb-run-bar >> nth=1"))
        assert widget.count() == 1
        screenshot = screenshot_dir() / "run_panel.png"
        widget.scroll_into_view_if_needed()
        widget.screenshot(path=str(screenshot))
        assert screenshot.stat().st_size > 10_000
    finally:
        page.close()  # type: ignore[attr-defined]
