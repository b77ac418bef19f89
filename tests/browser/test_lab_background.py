"""Long reads, the RunPanel's phases and the SVG graph in a real JupyterLab, driven by clicking in headless
chromium: a large value-stats read asks first, shows a moving bar with bytes, keeps Value stats and
Histogram disabled while it runs, and stops on Cancel (the buttons come back); a 2-process
run on the local launcher names that launcher, shows a "starting workers" phase and a time-left estimate, and
offers Verify / Open in Explorer once done (Start no longer the primary button); the mapper graph is an SVG
whose boxes carry shapes. One page does it all; each part is read and shot in the light and the dark theme (switched
on that page: the behaviour does not depend on the theme, the colours do). Screenshots go to the screenshot folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_harness import (
    CONTRAST,
    PANEL,
    JupyterLab,
    LabFolder,
    browser_available,
    code_notebook,
    lab_folder,
    open_notebook,
    screenshot_dir,
    set_theme,
)
from test_lab_convert import run_all_cells

REPO = Path(__file__).resolve().parents[2]
UNAVAILABLE = browser_available()

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

CELLS = [
    '''import json, struct
from pathlib import Path
import workbench as wb
from workbench.mapper import presets
from workbench.widgets import Explorer, RunPanel, mapper_graph_figure

big = Path("big.safetensors")  # one 256 MiB F32 tensor of zeros, sparse on disk
elements = 64 << 20
header = json.dumps({"model.big.weight": {"dtype": "F32", "shape": [elements], "data_offsets": [0, 4 * elements]}}).encode()
header += b" " * (-len(header) % 8)
with open(big, "wb") as fh:
    fh.write(struct.pack("<Q", len(header)) + header)
    fh.truncate(8 + len(header) + 4 * elements)''',
    '''import time
explorer = Explorer(big)
explorer.task.confirm_above = 128 << 20  # this 256 MiB read asks first, as one over 1 GiB does by default
read_stats = explorer.checkpoint.stats
def slowed_stats(name, *, chunk_elements, on_read):  # ~20 MiB/s, so the test can watch the read (in both themes) before it ends
    def hook(nbytes):
        time.sleep(0.1)
        on_read(nbytes)
    return read_stats(name, chunk_elements=chunk_elements, on_read=hook)
explorer.checkpoint.stats = slowed_stats
explorer.select("model.big.weight")
explorer''',
    '''import shutil
source = "../sample_checkpoints/tiny-llama"
shutil.rmtree("out-local", ignore_errors=True)  # each run of the notebook converts afresh
# a bf16 cast in 8-byte chunks: slow enough (~1.5 s of copying per rank on an idle machine) to see time left
panel = RunPanel(source, "out-local", nproc=2, launcher="local", dtype="bf16", chunk_size="8B", shard_size="100KB")
panel''',
    '''mapper_graph_figure(presets.hf_to_fused(source + "/config.json"), wb.open_checkpoint(source))''',
]

# Every text a class of element shows while the test acts, recorded by the page itself (phases change fast).
RECORD = """(selector) => {
  window.wbSeen = window.wbSeen || {};
  const seen = window.wbSeen[selector] = [];
  const note = () => document.querySelectorAll(selector).forEach(e => { const t = e.innerText.trim(); if (t && seen[seen.length - 1] !== t) seen.push(t); });
  new MutationObserver(note).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
  note();
}"""
BAR_WIDTH = """() => { const fill = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .wb-explorer-task .wb-task-bar .progress-bar');
  return fill ? parseFloat(fill.style.width || '0') : -1; }"""


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem, {"notebooks/background.ipynb": code_notebook(CELLS)}) as folder:
        yield folder



def shoot(page: object, selector: str, name: str) -> None:
    element = page.locator(selector).first  # type: ignore[attr-defined]
    element.scroll_into_view_if_needed()
    path = screenshot_dir() / name
    element.screenshot(path=str(path))
    assert path.stat().st_size > 5_000


LIGHT, DARK = "JupyterLab Light", "JupyterLab Dark"


def suffix(theme: str) -> str:
    """The screenshot names' ending for `theme` ("" for the light one)."""
    return "_dark" if theme == DARK else ""


def test_cancel_a_read_watch_a_run_and_read_the_graph(browser: object, lab: LabFolder) -> None:
    page = browser.new_page(viewport={"width": 1500, "height": 1300})  # type: ignore[attr-defined]
    try:
        open_notebook(page, lab, "notebooks/background.ipynb")
        set_theme(page, LIGHT)
        page.wait_for_selector(f"{PANEL} .jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
        run_all_cells(page)
        notebook = page.locator(PANEL)
        assert "Loading widget" not in notebook.inner_text()

        # 1. a large value-stats read: asks first, runs with a moving bar and bytes, stops on Cancel
        explorer = notebook.locator(".wb-explorer").first
        explorer.locator(".wb-explorer-stats").click()
        confirm = explorer.locator(".wb-explorer-task .wb-task-confirm")
        confirm.wait_for(state="visible", timeout=20_000)
        assert "reads 256.0 MiB from disk" in explorer.locator(".wb-explorer-task .wb-task-text").inner_text()
        confirm.click()
        page.wait_for_function(f"() => ({BAR_WIDTH})() > 0", timeout=60_000)
        read_buttons = (explorer.locator(".wb-explorer-stats"), explorer.locator(".wb-explorer-hist"))
        assert all(b.is_disabled() for b in read_buttons)  # one read at a time: both wait for this one
        first = page.evaluate(BAR_WIDTH)
        page.wait_for_function(f"() => ({BAR_WIDTH})() > {first}", timeout=60_000)  # the bar moves
        task_text = explorer.locator(".wb-explorer-task .wb-task-text")
        for _ in range(100):  # the speed is shown once 0.2 s have passed: the bar can move before that
            text = task_text.inner_text()
            if "/s" in text:
                break
            page.wait_for_timeout(100)
        assert "Reading value stats of model.big.weight" in text and "of 256.0 MiB" in text and "/s" in text
        for theme in (LIGHT, DARK):  # the read goes on meanwhile (it is slowed to last ~13 s)
            set_theme(page, theme)
            readable = page.evaluate(CONTRAST, explorer.locator(".wb-explorer-task .wb-task-text").element_handle())
            assert readable["ratio"] >= 3, (theme, readable)  # the bar's text can be read in this theme
            shoot(page, f"{PANEL} .wb-explorer-task", f"background_read{suffix(theme)}.png")
        assert "Reading value stats" in task_text.inner_text()  # still reading: the cancel below stops a running read
        explorer.locator(".wb-explorer-task .wb-task-cancel").click()
        page.wait_for_function("() => [...document.querySelectorAll('.wb-task-text')].some(e => e.innerText.includes('Cancelled reading'))",
                               timeout=20_000)
        # the kernel sends the text and the hidden buttons as two updates: the button goes within moments, not at once
        explorer.locator(".wb-explorer-task .wb-task-cancel").wait_for(state="hidden", timeout=10_000)
        # both buttons come back, each by its own widget update: wait for the two, not the first
        page.wait_for_function("() => ['.wb-explorer-stats', '.wb-explorer-hist'].every(c => "
                               "!document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) ' + c).disabled)",
                               timeout=10_000)
        assert not any(b.is_disabled() for b in read_buttons)  # usable again after the cancel
        assert "min" not in explorer.locator(".wb-explorer-details ~ *").first.inner_text()  # no stats shown

        # 2. the RunPanel: launcher named, phases and time left while it runs, Verify / Explorer after Done
        run = notebook.locator(".wb-run").first
        header = run.locator(".wb-run-header").inner_text()
        assert "local launcher" in header and "torchrun" not in header
        page.evaluate(RECORD, ".wb-run-phase .wb-phase-now")
        page.evaluate(RECORD, ".wb-run-timing")
        assert "mod-primary" in (run.locator(".wb-run-start").get_attribute("class") or "")
        run.locator(".wb-run-start").click()
        page.wait_for_function("() => [...document.querySelectorAll('.wb-run-status')].some(e => e.innerText.includes('Done in'))",
                               timeout=180_000)
        phases = page.evaluate("() => window.wbSeen['.wb-run-phase .wb-phase-now']")
        timings = page.evaluate("() => window.wbSeen['.wb-run-timing']")
        assert any(p.startswith("starting workers") for p in phases) and "copying" in phases and phases[-1] == "done", phases
        assert any("of 2 up" in p for p in phases), phases
        assert any("left" in t for t in timings) and any(t.startswith("elapsed") for t in timings), timings
        assert "mod-primary" not in (run.locator(".wb-run-start").get_attribute("class") or "")
        for theme in (DARK, LIGHT):  # the page is dark since the read
            set_theme(page, theme)
            for part in (".wb-run-status", ".wb-run-timing"):
                readable = page.evaluate(CONTRAST, run.locator(part).element_handle())
                assert readable["ratio"] >= 3, (theme, part, readable)
        cancel = run.locator(".wb-run-cancel")
        assert cancel.is_disabled() and "mod-warning" not in (cancel.get_attribute("class") or "")
        run.locator(".wb-run-verify").click()
        page.wait_for_function("() => [...document.querySelectorAll('.wb-run-verified')].some(e => e.innerText.includes('all match'))",
                               timeout=120_000)
        run.locator(".wb-run-explore").click()
        run.locator(".wb-explorer").wait_for(state="visible", timeout=30_000)
        assert "tensors" in run.locator(".wb-explorer").inner_text()
        run.locator(".wb-explorer .wb-explorer-verify").click()  # the Explorer's own Verify: headers, index, sizes
        page.wait_for_function("() => [...document.querySelectorAll('.wb-run .wb-explorer-verified')].some(e => e.innerText.includes(': OK'))",
                               timeout=60_000)
        for theme in (LIGHT, DARK):
            set_theme(page, theme)
            shoot(page, f"{PANEL} .wb-run", f"run_panel_done{suffix(theme)}.png")

        # 3. the graph: an SVG whose boxes say shapes and dtypes, folded ×4
        graph = notebook.locator("svg.wbg").first
        graph.wait_for(state="visible", timeout=20_000)
        texts = page.evaluate("() => [...document.querySelectorAll('svg.wbg text')].map(t => t.textContent)")
        assert "F32 [128, 64]" in texts and any(t.endswith("×4") for t in texts), texts[:10]
        box = graph.bounding_box()
        assert box is not None and box["width"] > 600  # drawn at its own size, not shrunk into a thumbnail
        for theme in (DARK, LIGHT):  # the page is dark since the run panel's screenshots
            set_theme(page, theme)
            shoot(page, f"{PANEL} .wb-graph", f"mapper_graph{suffix(theme)}.png")
            if theme == DARK:
                title_color = page.evaluate("() => getComputedStyle(document.querySelector('svg.wbg text.title')).fill")
                assert title_color not in ("rgb(34, 34, 34)", "rgb(0, 0, 0)"), title_color  # the title follows the theme
    finally:
        page.close()  # type: ignore[attr-defined]
