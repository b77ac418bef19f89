"""The issue-18 goal in a real JupyterLab, by clicking only: "fuse q/k/v + gate/up, strip `model.`, cast to bf16
keeping norms fp32" with the MapperBuilder in at most 10 clicks, read in the light and the dark theme.

Every user action goes through `Clicks`, which counts it: a button or toggle press is 1, choosing in a
dropdown is 2 (open it, pick the option), filling a text field is 1. The mapper the clicks built is then saved
from the Export tab (not counted: the building is done) and must convert the sample checkpoint to exactly the
tensors the same conversion written in code gives. Screenshots go to a temporary folder (`make screenshots`:
docs/)."""

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
    lab_folder,
    open_notebook,
    screenshot_dir,
    set_theme,
)

REPO = Path(__file__).resolve().parents[2]
UNAVAILABLE = browser_available()
MAX_CLICKS = 10
THEMES = ("JupyterLab Light", "JupyterLab Dark")

pytestmark = [pytest.mark.browser, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"browser tests need chromium: {UNAVAILABLE}")]

NOTEBOOK = {
    "cells": [{
        "cell_type": "code", "execution_count": None, "id": "builder", "metadata": {}, "outputs": [],
        "source": ["from workbench.widgets import MapperBuilder\n", "\n",
                   "builder = MapperBuilder('sample_checkpoints/tiny-llama')\n", "builder"],
    }],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}
# Text colour and the first non-transparent background behind an element, as [r, g, b] each.
COLOURS = """(element) => {
  const rgb = (text) => (text.match(/[\\d.]+/g) || []).slice(0, 4).map(Number);
  const color = rgb(getComputedStyle(element).color);
  let node = element, background = null;
  while (node && node.nodeType === 1) {
    const value = rgb(getComputedStyle(node).backgroundColor);
    if (value.length >= 3 && (value.length < 4 || value[3] > 0.5)) { background = value; break; }
    node = node.parentElement;
  }
  return {color: color.slice(0, 3), background: (background || [255, 255, 255]).slice(0, 3)};
}"""


def option_texts(select: object) -> list[str]:
    """The option labels of a <select> as text (ipywidgets writes its spaces as non-breaking ones)."""
    return [text.replace("\xa0", " ") for text in select.evaluate("s => [...s.options].map(o => o.text)")]  # type: ignore[attr-defined]


class Clicks:
    """Drives the builder like a user and counts what the user does (see the module docstring)."""

    def __init__(self, builder: object) -> None:
        self.builder = builder
        self.count = 0
        self.log: list[str] = []

    def press(self, selector: str, text: str | None = None) -> None:
        target = self.builder.locator(selector)  # type: ignore[attr-defined]
        if text is not None:
            target = target.filter(has_text=text)
        target.first.click()
        self.count += 1
        self.log.append(f"click {text or selector}")

    def choose(self, selector: str, contains: str) -> None:
        select = self.builder.locator(f"{selector} select")  # type: ignore[attr-defined]
        select.locator("option").nth(1).wait_for(state="attached", timeout=30_000)
        labels = option_texts(select)
        index = next((k for k, text in enumerate(labels) if contains in text), None)
        assert index is not None, f"no option with {contains!r} in {labels}"
        select.select_option(index=index)
        label = labels[index]
        self.count += 2
        self.log.append(f"choose {label!r}")

    def type(self, selector: str, text: str) -> None:
        field = self.builder.locator(f"{selector} input, {selector} textarea").first  # type: ignore[attr-defined]
        field.fill(text)
        self.count += 1
        self.log.append(f"type {text!r}")


@pytest.fixture(scope="module")
def lab(lab_server: JupyterLab) -> Iterator[LabFolder]:
    with lab_folder(lab_server, Path(__file__).stem, {"builder_clicks.ipynb": NOTEBOOK}) as folder:
        yield folder


def message(builder: object, text: str) -> None:
    """Wait until the builder's form message says `text` (it is set last after a click: the rest has arrived)."""
    builder.locator(".wb-builder-form-message").filter(has_text=text).wait_for(timeout=30_000)  # type: ignore[attr-defined]


def luminance(rgb: list[float]) -> float:
    def channel(c: float) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(colours: dict) -> float:
    """WCAG contrast ratio of an element's text against its background."""
    light, dark = sorted((luminance(colours["color"]), luminance(colours["background"])), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def code_built_mapper(sample: Path) -> object:
    """The same conversion written in code: presets for the fusion and the prefix, then every float tensor that
    is not a norm cast to BF16, listed by hand from the names after the first two steps."""
    import workbench as wb
    from workbench import mapper as M
    from workbench.mapper import presets

    fuse_and_strip = M.Sequential(presets.hf_to_fused(sample / "config.json"), presets.strip_prefix("model."))
    names = fuse_and_strip.bind(wb.open_checkpoint(sample)).outputs
    casts = [M.Cast(name, "BF16") for name in names if "norm" not in name]
    return M.Sequential(fuse_and_strip, M.Parallel(*casts))


def test_fuse_strip_and_cast_in_ten_clicks(browser: object, lab: LabFolder, tmp_path: Path) -> None:
    """The clicks in the light theme; then the built form is read in each theme on the same page (what depends on
    the theme is the colours: the clicks and the mapper they build do not)."""
    import workbench as wb

    page = browser.new_page(viewport={"width": 1500, "height": 1600})  # type: ignore[attr-defined]
    try:
        open_notebook(page, lab, "builder_clicks.ipynb")
        set_theme(page, THEMES[0])
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        page.evaluate("() => { window.galata.app.commands.execute('notebook:run-all-cells'); }")
        builder = page.locator(f"{PANEL} .wb-builder")
        builder.wait_for(timeout=60_000)
        builder.scroll_into_view_if_needed()
        user = Clicks(builder)

        user.choose(".wb-builder-preset", "HF → fused qkv_proj + gate_up_proj")
        user.press(".wb-builder-append-preset")
        message(builder, "Appended preset")
        user.press(".wb-builder-op button", "Rename")
        user.type(".wb-builder-prefix", "model.")
        user.press(".wb-builder-add")
        message(builder, "Added step 2")
        user.press(".wb-builder-op button", "Cast")
        user.type(".wb-builder-sources", "*")
        user.type(".wb-builder-keep", "norm")
        user.press(".wb-builder-add")
        message(builder, "Added step 3")
        assert user.count <= MAX_CLICKS, f"{user.count} clicks: {user.log}"

        steps = option_texts(builder.locator(".wb-builder-steps select"))
        assert steps == [
            "1. fuse q/k/v → qkv_proj, gate/up → gate_up_proj (×4) + check",
            "2. strip prefix `model.` (26 names)",
            "3. cast 18 tensors → BF16, norms kept F32",
        ]
        assert "3 step(s) · 27 output tensors · 0 problem(s)" in builder.locator(".widget-html").first.inner_text()
        preview = builder.locator(".wb-builder-preview").inner_text()
        assert "layers.{i}.self_attn.qkv_proj.weight" in preview and "model.layers" not in preview

        # Usable in either theme: the step labels and the form message stand out from their background.
        for theme in THEMES:
            set_theme(page, theme)
            for selector in (".wb-builder-steps select", ".wb-builder-form-message .wb-message"):
                colours = builder.locator(selector).first.evaluate(COLOURS)
                assert contrast(colours) >= 3, f"{selector} in {theme}: {colours}"
            name = "builder-clicks-dark.png" if "Dark" in theme else "builder-clicks-light.png"
            builder.scroll_into_view_if_needed()
            builder.screenshot(path=str(screenshot_dir() / name))

        # Export what the clicks built and convert the sample with it and with the code-built mapper.
        saved = tmp_path / "clicked_mapper.py"
        builder.locator(".lm-TabBar-tab", has_text="Export").click()
        builder.locator(".wb-builder-save-path input").fill(str(saved))
        builder.locator(".wb-builder-save").click()
        builder.locator(".wb-builder-export-message").filter(has_text=saved.name).wait_for(timeout=20_000)
    finally:
        page.close()  # type: ignore[attr-defined]

    namespace: dict = {}
    exec(saved.read_text(), namespace)
    sample = REPO / "sample_checkpoints" / "tiny-llama"
    clicked_out, coded_out = tmp_path / "clicked", tmp_path / "coded"
    wb.convert(sample, clicked_out, namespace["mapper"])
    wb.convert(sample, coded_out, code_built_mapper(sample))
    clicked, coded = wb.open_checkpoint(clicked_out), wb.open_checkpoint(coded_out)
    assert sorted(clicked.tensors.index) == sorted(coded.tensors.index) and len(coded.tensors) == 27
    assert clicked.tensors.loc["norm.weight", "dtype"] == "F32" and clicked.tensors.loc["layers.0.mlp.gate_up_proj.weight", "dtype"] == "BF16"
    import torch

    for tensor in coded.tensors.index:
        assert torch.equal(clicked.load(tensor), coded.load(tensor)), tensor


def test_names_problems_fix_and_folded_target_by_clicking(browser: object, lab: LabFolder) -> None:
    """Dark theme: after a prefix strip only the new names are offered; a fusion typed with the old names is one
    grouped problem with a fix-it that works; a misspelt name's fix-it uses the closest name; the target check
    says "Checking…" while it runs, takes a model type and folds its rows."""
    page = browser.new_page(viewport={"width": 1500, "height": 1600})  # type: ignore[attr-defined]
    try:
        open_notebook(page, lab, "builder_clicks.ipynb")
        set_theme(page, "JupyterLab Dark")
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        page.evaluate("() => { window.galata.app.commands.execute('notebook:run-all-cells'); }")
        builder = page.locator(f"{PANEL} .wb-builder")
        builder.wait_for(timeout=60_000)
        builder.scroll_into_view_if_needed()
        user = Clicks(builder)
        user.press(".wb-builder-op button", "Rename")
        user.type(".wb-builder-prefix", "model.")
        user.press(".wb-builder-add")
        message(builder, "Added step 1")
        names = option_texts(builder.locator(".wb-builder-suggest select"))
        assert "layers.{i}.self_attn.q_proj.weight  ×4" in names and not any(n.startswith("model.") for n in names)

        user.press(".wb-builder-op button", "Concat")
        user.type(".wb-builder-sources", "\n".join(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"))
        user.press(".wb-builder-add")
        message(builder, "new problem")
        problems = builder.locator(".wb-builder-problems")
        panel = builder.locator(".wb-builder-problems-panel")
        panel.locator(".wb-builder-fix").first.wait_for(timeout=20_000)
        assert "Step 2 · fuse q/k/v → qkv_proj — 1 name not found" in panel.inner_text()
        assert panel.evaluate("e => [getComputedStyle(e).maxHeight, getComputedStyle(e).overflowY]") == ["220px", "auto"]
        user.press(".wb-builder-fix", "Move step 2 before step 1")
        message(builder, "problem(s) fewer")
        problems.filter(has_text="No problems").wait_for(timeout=20_000)
        steps = option_texts(builder.locator(".wb-builder-steps select"))
        assert steps == ["1. fuse q/k/v → qkv_proj (×4)", "2. strip prefix `model.` (30 names)"]

        # a misspelt name: the fix-it offers the closest name as a template, and a click puts it in the step
        user.press(".wb-builder-op button", "Cast")
        user.type(".wb-builder-sources", "layers.{i}.self_attn.o_prj.weight")
        user.press(".wb-builder-add")
        message(builder, "new problem")
        fix = panel.locator(".wb-builder-fix").filter(has_text="Use the closest name")
        fix.first.wait_for(timeout=20_000)
        assert "layers.{i}.self_attn.o_proj.weight" in fix.first.inner_text()
        assert "The closest name is 'layers.{i}.self_attn.o_proj.weight'" in panel.inner_text()
        fix.first.click()
        problems.filter(has_text="No problems").wait_for(timeout=20_000)
        steps = option_texts(builder.locator(".wb-builder-steps select"))
        assert len(steps) == 3 and steps[2].startswith("3. cast 4 tensors → BF16"), steps  # the 4 o_proj, found

        builder.locator(".lm-TabBar-tab", has_text="Target").click()
        user.type(".wb-builder-target", "llama")
        page.evaluate("""() => { window.wbCheck = []; const note = () => document.querySelectorAll('.wb-builder-target-check')
          .forEach(b => window.wbCheck.push([b.innerText.trim(), b.disabled]));
          new MutationObserver(note).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true}); }""")
        user.press(".wb-builder-target-check")
        view = builder.locator(".wb-builder-target-view")
        view.filter(has_text="LlamaForCausalLM from model type").wait_for(timeout=120_000)
        seen = page.evaluate("() => window.wbCheck")
        assert ["Checking…", True] in seen, seen[:10]  # a busy sign while the seconds-long check runs
        assert seen[-1] == ["Check", False]
        text = view.inner_text()
        assert "layers.{i}.self_attn.qkv_proj.weight" in text and "×4" in text and "difference patterns" in text
        assert "model.layers.0.self_attn.q_proj.weight" not in text  # folded
        builder.screenshot(path=str(screenshot_dir() / "builder-problems-dark.png"))
    finally:
        page.close()  # type: ignore[attr-defined]
