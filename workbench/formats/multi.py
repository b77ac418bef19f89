"""Several checkpoints opened as one catalog, so a single mapper can read from all of them.

`open_sources({"base": "base/", "adapter": "lora/"})` opens every source on its own and joins them.
Names are scoped per source with `SCOPE` ('::'): the FIRST source is the primary one and keeps its
names unchanged (so that the tensors no op mentions pass through under their own names), every other
source's tensors are named `NAME::tensor` (e.g. `adapter::base_model.model.lm_head.weight`). A scoped
name is one dotted segment longer on the left, so `{placeholder}` templates work on it as usual.

Files keep their provenance: the primary source's files are named relative to its folder as before,
the other sources' files by absolute path (so every planner feature that joins `root / file` —
files read, fingerprints, source-change checks — sees the real file). `catalog.columns['source']`
says which source each tensor comes from and `catalog.sources` keeps each source's own catalog.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import Catalog, FileInfo, TensorInfo
from ..errors import CheckpointError

SCOPE = "::"


def scoped(source: str, name: str) -> str:
    """The name of tensor `name` of source `source` in a multi-source catalog (see the module docstring)."""
    return f"{source}{SCOPE}{name}"


def split_scope(name: str) -> tuple[str | None, str]:
    """(source, tensor name) of a scoped name; (None, name) for a primary-source name."""
    source, sep, rest = name.partition(SCOPE)
    return (source, rest) if sep else (None, name)


@dataclass
class MultiCatalog(Catalog):
    """A catalog joined from several sources; `sources` maps each source name to its own catalog."""

    sources: dict[str, Catalog] = field(default_factory=dict)
    source_paths: dict[str, str] = field(default_factory=dict)
    file_sources: dict[str, str] = field(default_factory=dict)  # file key -> name of the source it belongs to

    @property
    def primary(self) -> str:
        """The name of the first source (whose tensor names are not scoped)."""
        return next(iter(self.sources))


class MultiReader:
    """Dispatches reads of a joined catalog to the reader of the source each tensor came from."""

    def __init__(self, origin: dict[str, tuple[Catalog, TensorInfo]]) -> None:
        self.origin = origin
        self.catalogs = {id(c): c for c, _ in origin.values()}

    def _find(self, info: TensorInfo) -> tuple[Catalog, TensorInfo]:
        try:
            return self.origin[info.name]
        except KeyError:
            raise CheckpointError(f"Cannot read tensor {info.name!r}: no source of this multi-source catalog holds it.",
                                  tensor=info.name) from None

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The bytes of `info`, read by its source's reader."""
        catalog, original = self._find(info)
        assert catalog.reader is not None
        return catalog.reader.read_bytes(original)

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """Where `info`'s raw bytes lie, as its source's reader says."""
        catalog, original = self._find(info)
        return None if catalog.reader is None else catalog.reader.locate(original)

    def close(self) -> None:
        """Close every source's reader."""
        for catalog in self.catalogs.values():
            if catalog.reader is not None:
                catalog.reader.close()


def _check_source_name(name: object) -> str:
    if not isinstance(name, str) or not name or SCOPE in name or "." in name or "{" in name or "}" in name:
        raise CheckpointError(
            f"Cannot open several sources: source name {name!r} is not usable. Name each source with a short word "
            "without dots, braces or '::' (e.g. 'base', 'adapter', 'step1000')."
        )
    return name


def _file_key(catalog: Catalog, rel: str, primary: bool) -> str:
    if primary and catalog.root.is_dir():
        return rel
    path = catalog.root / rel if catalog.root.is_dir() else catalog.root
    return os.path.abspath(path)


def join_catalogs(catalogs: Mapping[str, Catalog], paths: Mapping[str, str] | None = None) -> MultiCatalog:
    """One catalog from named catalogs: the first keeps its names, the others are scoped `NAME::tensor`."""
    if not catalogs:
        raise CheckpointError("Cannot open several sources: the mapping is empty. Pass e.g. {'base': 'base/', 'adapter': 'lora/'}.")
    names = [_check_source_name(n) for n in catalogs]
    first = catalogs[names[0]]
    root = first.root if first.root.is_dir() else first.root.parent
    tensors: dict[str, TensorInfo] = {}
    files: dict[str, FileInfo] = {}
    origin: dict[str, tuple[Catalog, TensorInfo]] = {}
    source_of: dict[str, object] = {}
    file_sources: dict[str, str] = {}
    file_metadata: dict[str, dict[str, str]] = {}
    warnings: list[str] = []
    columns: dict[str, dict[str, object]] = {"source": source_of}
    for index, name in enumerate(names):
        catalog = catalogs[name]
        primary = index == 0
        keys = {rel: _file_key(catalog, rel, primary) for rel in catalog.files}
        for rel, info in catalog.files.items():
            files[keys[rel]] = FileInfo(keys[rel], info.size, info.header_bytes, info.n_tensors)
            file_sources[keys[rel]] = name
        for rel, meta in catalog.file_metadata.items():
            file_metadata[keys.get(rel, rel)] = meta
        for tname, info in catalog.tensors.items():
            new = tname if primary else scoped(name, tname)
            file = keys.get(info.file, info.file) if info.file or catalog.files else info.file
            tensors[new] = TensorInfo(new, info.dtype, info.shape, file, info.begin, info.end)
            origin[new] = (catalog, info)
            source_of[new] = name
        for column, values in catalog.columns.items():
            if column == "source":
                continue
            target = columns.setdefault(column, {})
            for tname, value in values.items():
                target[tname if primary else scoped(name, tname)] = value
        warnings += [w if primary else f"{name}: {w}" for w in catalog.warnings]
    formats = {catalogs[n].format for n in names}
    return MultiCatalog(
        root=root,
        format=formats.pop() if len(formats) == 1 else "multi",
        tensors=tensors,
        files=files,
        metadata=dict(first.metadata),
        warnings=warnings,
        extras=list(first.extras) if first.root.is_dir() else [],
        reader=MultiReader(origin),
        columns=columns,
        file_metadata=file_metadata,
        sources=dict(catalogs),
        file_sources=file_sources,
        source_paths=dict(paths or {n: str(catalogs[n].root) for n in names}),
    )


def open_sources(sources: Mapping[str, str | os.PathLike]) -> MultiCatalog:
    """Open each named checkpoint (any supported format) and join them (see the module docstring)."""
    from . import open_catalog

    catalogs = {_check_source_name(name): open_catalog(path) for name, path in sources.items()}
    return join_catalogs(catalogs, {name: os.path.abspath(path) for name, path in sources.items()})
