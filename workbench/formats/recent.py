"""Catalogs opened from local folders, held weakly: a preset given the folder's path reuses the one the user opened.

`ck = wb.open_checkpoint(folder)` then `M.presets.dequantize_fp8(folder / "config.json")` would otherwise read the
163 headers of a DeepSeek-V3 folder again. A catalog is found here only while something else keeps it alive and
only while the folder's files keep the sizes and modification times they had when it was opened.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..catalog import Catalog

_opened: dict[str, tuple[tuple, weakref.ref]] = {}


def folder_signature(folder: Path) -> tuple:
    """The folder's files (top level) with their sizes and modification times: what a reused reading depends on."""
    entries = []
    with os.scandir(folder) as it:
        for entry in it:
            if entry.is_file():
                st = entry.stat()
                entries.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(entries))


def remember(folder: Path, catalog: Catalog) -> None:
    """Note that `catalog` was opened from `folder` (with no options) as the folder is now."""
    key = str(folder.resolve())
    _opened[key] = (folder_signature(folder), weakref.ref(catalog, lambda _, key=key: _opened.pop(key, None)))


def recent(folder: Path) -> Catalog | None:
    """The catalog opened from `folder` that is still alive and still matches it, else None."""
    found = _opened.get(str(folder.resolve()))
    if found is None:
        return None
    signature, ref = found
    catalog = ref()
    return catalog if catalog is not None and signature == folder_signature(folder) else None
