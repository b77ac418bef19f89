"""At 760 px of browser width (a laptop with the file browser open) no control of the widgets is clipped: the
builder, the Explorer, the PlanPanel and the RunPanel wrap their rows, and every button keeps its whole label
(issue 34 item 7). A control is clipped when its text overflows it (an ellipsis) or when it reaches past the
output area or past a parent that hides its overflow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_harness import (
    KERNEL_READY,
    JupyterLab,
    LabFolder,
    browser_available,
    code_notebook,
    lab_folder,
    open_notebook,
    screenshot_dir,
)
from test_lab_convert import run_all_cells

UNAVAILABLE = browser_available()

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

CELLS = [
    "import workbench as wb\nfrom workbench.widgets import Explorer, MapperBuilder, PlanPanel, RunPanel\n"
    "source = 'sample_checkpoints/tiny-llama'",
    "MapperBuilder(source)",
    "Explorer(source)",
    "PlanPanel(wb.plan(source, dtype='bf16'))",
    "RunPanel(source, 'out-narrow', dtype='bf16')",
]
CLIPPED = """() => {
  const clipped = [];
  const visible = '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output';
  document.querySelectorAll(`${visible} button, ${visible} select, ${visible} input`).forEach(control => {
    const box = control.getBoundingClientRect();
    if (box.width === 0) return;  // not shown (another tab, a hidden row)
    const why = [];
    if (control.scrollWidth > control.clientWidth + 1) why.push('text cut');
    const area = control.closest('.jp-OutputArea-output').getBoundingClientRect();
    if (box.right > area.right + 1) why.push(`past the output by ${Math.round(box.right - area.right)} px`);
    for (let node = control.parentElement; node && !node.classList.contains('jp-OutputArea-output'); node = node.parentElement) {
      if (getComputedStyle(node).overflowX === 'visible') continue;
      const parent = node.getBoundingClientRect();
      if (box.right > parent.right + 1 || box.left < parent.left - 1) why.push('cut by its box');
      break;
    }
    if (why.length) clipped.push(`${(control.innerText || control.placeholder || control.value || '').trim().slice(0, 30)}: ${why.join(', ')}`);
  });
  return clipped;
}"""


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem, {"narrow.ipynb": code_notebook(CELLS)}) as folder:
        yield folder


def test_no_control_is_clipped_at_760_px(browser: object, lab: LabFolder) -> None:
    page = browser.new_page(viewport={"width": 760, "height": 1400})  # type: ignore[attr-defined]
    try:
        open_notebook(page, lab, "narrow.ipynb")
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        run_all_cells(page)
        for part in (".wb-builder", ".wb-explorer", ".wb-plan", ".wb-run"):
            page.locator(f".jp-NotebookPanel:not(.lm-mod-hidden) {part}").first.wait_for(timeout=60_000)
        controls = page.evaluate("() => document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output button').length")
        assert controls > 30  # the widgets rendered (not "Loading widget...")
        assert page.evaluate(CLIPPED) == []
        page.screenshot(path=str(screenshot_dir() / "narrow_760.png"))
    finally:
        page.close()  # type: ignore[attr-defined]
