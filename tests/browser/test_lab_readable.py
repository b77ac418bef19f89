"""Issue 34 in a real JupyterLab, by clicking, on one page (one kernel) to keep it short:

- every visible piece of text of the Explorer (a row selected, by a click and then by the arrow keys), the
  MapperBuilder (6 problems with their fix-its, after a step moved below the prefix strip by clicking), the PlanPanel and the RunPanel (after a run and a "Run again")
  reads at WCAG AA (>= 4.5:1 against the background actually behind it), in the light and the dark theme;
- a fix-it of the second problem group, at the bottom of the capped problems box, can be scrolled to and clicked,
  and the problem count drops; "Add all matching" with no search adds `*`;
- the RunPanel's last timing line shows the same speed as its report; after Done the button says "Run again", and
  running again over the complete destination says "Already complete, nothing written".

Left out of the contrast check, and why: disabled controls (WCAG 1.4.3 exempts inactive components: a greyed
Cancel reads as inert on purpose), text drawn inside images (the charts are PNGs) or SVG, and placeholder text."""

from __future__ import annotations

import re
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

UNAVAILABLE = browser_available()

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

CELLS = [
    "import workbench as wb\nfrom workbench.widgets import Explorer, MapperBuilder, PlanPanel, RunPanel\n\n"
    "sample = 'sample_checkpoints/tiny-llama'\nExplorer(sample)",
    # a cast typed with the source's names, the prefix strip, a rename onto a name the strip makes: one clash so far
    "builder = MapperBuilder(sample)\nbuilder.op_picker.value = 'Cast'\n"
    "builder.sources_box.value = '\\n'.join(f'model.layers.{{i}}.{n}.weight' for n in ('self_attn.q_proj', 'self_attn.k_proj',"
    " 'self_attn.v_proj', 'self_attn.o_proj', 'mlp.down_proj'))\nbuilder.add_button.click()\n"
    "builder.op_picker.value = 'Rename'\nbuilder.prefix_box.value = 'model.'\nbuilder.add_button.click()\n"
    "builder.sources_box.value = 'lm_head.weight'\nbuilder.outputs_box.value = 'norm.weight'\nbuilder.add_button.click()\nbuilder",
    "PlanPanel(wb.plan(sample, dest='planned', shard_size='300KB'))",
    "RunPanel(sample, 'converted', shard_size='300KB')",
]
PANEL_DOM = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # PANEL, for querySelector
WIDGETS = {"Explorer": ".wb-explorer", "MapperBuilder": ".wb-builder", "PlanPanel": ".wb-plan", "RunPanel": ".wb-run"}
# Every visible element of `root` that shows text (its own text nodes, or a form control's value), with the WCAG
# contrast of that text against what is behind it: colours with alpha, and the opacity of the element and its
# ancestors, are blended over the nearest opaque background. Disabled controls and SVG text are left out.
READABILITY = """(root) => {
  const parse = (c) => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(/[ ,/]+/).filter(Boolean).map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  const over = (top, bottom) => [0, 1, 2].map(k => top[k] * top[3] + bottom[k] * (1 - top[3])).concat([1]);
  const lum = (c) => { const v = c.slice(0, 3).map(x => { x /= 255; return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
  const out = [];
  for (const el of [root, ...root.querySelectorAll('*')]) {
    if (el.closest('svg')) continue;
    const control = el.matches('input[type=text], input[type=number], textarea, select');
    const own = [...el.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent).join('').trim();
    const text = control ? (el.value || '').trim() : own;
    if (!text || el.matches('option')) continue;
    const rects = el.getClientRects();
    const style = getComputedStyle(el);
    if (!rects.length || style.visibility !== 'visible') continue;
    if (el.closest(':disabled, .mod-disabled, [aria-disabled=true]')) continue;
    let hidden = false, opacity = 1;
    for (let node = el; node; node = node.parentElement) {
      const s = getComputedStyle(node);
      if (s.display === 'none') hidden = true;
      opacity *= Number(s.opacity);
    }
    if (hidden || opacity === 0) continue;
    const layers = [];
    for (let node = el; node; node = node.parentElement) {
      const bg = parse(getComputedStyle(node).backgroundColor);
      if (bg && bg[3] > 0) { layers.push(bg); if (bg[3] >= 1) break; }
    }
    let background = parse(getComputedStyle(document.body).backgroundColor) || [255, 255, 255, 1];
    for (const layer of layers.reverse()) background = over(layer, background);
    const ink = parse(style.color);
    ink[3] *= opacity;
    const shown = over(ink, background);
    const [a, b] = [lum(shown), lum(background)].sort((x, y) => y - x);
    out.push({ratio: Math.round((a + 0.05) / (b + 0.05) * 100) / 100, text: text.slice(0, 60), tag: el.tagName,
              cls: String(el.className).slice(0, 60), color: style.color, background: background.slice(0, 3).map(Math.round).join(',')});
  }
  return out;
}"""


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem, {"readable.ipynb": code_notebook(CELLS)}) as folder:
        yield folder


def assert_readable(page: object, theme: str) -> int:
    """Every widget shows text, and all of it reads at >= 4.5:1; returns how many elements were measured."""
    measured = 0
    for name, selector in WIDGETS.items():
        found = page.locator(f"{PANEL} {selector}").first.evaluate(READABILITY)  # type: ignore[attr-defined]
        assert len(found) >= 5, f"{name} shows almost no text in {theme}: {found}"
        poor = [f for f in found if f["ratio"] < 4.5]
        assert not poor, f"{name} in {theme}: {len(poor)} of {len(found)} text elements below 4.5:1: {poor[:8]}"
        measured += len(found)
    return measured


def rate(text: str) -> str:
    return re.search(r"[\d.]+ (?:B|KiB|MiB|GiB)/s", text).group()  # type: ignore[union-attr]


def test_every_widget_reads_in_both_themes_fixits_click_and_runs_say_what_happened(browser: object, lab: LabFolder) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1500})  # type: ignore[attr-defined]
    try:
        open_notebook(page, lab, "readable.ipynb")
        set_theme(page, "JupyterLab Light")
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        page.evaluate("() => { window.galata.app.commands.execute('notebook:run-all-cells'); }")
        page.wait_for_function(ALL_RAN, timeout=120_000)
        for selector in WIDGETS.values():
            page.locator(f"{PANEL} {selector}").first.wait_for(timeout=60_000)

        # Explorer: a row picked by a click, then the next one by the arrow key (focus follows the selection).
        table = page.locator(f"{PANEL} .wb-explorer .wb-explorer-table")
        rows = table.locator("tbody tr")
        rows.first.wait_for(timeout=30_000)
        first, second = rows.nth(0).get_attribute("data-key"), rows.nth(1).get_attribute("data-key")
        rows.nth(0).click()
        table.locator(f"tbody tr.wb-selected[data-key='{first}']").wait_for(timeout=20_000)
        table.locator(f"tbody tr[data-key='{first}']").press("ArrowDown")
        table.locator(f"tbody tr.wb-selected[data-key='{second}']").wait_for(timeout=20_000)
        assert page.evaluate("() => document.activeElement && document.activeElement.dataset.key") == second

        # Builder: the cast moved one place down, below the strip (select it, click Down): 6 problems in 2 groups,
        # 4 fix-its.
        builder = page.locator(f"{PANEL} .wb-builder")
        builder.locator(".wb-builder-problems").filter(has_text="Problems (1)").wait_for(timeout=30_000)
        builder.locator(".wb-builder-steps select").select_option(index=0)
        builder.locator("button").filter(has_text=re.compile(r"^\s*Down\s*$")).click()
        problems = builder.locator(".wb-builder-problems")
        problems.filter(has_text="Problems (6)").wait_for(timeout=30_000)
        fixes = builder.locator(".wb-builder-problems-panel .wb-builder-fix")
        fixes.nth(3).wait_for(state="attached", timeout=30_000)  # the groups' views arrive after the heading
        assert fixes.count() == 4
        panel = builder.locator(".wb-builder-problems-panel")
        assert panel.evaluate("e => e.scrollHeight > e.clientHeight")  # the box scrolls: the last fix-its start hidden
        heights = fixes.evaluate_all("buttons => buttons.map(b => b.getBoundingClientRect().height)")
        assert min(heights) > 10, f"fix-it buttons squeezed: {heights}"
        drop = fixes.filter(has_text="Drop 'norm.weight' before step 3")
        drop.scroll_into_view_if_needed()
        drop.click()  # a real click: playwright fails it if another element would receive it
        problems.filter(has_text="Problems (5)").wait_for(timeout=30_000)
        assert builder.locator(".wb-builder-search input").input_value() == ""
        builder.locator("button.wb-builder-add-pattern").click()  # no search: "Add all matching" adds all
        page.wait_for_function(f"() => document.querySelector('{PANEL_DOM} .wb-builder-sources textarea').value === '*'",
                               timeout=20_000)

        # RunPanel: Start, Done; the timing line's speed is the report's; Run again over the complete output.
        run = page.locator(f"{PANEL} .wb-run")
        run.locator(".wb-run-start button, button.wb-run-start").first.click()
        status = run.locator(".wb-run-status")
        status.filter(has_text="Done in").wait_for(timeout=60_000)
        report = run.locator(".wb-run-report").inner_text()
        throughput = re.search(r"throughput\s+-\s+([\d.]+ \w+/s)", report)
        assert throughput, report
        assert rate(run.locator(".wb-run-timing").inner_text()) == throughput.group(1)
        again = run.locator("button", has_text="Run again")
        again.click()
        status.filter(has_text="Already complete, nothing written").wait_for(timeout=60_000)
        words = run.inner_text()
        assert "index written" not in words and "interrupted" not in words and "nothing read or written" in words

        measured = assert_readable(page, "JupyterLab Light")
        set_theme(page, "JupyterLab Dark")
        measured += assert_readable(page, "JupyterLab Dark")
        assert measured > 100
        builder.scroll_into_view_if_needed()
        builder.screenshot(path=str(screenshot_dir() / "builder-fixits-dark.png"))
    finally:
        page.close()  # type: ignore[attr-defined]
