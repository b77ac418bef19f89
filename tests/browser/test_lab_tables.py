"""The Explorer's tables in a real JupyterLab, in the light and the dark theme, driven by headless chromium:
headers and notes must be readable (contrast of the computed text colour on the computed background), a header
click sorts, a row click shows that tensor's details, the pager reaches the last page, and a row's copy button
puts its name on the clipboard. Screenshots explorer-light.png / explorer-dark.png go to a temporary folder
(`make screenshots` refreshes docs/)."""

from __future__ import annotations

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
    code_notebook,
    lab_folder,
    open_notebook,
    screenshot_dir,
    set_theme,
)

REPO = Path(__file__).resolve().parents[2]
UNAVAILABLE = browser_available()

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
NOTEBOOK_CELLS = [
    "from workbench.widgets import Explorer\n\nexplorer = Explorer('../sample_checkpoints/tiny-llama')\nexplorer",
    "explorer.checkpoint.plot_bytes('layer')",
    "from workbench.widgets import MapperBuilder\n\nMapperBuilder('../sample_checkpoints/tiny-llama', preset='hf_to_fused')",
]
# WCAG's contrast ratio of an element's text on what is behind it: colours with alpha are blended over the
# nearest ancestors' backgrounds (down to an opaque one, else the page's).
CONTRAST = """(el) => {
  const parse = (c) => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(/[ ,/]+/).filter(Boolean).map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  const over = (top, bottom) => [0, 1, 2].map(k => top[k] * top[3] + bottom[k] * (1 - top[3])).concat([1]);
  const layers = [];
  for (let node = el; node; node = node.parentElement) {
    const bg = parse(getComputedStyle(node).backgroundColor);
    if (bg && bg[3] > 0) { layers.push(bg); if (bg[3] >= 1) break; }
  }
  let background = [255, 255, 255, 1];
  for (const layer of layers.reverse()) background = over(layer, background);
  const text = over(parse(getComputedStyle(el).color), background);
  const lum = (c) => { const v = c.slice(0, 3).map(x => { x /= 255; return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
  const [a, b] = [lum(text), lum(background)].sort((x, y) => y - x);
  return {ratio: (a + 0.05) / (b + 0.05), text: getComputedStyle(el).color, background: background.slice(0, 3).map(Math.round)};
}"""
# Alpha of the top-left pixel of an <img> (0: the page's background shows through).
TRANSPARENT_CORNER = """(img) => {
  const canvas = document.createElement('canvas');
  canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
  const context = canvas.getContext('2d');
  context.drawImage(img, 0, 0);
  return context.getImageData(1, 1, 1, 1).data[3];
}"""
TABLE = f"{PANEL} .wb-explorer .wb-explorer-table"
DOM_TABLE = ".jp-NotebookPanel:not(.lm-mod-hidden) .wb-explorer .wb-explorer-table"  # the same, for querySelector
SIZES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem, {"notebooks/tables.ipynb": code_notebook(NOTEBOOK_CELLS)}) as folder:
        yield folder


def open_explorer(browser: object, lab: LabFolder, theme: str) -> tuple[object, object]:
    """A page (with clipboard access) showing the notebook's Explorer in `theme` ("light" / "dark"), every cell run."""
    context = browser.new_context(viewport={"width": 1400, "height": 1300}, permissions=["clipboard-read", "clipboard-write"])  # type: ignore[attr-defined]
    page = context.new_page()
    open_notebook(page, lab, "notebooks/tables.ipynb")
    set_theme(page, THEMES[theme])
    page.wait_for_function(KERNEL_READY, timeout=60_000)
    page.evaluate("() => { window.galata.app.commands.execute('notebook:run-all-cells'); }")
    page.wait_for_function(ALL_RAN, timeout=120_000)
    page.locator(f"{TABLE} tbody tr").first.wait_for(timeout=30_000)
    return context, page


def keys(page: object) -> list[str]:
    return page.eval_on_selector_all(f"{TABLE} tbody tr", "rows => rows.map(r => r.dataset.key)")  # type: ignore[attr-defined]


def column_texts(page: object, column: str) -> list[str]:
    index = page.eval_on_selector_all(f"{TABLE} thead th", f"ths => ths.findIndex(th => th.dataset.column === {column!r})")  # type: ignore[attr-defined]
    return page.eval_on_selector_all(f"{TABLE} tbody tr", f"rows => rows.map(r => r.cells[{index}].innerText.trim())")  # type: ignore[attr-defined]


def as_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * SIZES[unit]


def assert_readable(page: object, theme: str) -> None:
    """Readable in `theme`: the table's headers and cells, the headline note, the count line and the details pane's
    headers (a row is picked), at WCAG AA."""
    checks = {
        "table header": f"{TABLE} thead th",
        "table cell": f"{TABLE} tbody td",
        "headline note": f"{PANEL} .wb-explorer .wb-note",
        "count line": f"{PANEL} .wb-explorer .wb-explorer-count .wb-message",
        "details header": f"{PANEL} .wb-explorer .wb-explorer-details th",
    }
    for what, selector in checks.items():
        found = page.locator(selector).all()[:6]  # type: ignore[attr-defined]
        assert found, f"no {what} to read in the {theme} theme"
        for element in found:
            contrast = element.evaluate(CONTRAST)
            assert contrast["ratio"] >= 4.5, f"{what} unreadable in the {theme} theme: {contrast}"


def test_explorer_tables_read_sort_select_page_and_copy(browser: object, lab: LabFolder) -> None:
    """The clicks in the light theme; then the Tensors and Bytes tabs are read (and shot) in each theme on the same
    page: the sorting, picking, paging and copying do not depend on the theme, the colours do."""
    context, page = open_explorer(browser, lab, "light")
    try:
        explorer = page.locator(f"{PANEL} .wb-explorer")

        # A header click sorts: bytes, largest first; a second click reverses.
        before = keys(page)
        page.locator(f"{TABLE} thead th[data-column='nbytes']").click()
        page.wait_for_selector(f"{TABLE} thead th[data-column='nbytes'][aria-sort='descending']", timeout=20_000)
        page.wait_for_function(f"() => document.querySelector('{DOM_TABLE} tbody tr').dataset.key !== {before[0]!r}", timeout=20_000)
        sizes = [as_bytes(t) for t in column_texts(page, "nbytes")]
        assert sizes == sorted(sizes, reverse=True) and keys(page) != before
        assert explorer.locator(".wb-explorer-sort select").input_value() == "bytes"  # the Sort control follows (its label)

        # Cut cells still say everything: each cell's tooltip is its whole text.
        assert page.eval_on_selector_all(f"{TABLE} tbody td", "tds => tds.every(td => td.title === td.innerText.trim())")

        # A row click shows that tensor (the first member of a folded pattern) in the details pane.
        page.locator(f"{TABLE} tbody tr[data-key='model.layers.{{i}}.mlp.up_proj.weight']").click()
        explorer.locator(".wb-explorer-details").filter(has_text="model.layers.0.mlp.up_proj.weight").wait_for(timeout=20_000)
        page.wait_for_selector(f"{TABLE} tbody tr.wb-selected[data-key='model.layers.{{i}}.mlp.up_proj.weight']", timeout=20_000)

        # Unfolded, 10 rows a page: the pager walks to the last page (39 tensors: rows 31-39).
        explorer.locator(".wb-explorer-fold input").uncheck()
        per_page = explorer.locator(".wb-explorer-per-page input")
        per_page.fill("10")
        per_page.press("Enter")
        pager = page.locator(f"{TABLE} .wb-page-where")
        pager.filter(has_text="page 1 of 4").wait_for(timeout=20_000)
        page.locator(f"{TABLE} .wb-page-last").click()
        pager.filter(has_text="31–39 of 39 tensors · page 4 of 4").wait_for(timeout=20_000)
        page.wait_for_function(f"() => document.querySelectorAll('{DOM_TABLE} tbody tr').length === 9", timeout=20_000)
        assert page.locator(f"{TABLE} .wb-page-next").is_disabled()

        # A row's copy button puts the name on the clipboard, without picking the row.
        row = page.locator(f"{TABLE} tbody tr").nth(2)
        name = row.get_attribute("data-key")
        picked = explorer.locator(".wb-explorer-pick select").input_value()
        row.hover()
        row.locator(".wb-copy-name").click()
        page.wait_for_function(f"async () => (await navigator.clipboard.readText()) === {name!r}", timeout=10_000)
        assert explorer.locator(".wb-explorer-pick select").input_value() == picked

        row.focus()  # rows answer the keyboard too
        row.press("Enter")
        explorer.locator(".wb-explorer-details").filter(has_text=name).wait_for(timeout=20_000)

        for theme, theme_name in THEMES.items():
            set_theme(page, theme_name)
            explorer.locator(".lm-TabBar-tab", has_text="Tensors").click()
            page.locator(f"{TABLE} tbody tr").first.wait_for(state="visible", timeout=20_000)
            assert_readable(page, theme)
            explorer.scroll_into_view_if_needed()
            explorer.screenshot(path=str(screenshot_dir() / f"explorer-{theme}.png"))

            # The Bytes tab's chart lets the theme show through (a transparent corner), layers in order 0, 1, 2, 3.
            explorer.locator(".lm-TabBar-tab", has_text="Bytes").click()
            chart = explorer.locator(".wb-explorer-bytes-chart img")
            chart.wait_for(timeout=30_000)
            chart.evaluate("img => img.decode()")
            corner = chart.evaluate(TRANSPARENT_CORNER)
            assert corner == 0, f"the chart has an opaque background (corner alpha {corner}) in the {theme} theme"
            layers = page.eval_on_selector_all(f"{PANEL} .wb-explorer-bytes-table tbody tr", "rows => rows.map(r => r.dataset.key)")
            assert [k for k in layers if k.startswith("model.layers.")] == [f"model.layers.{n}" for n in range(4)]
            explorer.screenshot(path=str(screenshot_dir() / f"explorer-bytes-{theme}.png"))
    finally:
        context.close()  # type: ignore[attr-defined]


def test_builder_export_has_one_copy_button_that_copies_the_code(browser: object, lab: LabFolder) -> None:
    context, page = open_explorer(browser, lab, "light")
    try:
        builder = page.locator(f"{PANEL} .wb-builder")
        builder.scroll_into_view_if_needed()
        builder.locator(".lm-TabBar-tab", has_text="Export").click()
        code = builder.locator(".wb-builder-code-area textarea")
        code.wait_for(timeout=20_000)
        copies = builder.locator("button:visible", has_text="Copy")
        assert copies.count() == 1, f"the Export tab shows {copies.count()} copy buttons: {copies.all_inner_texts()}"
        copies.first.click()
        page.wait_for_function("async () => (await navigator.clipboard.readText()).includes('qkv_proj')", timeout=10_000)
        assert page.evaluate("() => navigator.clipboard.readText()") == code.input_value()
    finally:
        context.close()  # type: ignore[attr-defined]
