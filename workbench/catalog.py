"""The metadata model every layer shares: what tensors a checkpoint holds and where their bytes are.

A `Catalog` is built from headers alone. It never holds tensor data; it knows, for each tensor, its
dtype, shape and the byte range that stores it, and it has a `reader` that fetches those bytes when
asked. Mappers bind to catalogs, plans are computed from them, and the engine copies the byte ranges
they name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .dtypes import DTYPE_BITS


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's metadata: name, safetensors dtype code, shape, and where its bytes live.

    `file` is relative to the catalog root ('' when the tensor is not on disk, e.g. a mapper output
    before it is laid out); `begin`/`end` are absolute byte offsets in that file, end exclusive.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str = ""
    begin: int = 0
    end: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return (math.prod(self.shape) * DTYPE_BITS[self.dtype] + 7) // 8  # dtypes.nbytes_of, inlined: called per tensor

    def with_name(self, name: str) -> TensorInfo:
        return TensorInfo(name, self.dtype, self.shape, self.file, self.begin, self.end)

    def meta(self) -> TensorInfo:
        """The same tensor without a location (what a mapper output looks like)."""
        return TensorInfo(self.name, self.dtype, self.shape)


def _slot_filling_init():  # noqa: ANN202 - returns TensorInfo's __init__
    set_name, set_dtype, set_shape, set_file, set_begin, set_end = (
        TensorInfo.__dict__[name].__set__ for name in ("name", "dtype", "shape", "file", "begin", "end")
    )

    def __init__(self: TensorInfo, name: str, dtype: str, shape: tuple[int, ...], file: str = "", begin: int = 0, end: int = 0) -> None:
        set_name(self, name)
        set_dtype(self, dtype)
        set_shape(self, shape)
        set_file(self, file)
        set_begin(self, begin)
        set_end(self, end)

    __init__.__qualname__ = "TensorInfo.__init__"
    return __init__


# The generated __init__ of a frozen dataclass calls object.__setattr__ per field, which made constructing the
# 100k+ infos of a big checkpoint (opened, bound, laid out) a visible share of planning. Filling the slots
# through their descriptors is ~2x faster; instances stay frozen, equal and hashable as before.
TensorInfo.__init__ = _slot_filling_init()  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One file of a checkpoint that holds tensors."""

    path: str  # relative to the catalog root
    size: int
    header_bytes: int
    n_tensors: int


class TensorReader(Protocol):
    """Fetches tensor bytes for a catalog; one per opened checkpoint."""

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's bytes, row-major contiguous, exactly `info.nbytes` long."""
        ...

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """(absolute path, begin, end) when the bytes lie contiguous and raw in one file, else None.

        The engine copies located tensors with kernel copies; the rest go through `read_bytes`.
        """
        ...

    def close(self) -> None: ...


@dataclass
class Catalog(Mapping[str, TensorInfo]):
    """An ordered mapping name -> TensorInfo plus the files that hold them.

    Order is the on-disk order (file, then offset), which is the order a reader streams them in.
    """

    root: Path
    format: str
    tensors: dict[str, TensorInfo]
    files: dict[str, FileInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)  # non-tensor files beside the weights (config.json ...)
    reader: TensorReader | None = field(default=None, repr=False, compare=False)
    # Optional per-tensor facts a format knows (e.g. 'stage' of a pipeline DCP, 'shared_with' of a torch file):
    # column name -> {tensor name -> value}; tensors without a value are simply absent.
    columns: dict[str, dict[str, object]] = field(default_factory=dict)
    # The `columns` that `workbench inspect` shows in its table (a GGUF file's `gguf_type`, `logical_shape`): facts
    # without which a row misleads (a Q4_K tensor listed as U8 bytes).
    shown_columns: tuple[str, ...] = ()
    # The safetensors `__metadata__` of each source file (path relative to the root -> its string mapping);
    # empty for formats without header metadata. Conversions carry it over where it is unambiguous.
    file_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    # The URL a remote checkpoint was opened from (hf://, https://, s3://); '' for local ones, whose `root` says it.
    url: str = ""
    # Keyword arguments the format's opener took beyond the path (a DeepSpeed run's `weights` / `moments`):
    # workers on other processes reopen the source with them, so they list the same tensors.
    open_options: dict[str, object] = field(default_factory=dict)
    # The preset (a name under `workbench.mapper.presets`) that converts this checkpoint when no mapper is given,
    # when its format knows that the model's weights need one (a legacy Megatron folder's rank shards:
    # 'megatron_merge'); what the preset does not produce is training state and is dropped. '' for none.
    # Formats name it by string; planning resolves it, so no reader imports a mapper.
    default_preset: str = ""

    @property
    def location(self) -> str:
        """Where the checkpoint is, for people: its URL (and the host that served it, when a redirect led elsewhere),
        else its root path."""
        if self.url:
            note = getattr(getattr(self.reader, "store", None), "served_note", None)
            return self.url + (note() if callable(note) else "")
        return str(self.root)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def path_of(self, info: TensorInfo) -> Path:
        """Absolute path of the file that holds `info`."""
        return self.root / info.file if self.root.is_dir() else self.root

    def locate(self, name: str) -> tuple[Path, int, int] | None:
        """Where one tensor's raw bytes lie, if contiguous in a single file (see TensorReader.locate)."""
        return None if self.reader is None else self.reader.locate(self.tensors[name])

    def read_bytes(self, name: str) -> bytes:
        """The raw bytes of one tensor (only that tensor's byte range is read)."""
        if self.reader is None:
            from .errors import CheckpointError

            raise CheckpointError(f"Cannot read tensor {name!r}: this catalog has no data (it was built from metadata only).")
        return self.reader.read_bytes(self.tensors[name])

    @classmethod
    def from_infos(cls, infos: Iterable[TensorInfo], *, root: str | Path = ".", format: str = "memory") -> Catalog:
        """A data-less catalog from metadata, for planning against synthetic or expected layouts."""
        return cls(root=Path(root), format=format, tensors={t.name: t for t in infos})
