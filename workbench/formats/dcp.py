"""torch.distributed.checkpoint (DCP) folders: `.metadata` + `__<rank>_<n>.distcp`, at any world size.

Also read here: pipeline-parallel trainers' per-stage folders (`pp0/`, `pp1/` ... each a DCP) merged into
one catalog with a `stage` column, and Lightning's FSDP "sharded" checkpoints (a `*.ckpt/` DCP folder
plus `meta.pt`, whose tensors are listed as `meta.<path>`).

`.metadata` is unpickled with an allowlist (DCP metadata dataclasses, torch.Size, dtypes, builtins):
anything else is refused. Each chunk inside a `.distcp` is a torch.save zip stream; reading a tensor
parses only its own chunks' streams and assembles them. Non-tensor (bytes) entries are listed in a side
table (`dcp_objects`), not as tensors.

Catalog conventions: `TensorInfo.file` is the file of the tensor's first chunk (relative to the opened
folder, e.g. `pp1/__0_0.distcp`) and `begin/end` the byte range of that chunk's zip stream; the full
chunk list is in `dcp_chunks(catalog)`. `reader.locate` gives raw bytes only for single-chunk tensors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..catalog import Catalog, FileInfo, TensorInfo
from ..display import format_shape
from ..dtypes import DTYPE_BITS
from ..errors import CannotRead, CheckpointError
from ..iostats import file_kind, open_for_read, read_at
from . import torch_zip
from .file_pool import FilePool
from .pickle.unpickler import TORCH_DTYPE_NAMES, DtypeRef, Placeholder, TensorRef, load_inert
from .safetensors_folder import is_extra, safe_member, shard_state
from .shape_bounds import INDEX_LIMIT, index_problem, shape_problem

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

METADATA_NAME = ".metadata"
LIGHTNING_META = "meta.pt"
# .metadata holds ~150-250 bytes per stored chunk: 256 MiB is over a million chunks (a 400B model's
# weights and optimizer state on hundreds of ranks); anything larger is not a DCP index.
MAX_METADATA_BYTES = 256 << 20
_STAGE_DIR = re.compile(r"^pp(\d+)$")
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")

_ALLOWED_EXACT = frozenset(
    {
        "torch.Size", "torch.serialization._get_layout", "collections.OrderedDict", "builtins.set",
        "builtins.frozenset", "builtins.slice", "builtins.complex", "_codecs.encode",
        "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath", "pathlib.Path",
    }
)


def metadata_global_allowed(qualified: str) -> bool:
    """The allowlist for `.metadata`: DCP's own metadata classes, torch.Size, dtypes, paths, builtins."""
    if qualified in _ALLOWED_EXACT:
        return True
    module, _, name = qualified.rpartition(".")
    if module == "torch" and name in TORCH_DTYPE_NAMES:
        return True
    return module.startswith(("torch.distributed.checkpoint", "torch.distributed._shard"))


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: its place in the full tensor and its zip stream in a `.distcp`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the catalog root
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    """A tensor of a DCP checkpoint: full dtype/shape and the chunks that make it up."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    stage: int | None
    path: tuple | None = None  # the nested state-dict path (DCP's planner_data), when the metadata records it


@dataclass(frozen=True)
class DcpObject:
    """A non-tensor entry (a torch.save'd Python object) of a DCP checkpoint."""

    name: str
    file: str
    offset: int
    length: int
    stage: int | None
    path: tuple | None = None


_fail = CannotRead("DCP checkpoint", "The checkpoint is incomplete or damaged: re-copy it from where it was written.", entry="entry")


def stage_dirs(folder: Path) -> list[tuple[int, Path]]:
    """`ppN/` sub-folders that hold a DCP, sorted by stage."""
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        match = _STAGE_DIR.match(entry.name)
        if match and entry.is_dir() and (Path(entry.path) / METADATA_NAME).is_file():
            found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


def detect(path: Path) -> bool:
    """True for a DCP folder (has `.metadata`), a folder of `ppN/` DCP stages, or the `.metadata` file itself."""
    if path.is_file():
        return path.name == METADATA_NAME
    return path.is_dir() and ((path / METADATA_NAME).is_file() or bool(stage_dirs(path)))


def _as_tuple(value: Any, what: str, source: str, name: str) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and all(type(v) is int and 0 <= v < INDEX_LIMIT for v in value):
        return tuple(value)
    raise _fail(source, f"{what} is {format_shape(value)}, not a list of sizes", name)


def _dtype_of(props: Any, source: str, name: str) -> str:
    dtype = None
    if isinstance(props, Placeholder):
        dtype = props.field("dtype")
        if dtype is None and isinstance(props.wb_state, tuple) and props.wb_state:
            dtype = props.wb_state[0]  # TensorProperties pickles its fields as a tuple, dtype first
    if not isinstance(dtype, DtypeRef):
        raise _fail(source, f"its properties carry no dtype ({props!r})", name)
    code = torch_zip.dtype_code(dtype.name)
    if code is None or DTYPE_BITS[code] % 8:
        raise _fail(source, f"dtype torch.{dtype.name} has no safetensors equivalent", name, "It cannot be listed or converted.")
    return code


def read_metadata(folder: Path, prefix: str, stage: int | None) -> tuple[list[DcpTensor], list[DcpObject], str]:
    """Parse one DCP folder's `.metadata` (allowlisted unpickling); paths are returned as `prefix + file`."""
    path = folder / METADATA_NAME
    source = str(path)
    try:
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise _fail(source, f".metadata is {size} bytes, above the {MAX_METADATA_BYTES}-byte limit for a DCP index")
        fd = open_for_read(path)
    except OSError as exc:
        raise CheckpointError(f"Cannot open {source}: {exc.strerror}. Check the path and permissions.", file=source) from None
    try:
        raw = read_at(fd, size, 0)
    finally:
        os.close(fd)
    return parse_metadata(raw, source, prefix, stage, lambda rel, what: safe_member(folder, rel, what=what))


def parse_metadata(
    raw: bytes, source: str, prefix: str, stage: int | None, member: Callable[[object, str], str]
) -> tuple[list[DcpTensor], list[DcpObject], str]:
    """`read_metadata` on bytes already read (`source` names the file in messages; `member(rel, what)`
    validates each data-file path and returns it normalised): remote DCP folders use it too."""
    root = load_inert(raw, source=source, strict=metadata_global_allowed).root
    if not isinstance(root, Placeholder) or not root.wb_global.endswith(".Metadata"):
        raise _fail(source, f"the .metadata pickle holds {type(root).__name__}, not a DCP Metadata")
    entries = root.field("state_dict_metadata")
    storage = root.field("storage_data")
    planner = root.field("planner_data")
    planner = planner if isinstance(planner, dict) else {}
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise _fail(source, "the metadata lacks state_dict_metadata or storage_data")
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    safe_paths: dict[str, str] = {}
    for index, info in storage.items():
        if not isinstance(index, Placeholder) or not isinstance(info, Placeholder):
            raise _fail(source, "storage_data has an entry that is not MetadataIndex -> _StorageInfo")
        fqn = index.field("fqn")
        offset = index.field("offset")
        rel = info.field("relative_path")
        begin, length = info.field("offset"), info.field("length")
        if info.field("transform_descriptors"):
            raise _fail(
                source, f"entry {fqn!r} is stored with transforms {info.field('transform_descriptors')!r}", fqn,
                "Compressed or transformed DCP storage is not supported yet; re-save without storage transforms.",
            )
        if not isinstance(fqn, str) or index_problem((begin, length), "a byte offset or length"):
            raise _fail(source, f"a storage_data entry is malformed ({index!r} -> {info!r})")
        checked = safe_paths.get(rel) if isinstance(rel, str) else None
        if checked is None:  # a few data files serve every entry: resolve each path once
            checked = member(rel, f"DCP metadata entry {fqn!r}")
            safe_paths[rel] = checked
        rel = checked
        key = (fqn, None if offset is None else _as_tuple(offset, "a chunk offset", source, fqn))
        where[key] = (prefix + rel, begin, length)

    tensors: list[DcpTensor] = []
    objects: list[DcpObject] = []
    for name, meta in entries.items():
        if not isinstance(name, str) or not isinstance(meta, Placeholder):
            raise _fail(source, f"state_dict_metadata has a malformed entry {name!r}")
        kind = meta.wb_global.rpartition(".")[2]
        if kind == "BytesStorageMetadata":
            loc = where.get((name, None))
            if loc is None:
                raise _fail(source, "no storage holds this object", name)
            objects.append(DcpObject(name, loc[0], loc[1], loc[2], stage, _path_of(planner, name)))
            continue
        if kind != "TensorStorageMetadata":
            raise _fail(source, f"entry kind {kind} is not supported", name)
        dtype = _dtype_of(meta.field("properties"), source, name)
        shape = _as_tuple(meta.field("size"), "the size", source, name)
        problem = shape_problem(shape, DTYPE_BITS[dtype])
        if problem:
            raise _fail(source, problem, name)
        chunks = []
        covered = 0
        for chunk in meta.field("chunks") or []:
            offsets = _as_tuple(chunk.field("offsets") if isinstance(chunk, Placeholder) else None, "a chunk offset", source, name)
            sizes = _as_tuple(chunk.field("sizes"), "a chunk size", source, name)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
                raise _fail(source, f"chunk at {list(offsets)} of size {list(sizes)} does not fit shape {list(shape)}", name)
            loc = where.get((name, offsets))
            if loc is None:
                raise _fail(source, f"no storage holds the chunk at offsets {list(offsets)}", name)
            if _prod(sizes) * (DTYPE_BITS[dtype] // 8) > loc[2]:  # bounds what reading it may allocate
                raise _fail(source, f"the chunk at {list(offsets)} needs {_prod(sizes) * (DTYPE_BITS[dtype] // 8)} bytes but its stored stream has {loc[2]}", name)
            chunks.append(Chunk(offsets, sizes, loc[0], loc[1], loc[2]))
            covered += _prod(sizes)
        if covered != _prod(shape):
            raise _fail(
                source, f"its chunks hold {covered} of its {_prod(shape)} elements", name,
                "Some ranks' data is missing from the metadata; re-save the checkpoint.",
            )
        tensors.append(DcpTensor(name, dtype, shape, tuple(chunks), stage, _path_of(planner, name)))
    version = root.field("version")
    return tensors, objects, str(version) if version is not None else ""


def _path_of(planner: dict, name: str) -> tuple | None:
    path = planner.get(name)
    if isinstance(path, (tuple, list)) and path and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
        return tuple(path)
    return None


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class DcpReader:
    """Reads DCP tensors by assembling their chunks; chunk layouts are parsed on first use and cached."""

    def __init__(self, root: Path, tensors: dict[str, DcpTensor], objects: dict[str, DcpObject], meta_reader: Any = None) -> None:
        self.root = root
        self.tensors = tensors
        self.objects = objects
        self.meta_reader = meta_reader  # TorchZipReader of a Lightning meta.pt, names without the 'meta.' prefix
        self.files = FilePool(root)
        self._places: dict[tuple[str, int], torch_zip.TensorPlace] = {}

    def _fd(self, rel: str) -> int:
        return self.files.fd(rel)

    def _place(self, entry: DcpTensor, chunk: Chunk) -> torch_zip.TensorPlace:
        key = (chunk.file, chunk.offset)
        place = self._places.get(key)
        if place is not None:
            return place
        fd = self._fd(chunk.file)
        source = f"{self.root / chunk.file} [bytes {chunk.offset}..{chunk.offset + chunk.length}]"
        try:
            archive = torch_zip.open_archive(
                fd, source, chunk.offset, chunk.length, max_pickle_bytes=torch_zip.MAX_CHUNK_PICKLE_BYTES
            )
        except EOFError:
            raise _fail(str(self.root / chunk.file), "the file ends before the chunk's stream", entry.name) from None
        ref = archive.root
        if not isinstance(ref, TensorRef):
            raise _fail(str(self.root / chunk.file), f"the chunk at {list(chunk.offsets)} holds {type(ref).__name__}, not a tensor", entry.name)
        place = torch_zip.place_tensor(fd, archive, entry.name, ref, source)
        if torch_zip.dtype_code(ref.dtype) != entry.dtype or tuple(ref.shape) != chunk.sizes:
            raise _fail(
                str(self.root / chunk.file),
                f"the chunk at {list(chunk.offsets)} holds {ref.dtype}{list(ref.shape)}, the metadata says {entry.dtype}{list(chunk.sizes)}",
                entry.name,
            )
        self._places[key] = place
        return place

    def _chunk_bytes(self, entry: DcpTensor, chunk: Chunk) -> bytes:
        place = self._place(entry, chunk)
        nbytes = _prod(chunk.sizes) * place.itemsize
        try:
            return torch_zip.read_place(self._fd(chunk.file), place, nbytes)
        except EOFError:
            raise _fail(str(self.root / chunk.file), "the file ended early (it changed after it was opened)", entry.name) from None

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's row-major bytes, assembled from only its own chunks."""
        if self.meta_reader is not None and info.name.startswith("meta.") and info.name not in self.tensors:
            return self.meta_reader.read_bytes(info.with_name(info.name[len("meta."):]))
        entry = self.tensors[info.name]
        if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
            return self._chunk_bytes(entry, entry.chunks[0])
        import numpy as np

        itemsize = DTYPE_BITS[entry.dtype] // 8
        out = bytearray(_prod(entry.shape) * itemsize)
        full = np.frombuffer(out, dtype=np.dtype(f"V{itemsize}")).reshape(entry.shape)
        for chunk in entry.chunks:
            if not _prod(chunk.sizes):
                continue
            part = np.frombuffer(self._chunk_bytes(entry, chunk), dtype=full.dtype).reshape(chunk.sizes)
            full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))] = part
        return bytes(out)

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """Raw bytes of a tensor stored as one contiguous chunk, else None."""
        if self.meta_reader is not None and info.name.startswith("meta.") and info.name not in self.tensors:
            return self.meta_reader.locate(info.with_name(info.name[len("meta."):]))
        entry = self.tensors[info.name]
        if len(entry.chunks) != 1 or entry.chunks[0].sizes != entry.shape:
            for chunk in entry.chunks:  # parse the chunks' archives now (planning), so a run reads only tensor bytes
                if _prod(chunk.sizes):
                    self._place(entry, chunk)
            return None
        place = self._place(entry, entry.chunks[0])
        if not place.contiguous:
            return None
        return ((self.root / entry.chunks[0].file).resolve(), place.begin, place.begin + info.nbytes)

    def sources_of(self, info: TensorInfo) -> list[tuple[str, int]]:
        """(file, bytes) for every file a whole read of the tensor touches: each chunk's file, or `meta.pt`."""
        if self.meta_reader is not None and info.name.startswith("meta.") and info.name not in self.tensors:
            return [(LIGHTNING_META, info.nbytes)]
        entry = self.tensors[info.name]
        itemsize = DTYPE_BITS[entry.dtype] // 8
        out: dict[str, int] = {}
        for chunk in entry.chunks:
            n = _prod(chunk.sizes) * itemsize
            if n:
                out[chunk.file] = out.get(chunk.file, 0) + n
        return list(out.items())

    def planner_path(self, name: str) -> tuple | None:
        """The nested state-dict path DCP recorded for an entry (tensor or object), or None."""
        entry = self.tensors.get(name) or self.objects.get(name)
        return entry.path if entry is not None else None

    def object_sources(self) -> tuple[list[tuple[str, Path, int, int]], list[str]]:
        """Non-tensor entries as (name, absolute file, offset, length) of their torch.save streams, and warnings.

        An entry several pipeline stages store keeps the first stage's value (the others are named in a warning).
        """
        found = []
        dropped = []
        for key, obj in self.objects.items():
            if key != obj.name:  # a later stage's copy of an entry an earlier stage holds
                dropped.append(key)
                continue
            found.append((key, (self.root / obj.file).resolve(), obj.offset, obj.length))
        warnings = []
        if dropped:
            shown = ", ".join(dropped[:4]) + (" ..." if len(dropped) > 4 else "")
            warnings.append(
                f"{len(dropped)} non-tensor entries are stored by several pipeline stages ({shown}); the merged checkpoint "
                "keeps the first stage's value of each."
            )
        return found, warnings

    def read_object(self, name: str) -> Any:
        """A non-tensor entry's value, unpickled inertly (unknown classes come back as placeholders)."""
        obj = self.objects.get(name)
        if obj is None:
            raise CheckpointError(f"Cannot read {name!r}: the checkpoint has no such non-tensor entry. See dcp_objects().", tensor=name)
        source = f"{self.root / obj.file} [bytes {obj.offset}..{obj.offset + obj.length}]"
        return torch_zip.open_archive(self._fd(obj.file), source, obj.offset, obj.length).root

    def close(self) -> None:
        self.files.close()
        if self.meta_reader is not None:
            self.meta_reader.close()


def open_path(path: Path) -> Catalog:
    """Open a DCP folder, a folder of `ppN/` stages, or a Lightning sharded `*.ckpt/` folder."""
    folder = path.parent if path.is_file() else path
    stages = stage_dirs(folder) if not (folder / METADATA_NAME).is_file() else []
    parts = [(s, d, f"{d.name}/") for s, d in stages] or [(None, folder, "")]
    loaded = [(stage, prefix, *read_metadata(sub, prefix, stage)) for stage, sub, prefix in parts]
    tensors, objects, warnings, versions = merge_stages(loaded)
    check_spans(tensors, objects, lambda rel: _local_size(folder, rel), str(folder))
    infos, columns, metadata = catalog_tables(tensors, versions, len(stages))

    meta_reader = None
    meta_pt = folder / LIGHTNING_META
    if meta_pt.is_file():
        safe_member(folder, LIGHTNING_META, what=f"the Lightning {LIGHTNING_META}")
        meta_catalog = torch_zip.open_path(meta_pt, max_pickle_bytes=torch_zip.MAX_META_PICKLE_BYTES)
        for name, info in meta_catalog.tensors.items():
            infos[f"meta.{name}"] = TensorInfo(f"meta.{name}", info.dtype, info.shape, LIGHTNING_META, info.begin, info.end)
        meta_reader = meta_catalog.reader
        metadata.update({f"meta_{k}": v for k, v in meta_catalog.metadata.items()})
        if "lightning_version" in meta_catalog.metadata:
            metadata["lightning_version"] = meta_catalog.metadata["lightning_version"]
        warnings.extend(meta_catalog.warnings)

    files = _file_infos(folder, infos)
    return Catalog(
        root=folder,
        format="dcp",
        tensors=infos,
        files=files,
        metadata=metadata,
        warnings=warnings,
        extras=_extras(folder),
        reader=DcpReader(folder, tensors, objects, meta_reader),
        columns=columns,
    )


StageMetadata = tuple[int | None, str, list[DcpTensor], list[DcpObject], str]


def merge_stages(loaded: list[StageMetadata]) -> tuple[dict[str, DcpTensor], dict[str, DcpObject], list[str], set[str]]:
    """One table of tensors and objects from each stage's parsed `.metadata` (stage, prefix, tensors, objects,
    version): a tensor several stages store keeps the first stage's copy, with a warning."""
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, DcpObject] = {}
    warnings: list[str] = []
    versions = set()
    for stage, prefix, stage_tensors, stage_objects, version in loaded:
        versions.add(version)
        for entry in stage_tensors:
            if entry.name in tensors:
                first = tensors[entry.name]
                same = (first.dtype, first.shape) == (entry.dtype, entry.shape)
                warnings.append(
                    f"Tensor {entry.name!r} is stored by stages {first.stage} and {stage}"
                    f"{'' if same else f' with different metadata ({first.dtype}{list(first.shape)} vs {entry.dtype}{list(entry.shape)})'}; "
                    f"the catalog lists stage {first.stage}'s copy."
                )
                continue
            tensors[entry.name] = entry
        for obj in stage_objects:
            key = obj.name if obj.name not in objects else f"{prefix}{obj.name}"
            objects[key] = obj
    return tensors, objects, warnings, versions


def catalog_tables(
    tensors: dict[str, DcpTensor], versions: set[str], n_stages: int
) -> tuple[dict[str, TensorInfo], dict[str, dict[str, object]], dict[str, str]]:
    """The catalog's tensor rows (file order), extra columns (chunks, stage) and metadata (version, writer ranks)."""
    ordered = sorted(tensors.values(), key=lambda t: (t.stage or 0, t.chunks[0].file if t.chunks else "", t.chunks[0].offset if t.chunks else 0))
    infos: dict[str, TensorInfo] = {}
    for entry in ordered:
        first = entry.chunks[0] if entry.chunks else None
        infos[entry.name] = TensorInfo(
            entry.name, entry.dtype, entry.shape, first.file if first else "", first.offset if first else 0,
            first.offset + first.length if first else 0,
        )
    columns: dict[str, dict[str, object]] = {"chunks": {t.name: len(t.chunks) for t in ordered}}
    if n_stages:
        columns["stage"] = {t.name: t.stage for t in ordered}
    metadata = {"dcp_version": ",".join(sorted(v for v in versions if v))}
    ranks = {int(m.group(1)) for t in ordered for c in t.chunks if (m := _RANK_FILE.search(c.file))}
    if ranks:
        metadata["writer_ranks"] = str(len(ranks))
    if n_stages:
        metadata["stages"] = str(n_stages)
    return infos, columns, metadata


def _local_size(folder: Path, rel: str) -> int:
    kind = file_kind(folder / rel)
    if kind is not None:
        raise LookupError(shard_state(kind))
    return (folder / rel).stat().st_size


def check_spans(tensors: dict[str, DcpTensor], objects: dict[str, DcpObject], size_of: Callable[[str], int], where: str) -> None:
    """Every data file `.metadata` names exists and holds the byte spans it is said to hold. `size_of(rel)`
    gives a file's size or raises LookupError saying what is wrong with it (missing, not a regular file)."""
    sizes: dict[str, int] = {}
    spans = [(t.name, c.file, c.offset, c.length) for t in tensors.values() for c in t.chunks]
    spans += [(o.name, o.file, o.offset, o.length) for o in objects.values()]
    for name, rel, offset, length in spans:
        if rel not in sizes:
            try:
                sizes[rel] = size_of(rel)
            except LookupError as exc:
                raise _fail(where, f"data file {rel} named by .metadata is {exc.args[0]}", name, "Copy every *.distcp file of the checkpoint.") from None
        if offset + length > sizes[rel]:
            raise _fail(f"{where.rstrip('/')}/{rel}", f"bytes {offset}..{offset + length} lie past the end of the {sizes[rel]}-byte file (truncated?)", name)


def _file_infos(folder: Path, infos: dict[str, TensorInfo]) -> dict[str, FileInfo]:
    counts: dict[str, int] = {}
    for info in infos.values():
        counts[info.file] = counts.get(info.file, 0) + 1
    out = {}
    for rel in sorted(counts):
        if rel:
            out[rel] = FileInfo(rel, (folder / rel).stat().st_size, 0, counts[rel])
    return out


def _extras(folder: Path) -> list[str]:
    skip = {METADATA_NAME, LIGHTNING_META}
    return sorted(e.name for e in os.scandir(folder) if is_extra(folder, e) and e.name not in skip and not e.name.endswith(".distcp"))


def _reader_of(catalog: Catalog) -> DcpReader:
    if not isinstance(catalog.reader, DcpReader):
        raise CheckpointError(f"Cannot list DCP chunks of {catalog.root}: it is a {catalog.format!r} checkpoint, not DCP.", file=str(catalog.root))
    return catalog.reader


def dcp_chunks(catalog: Catalog) -> pd.DataFrame:
    """One row per stored chunk: tensor, stage, file, offsets, sizes, byte offset and length of its stream."""
    import pandas as pd

    reader = _reader_of(catalog)
    rows = [
        {
            "tensor": t.name, "stage": t.stage, "file": c.file, "offsets": c.offsets, "sizes": c.sizes,
            "byte_offset": c.offset, "length": c.length,
        }
        for t in reader.tensors.values()
        for c in t.chunks
    ]
    return pd.DataFrame(rows, columns=["tensor", "stage", "file", "offsets", "sizes", "byte_offset", "length"])


def dcp_objects(catalog: Catalog) -> pd.DataFrame:
    """One row per non-tensor entry (step counters, param_groups values, RNG state ...), index = key."""
    import pandas as pd

    reader = _reader_of(catalog)
    rows = [{"key": k, "stage": o.stage, "file": o.file, "byte_offset": o.offset, "length": o.length} for k, o in reader.objects.items()]
    return pd.DataFrame(rows, columns=["key", "stage", "file", "byte_offset", "length"]).set_index("key")


def read_object(catalog: Catalog, key: str) -> Any:
    """The value of one non-tensor entry, unpickled without executing anything."""
    return _reader_of(catalog).read_object(key)
