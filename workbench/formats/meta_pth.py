"""Meta's original Llama layout: a folder of `params.json` and `consolidated.NN.pth` (one torch.save zip per
model-parallel rank), as Meta's download script and the workbench's `to="pth"` output write it.

Each file is read like any torch.save zip (its pickle inertly, nothing executed). One file: its tensors under
their own names. Several (model-parallel ranks): every rank's tensors listed as `mp<r>/<name>`, the names the
`.pth` writer gives them, with `default_preset` `meta_mp_merge`, the mapper that concatenates the split
tensors and keeps one copy of the replicated ones, so a conversion without a mapper writes the merged model.
`params.json` (Meta's model arguments) is read, bounded, into `catalog.metadata` as `params.<key>`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..catalog import Catalog, FileInfo, TensorInfo
from ..errors import CannotRead
from . import torch_zip
from .safetensors_folder import is_extra

PARAMS_NAME = "params.json"
MAX_PARAMS_BYTES = 1 << 20
SHARD = re.compile(r"consolidated\.(\d+)\.pth")
MP_NAME = re.compile(r"mp(\d+)/(.+)")

_fail = CannotRead("Meta checkpoint", "Re-download it, or convert it again.", entry="file")


def shard_names(folder: Path) -> list[str]:
    """The folder's `consolidated.NN.pth` files, in rank order."""
    found = [(int(m.group(1)), e.name) for e in os.scandir(folder) if (m := SHARD.fullmatch(e.name)) and e.is_file()]
    return [name for _, name in sorted(found)]


def detect(path: Path) -> bool:
    """A folder holding `params.json` and at least one `consolidated.NN.pth`."""
    return path.is_dir() and (path / PARAMS_NAME).is_file() and bool(shard_names(path))


def read_params(folder: Path) -> dict:
    """params.json as a dict (at most 1 MiB, a JSON object), refused clearly otherwise."""
    path = folder / PARAMS_NAME
    size = path.stat().st_size
    if size > MAX_PARAMS_BYTES:
        raise _fail(folder, f"params.json is {size} bytes, above the {MAX_PARAMS_BYTES}-byte limit for model arguments", PARAMS_NAME)
    try:
        params = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise _fail(folder, f"params.json is not valid JSON ({exc})", PARAMS_NAME) from None
    if not isinstance(params, dict):
        raise _fail(folder, "params.json is not a JSON object", PARAMS_NAME)
    return params


class RankReader:
    """Reads `mp<r>/<name>` from rank r's file under `<name>`; single-file folders read names as they are."""

    def __init__(self, readers: dict[str, object], inner: dict[str, str]) -> None:
        self.readers = readers
        self.inner = inner  # catalog name -> name inside its file

    def _own(self, info: TensorInfo) -> TensorInfo:
        return info.with_name(self.inner.get(info.name, info.name))

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's bytes, from its rank's file."""
        return self.readers[info.file].read_bytes(self._own(info))

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """The raw byte range in its file, when contiguous there."""
        return self.readers[info.file].locate(self._own(info))

    def close(self) -> None:
        """Close every file."""
        for reader in self.readers.values():
            reader.close()


def open_path(folder: Path) -> Catalog:
    """Open a Meta folder: params.json and every `consolidated.NN.pth` (ranks 00 .. N-1, none missing)."""
    names = shard_names(folder)
    ranks = [int(SHARD.fullmatch(n).group(1)) for n in names]  # type: ignore[union-attr]
    if ranks != list(range(len(names))):
        raise _fail(folder, f"its files {', '.join(names)} are not ranks 00 to {len(names) - 1:02d} without a gap",
                    fix="Download every consolidated.NN.pth.")
    params = read_params(folder)
    tensors: dict[str, TensorInfo] = {}
    inner: dict[str, str] = {}
    files: dict[str, FileInfo] = {}
    readers: dict[str, object] = {}
    warnings: list[str] = []
    columns: dict[str, dict[str, object]] = {"shared_with": {}}
    split = len(names) > 1
    for rank, rel in enumerate(names):
        catalog = torch_zip.open_path(folder / rel)
        readers[rel] = catalog.reader
        warnings += catalog.warnings
        for name, info in catalog.tensors.items():
            listed = f"mp{rank}/{name}" if split else name
            tensors[listed] = TensorInfo(listed, info.dtype, info.shape, rel, info.begin, info.end)
            inner[listed] = name
            shared = catalog.columns.get("shared_with", {}).get(name)
            if shared is not None:
                columns["shared_with"][listed] = shared
        (info,) = catalog.files.values()
        files[rel] = FileInfo(rel, info.size, info.header_bytes, len(catalog.tensors))
    metadata = {f"params.{key}": json.dumps(value) for key, value in params.items()}
    metadata["model_parallel"] = str(len(names))
    if split:
        warnings.append(f"{len(names)} model-parallel files: tensors are listed per rank as mp<r>/<name>; a conversion "
                        "without a mapper merges them (preset meta_mp_merge).")
    extras = sorted(e.name for e in os.scandir(folder) if is_extra(folder, e) and e.name not in files)
    return Catalog(root=folder, format="meta-pth", tensors=tensors, files=files, metadata=metadata, warnings=warnings,
                   extras=extras, reader=RankReader(readers, inner if split else {}),
                   columns={k: v for k, v in columns.items() if v}, default_preset="meta_mp_merge" if split else "")


__all__ = ["PARAMS_NAME", "RankReader", "detect", "open_path", "read_params"]
