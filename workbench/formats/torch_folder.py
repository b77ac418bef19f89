"""Sharded torch.save folders: `pytorch_model.bin.index.json` + `pytorch_model-0000k-of-0000N.bin`.

How transformers saved models before safetensors (and how many Hub repos still ship them). Each shard
is read like a single torch.save zip (its pickle inertly, nothing executed); the index is checked like a
safetensors index (`shard_index`). Tensors keep their shard as `file`, so plans and reports name it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..catalog import Catalog, FileInfo, TensorInfo
from ..iostats import file_kind
from . import torch_zip
from .safetensors_folder import is_extra, read_index, safe_member, shard_state
from .shard_index import check_claims, check_shard_present, shard_map

TORCH_INDEX_NAME = "pytorch_model.bin.index.json"
TORCH_INDEX_SUFFIXES = (".bin.index.json", ".pt.index.json", ".pth.index.json")


def find_torch_index(names: Iterable[str]) -> str | None:
    """The index among a folder's top-level file names: HF's usual name, else the only `*.bin.index.json`."""
    names = [n for n in names if "/" not in n]
    if TORCH_INDEX_NAME in names:
        return TORCH_INDEX_NAME
    found = sorted(n for n in names if n.endswith(TORCH_INDEX_SUFFIXES))
    return found[0] if len(found) == 1 else None


def detect(path: Path) -> bool:
    """True for a folder with a torch.save shard index."""
    return path.is_dir() and find_torch_index(p.name for p in path.iterdir() if p.is_file()) is not None


class ShardedTorchReader:
    """Reads each tensor through its own shard's reader (local `TorchZipReader`s)."""

    def __init__(self, readers: Mapping[str, object]) -> None:
        self.readers = dict(readers)

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's row-major bytes, from its shard."""
        return self.readers[info.file].read_bytes(info)

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """The raw byte range in its shard when the tensor is contiguous there, else None."""
        return self.readers[info.file].locate(info)

    def close(self) -> None:
        """Close every shard."""
        for reader in self.readers.values():
            reader.close()


def join_shards(where: str, index_name: str, shard_of: Mapping[str, str], shards: Mapping[str, Catalog]) -> tuple[dict[str, TensorInfo], dict, list[str]]:
    """One table from the shards' catalogs: (tensors with their shard as `file`, merged metadata and columns,
    warnings). Every claim of the index is checked."""
    held = {rel: [TensorInfo(n, t.dtype, t.shape, rel, t.begin, t.end) for n, t in c.tensors.items()] for rel, c in shards.items()}
    tensors, warnings = check_claims(where, index_name, shard_of, held)
    unsafe = sorted({g for c in shards.values() for g in c.metadata.get("unsafe_globals", "").split(", ") if g})
    metadata = {"weights_only": "no" if unsafe else "yes", "shards": str(len(shards))}
    if unsafe:
        metadata["unsafe_globals"] = ", ".join(unsafe)
    columns: dict[str, dict[str, object]] = {"storage": {}, "shared_with": {}}
    for catalog in shards.values():
        for key in columns:
            columns[key].update({n: v for n, v in catalog.columns.get(key, {}).items() if n in tensors})
        warnings[:0] = catalog.warnings
    return tensors, {"metadata": metadata, "columns": columns}, warnings


def open_path(path: Path) -> Catalog:
    """Open a sharded torch.save folder from its index, each shard's pickle and local headers."""
    folder = path
    index_name = find_torch_index(p.name for p in folder.iterdir() if p.is_file())
    assert index_name is not None
    weight_map, _ = read_index(folder / index_name)
    shard_of, shards = shard_map(weight_map, lambda rel, what: safe_member(folder, rel, what=what), index_name)
    catalogs: dict[str, Catalog] = {}
    for rel in shards:
        kind = file_kind(folder / rel)
        check_shard_present(str(folder), index_name, rel, kind and shard_state(kind), shard_of)
        catalogs[rel] = torch_zip.open_path(folder / rel)
    tensors, tables, warnings = join_shards(str(folder), index_name, shard_of, catalogs)
    files = {}
    for rel, catalog in catalogs.items():
        (info,) = catalog.files.values()
        files[rel] = FileInfo(rel, info.size, info.header_bytes, sum(1 for t in tensors.values() if t.file == rel))
    weights = set(shards) | {index_name}
    extras = sorted(e.name for e in os.scandir(folder) if is_extra(folder, e) and e.name not in weights
                    and not e.name.endswith((*TORCH_INDEX_SUFFIXES, *torch_zip.SUFFIXES)))
    return Catalog(
        root=folder,
        format="torch-sharded",
        tensors=tensors,
        files=files,
        metadata=tables["metadata"],
        warnings=warnings,
        extras=extras,
        reader=ShardedTorchReader({rel: c.reader for rel, c in catalogs.items()}),
        columns=tables["columns"],
    )

