"""Fixtures shared by the JupyterLab browser tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lab_harness import launched_chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless chromium per test module."""
    with launched_chromium() as chromium:
        yield chromium
