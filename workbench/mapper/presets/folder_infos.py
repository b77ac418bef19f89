"""The tensor list of a checkpoint folder, read once per recipe: presets composed in one recipe share it.

`M.Sequential(M.presets.dequantize_fp8(cfg), M.presets.from_transformers(cfg))` names the same folder twice, and
each preset needs its tensor names and shapes; opening a 163-shard folder costs ~0.5 s of header parsing. A
catalog the caller still holds open is used (`formats.recent`); else the last folder read is kept, keyed by the
folder and the sizes and modification times of its files, so a changed folder is read again. Planning drops it
(`forget`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...catalog import TensorInfo

_KEEP = 1
_cache: OrderedDict[tuple, list[TensorInfo]] = OrderedDict()


def folder_infos(path: str | os.PathLike) -> list[TensorInfo]:
    """The tensors of the checkpoint at `path` (a folder or one file) in source order, as `open_catalog` reads
    them; a folder read before and unchanged since is not read again. The list is a copy; its TensorInfos are
    shared, so callers must not modify them (they are metadata values)."""
    from ...formats import open_catalog
    from ...formats.recent import folder_signature, recent
    from ..bind import source_infos

    folder = Path(path)
    if not folder.is_dir():
        return source_infos(open_catalog(folder))
    opened = recent(folder)  # the user's own catalog of it, still open
    if opened is not None:
        return source_infos(opened)
    key = (str(folder.resolve()), folder_signature(folder))
    infos = _cache.get(key)
    if infos is None:
        infos = source_infos(open_catalog(folder))
        _cache[key] = infos
        while len(_cache) > _KEEP:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return list(infos)


def forget() -> None:
    """Drop the kept tensor list (~300 bytes a tensor): planning calls it, as the recipe is built by then."""
    _cache.clear()
