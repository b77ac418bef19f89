"""Checkpoints made of safetensors files: one file, a folder with an HF index, or a bare folder.

The HF index is untrusted input like the rest: every shard path must stay inside the folder, every
shard must exist, and the index must agree with what the shards' headers say.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

from ..catalog import Catalog, TensorInfo
from ..errors import CheckpointError
from ..iostats import file_kind
from .json_errors import json_problem
from .links import leads_inside
from .safetensors import SUFFIX, FileReader, SafetensorsHeader, file_info, gc_paused, read_header
from .shard_index import check_claims, check_shard_present, shard_map

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 512 * 1024 * 1024
# Left in a destination by a conversion until it commits (workbench.planning.destination.MANIFEST_NAME).
UNFINISHED_MARKER = ".workbench-convert.json"
# Left by a finished conversion (workbench.planning.destination.COMPLETE_NAME): never an extra.
COMPLETION_RECORD = ".workbench-complete.json"
# Files that describe one checkpoint and must not follow its tensors into a conversion's output.
CHECKSUMS_NAME = "checksums.sha256.json"
NOT_EXTRAS = frozenset({CHECKSUMS_NAME, UNFINISHED_MARKER, COMPLETION_RECORD})


def find_index(folder: Path) -> Path | None:
    """The HF index of a folder: `model.safetensors.index.json`, else a single `*.safetensors.index.json`."""
    preferred = folder / INDEX_NAME
    if preferred.is_file():
        return preferred
    found = sorted(p for p in folder.glob("*" + SUFFIX + ".index.json") if p.is_file())  # never a FIFO: reading it blocks
    return found[0] if len(found) == 1 else None


def safe_member(folder: Path, rel: object, *, what: str) -> str:
    """Validate that `rel` (from an untrusted index) names a file inside `folder`; return it normalized."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise CheckpointError(f"Cannot use {what}: the shard path {rel!r} is not a file name. Fix the index.", file=str(folder))
    pure = PurePosixPath(rel.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
        raise CheckpointError(
            f"Cannot use {what}: the shard path {rel!r} points outside the checkpoint folder {folder}. "
            "Refusing it; an index may only name files inside its own folder.",
            file=str(folder),
        )
    if not leads_inside(folder, folder / pure):
        real = os.path.realpath(folder / pure)
        raise CheckpointError(
            f"Cannot use {what}: the shard path {rel!r} is a link that leads outside the checkpoint folder "
            f"({real}). Refusing it; copy the shard into the folder instead.",
            file=str(folder),
        )
    return str(pure)


def shard_state(kind: str) -> str:
    """How a message names what `file_kind` found: 'missing', or 'not a regular file (a FIFO)'."""
    return kind if kind == "missing" or kind.startswith("unreadable") else f"not a regular file ({kind})"


class _RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: the object as a dict, refusing a key that appears twice (json.loads keeps the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return out


def _load_index(index_path: Path) -> dict[str, str]:
    return read_index(index_path)[0]


def read_index(index_path: Path) -> tuple[dict[str, str], dict]:
    """The index's `weight_map` (validated to be an object) and its `metadata` object ({} when absent)."""
    size = index_path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise CheckpointError(f"Cannot read index {index_path}: it is {size} bytes, more than any real index. Check the file.", file=str(index_path))
    return parse_index_bytes(index_path.read_bytes(), str(index_path))


def parse_index_bytes(raw: bytes, where: str) -> tuple[dict[str, str], dict]:
    """`read_index` on bytes already read (`where` names the file in messages): remote indexes use it too."""
    try:
        index = json.loads(raw, object_pairs_hook=_unique_keys)
    except _RepeatedKey as repeated:
        raise CheckpointError(
            f"Cannot read index {where}: it lists the key {repeated.key!r} twice, so which entry counts is "
            "ambiguous. Regenerate the index (or remove the stale entry).",
            file=where,
            tensor=repeated.key,
        ) from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"Cannot read index {where}: it is not valid JSON ({exc}). Re-download or regenerate it.", file=where) from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"Cannot read index {where}: it is not valid JSON ({json_problem(exc)}). Re-download or regenerate it.", file=where
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"Cannot read index {where}: it has no \"weight_map\" object. Re-download or regenerate it.", file=where)
    metadata = index.get("metadata")
    return weight_map, metadata if isinstance(metadata, dict) else {}


def is_extra(folder: Path, entry: os.DirEntry) -> bool:
    """True for a file conversions may copy along: a regular file (or a link staying inside `folder`)
    that is not a per-checkpoint record such as the checksum sidecar."""
    if entry.name in NOT_EXTRAS or entry.name.endswith("." + CHECKSUMS_NAME) or not entry.is_file():
        return False
    if entry.is_symlink():  # config.json -> /etc/passwd must not be copied into an output
        return leads_inside(folder, entry.path)
    return True


def _extras(folder: Path, weights: set[str]) -> list[str]:
    """Non-weight files at the top of the folder (config, tokenizer ...), which conversions copy along."""
    out = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if is_extra(folder, entry) and entry.name not in weights and not entry.name.endswith(SUFFIX) and not entry.name.endswith(".index.json"):
            out.append(entry.name)
    return out


def _catalog(root: Path, fmt: str, headers: dict[str, SafetensorsHeader], tensors: dict[str, TensorInfo], **kw) -> Catalog:
    metadata: dict[str, str] = {}
    for header in headers.values():
        metadata.update(header.metadata)
    return Catalog(
        root=root,
        format=fmt,
        tensors=tensors,
        files={rel: file_info(rel, h) for rel, h in headers.items()},
        metadata=metadata,
        file_metadata={rel: dict(h.metadata) for rel, h in headers.items()},
        reader=FileReader(root),
        **kw,
    )


def open_file(path: Path) -> Catalog:
    """A single `.safetensors` file."""
    header = read_header(path, rel=path.name)
    return _catalog(path, "safetensors", {path.name: header}, {t.name: t for t in header.tensors})


def open_indexed(folder: Path, index_path: Path) -> Catalog:
    """An HF sharded folder: the index names each tensor's shard; every claim is checked."""
    weight_map = _load_index(index_path)
    shard_of, shards = shard_map(weight_map, lambda rel, what: safe_member(folder, rel, what=what), index_path.name)
    headers: dict[str, SafetensorsHeader] = {}
    for rel in shards:
        path = folder / rel
        kind = file_kind(path)
        check_shard_present(str(folder), index_path.name, rel, kind and shard_state(kind), shard_of)
        headers[rel] = read_header(path, rel=rel)
    tensors, warnings = check_claims(str(folder), index_path.name, shard_of, {rel: h.tensors for rel, h in headers.items()})
    return _catalog(
        folder, "hf-sharded", headers, tensors, warnings=warnings, extras=_extras(folder, set(shards) | {index_path.name})
    )


def open_folder(folder: Path) -> Catalog:
    """A folder holding `model.safetensors` or several `*.safetensors` files without an index."""
    index = find_index(folder)
    if index is not None:
        return open_indexed(folder, index)
    if (folder / UNFINISHED_MARKER).is_file():
        raise CheckpointError(
            f"Cannot open checkpoint {folder}: it is an unfinished conversion ({UNFINISHED_MARKER} is there and the "
            "conversion never committed). Run the same conversion again to finish it, or open one shard file directly.",
            file=str(folder),
        )
    files = sorted(p.name for p in folder.glob("*" + SUFFIX) if p.is_file())
    if not files:
        raise CheckpointError(f"Cannot open checkpoint {folder}: it holds no .safetensors file and no index. Point at a checkpoint folder or file.", file=str(folder))
    headers: dict[str, SafetensorsHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    for rel in files:
        safe_member(folder, rel, what=f"file {rel}")
        headers[rel] = read_header(folder / rel, rel=rel)
        for info in headers[rel].tensors:
            if info.name in tensors:
                raise CheckpointError(
                    f"Cannot open checkpoint {folder}: tensor {info.name!r} is stored in two files "
                    f"({tensors[info.name].file} and {rel}). Remove the stale file or open one file directly.",
                    file=rel,
                    tensor=info.name,
                )
            tensors[info.name] = info
    fmt = "safetensors" if len(files) == 1 else "safetensors-folder"
    return _catalog(folder, fmt, headers, tensors, extras=_extras(folder, set(files)))


def detect(path: Path) -> bool:
    """True when `path` is a safetensors file or a folder of them."""
    if path.is_file():
        return path.suffix == SUFFIX or path.name.endswith(SUFFIX + ".index.json")
    return path.is_dir() and (find_index(path) is not None or any(path.glob("*" + SUFFIX)))


def open_path(path: Path) -> Catalog:
    """Open a safetensors file, an index file, or a folder."""
    with gc_paused():
        return _open_path(path)


def _open_path(path: Path) -> Catalog:
    if path.is_file():
        if path.name.endswith(".index.json"):
            return open_indexed(path.parent, path)
        return open_file(path)
    return open_folder(path)
