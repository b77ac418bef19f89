"""Writing Meta's `consolidated.NN.pth` + `params.json`, laid out before the first byte like every output.

A `consolidated.NN.pth` is one torch.save zip of a flat dict name -> tensor: `data.pkl` (the dict, each
tensor a `_rebuild_tensor_v2` of a persistent storage key), the small records torch writes, one stored
entry `data/<k>` per tensor (64-aligned), then the central directory. Given names, dtypes and shapes every
byte is fixed except the data and their CRC-32s, so the file is laid out as a sequence of the DCP writer's
streams (the first carries the pickle, the last the directory) and filled and CRC-patched by that writer:
no state dict is ever held, and `torch.load(weights_only=True)` reads the result.

Model parallel (`nproc_mp=N` via `wb.convert(..., to="pth", dtype=None)` with a Meta MP mapper) writes one
file per MP rank: output tensors named `mp<r>/<name>` go to `consolidated.<r>.pth` under `<name>`.
`params.json` (Meta's model arguments from `config.json`) is written last, as the commit marker.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import nbytes_of
from ..errors import PlanError
from ..files import atomic_write
from . import source_files
from .base import OutputFormat
from .config_values import MAX_VOCAB, ModelConfig
from .dcp import (
    _LEGACY_STORAGE,
    _SMALL_RECORDS,
    DcpFileLayout,
    DcpShardWriter,
    StreamPlace,
    TensorStream,
    _central_entry,
    _local_header,
    contiguous_strides,
)
from .safetensors import FileLayout, SafetensorsWriter
from .slots import slot_catalog

PARAMS_NAME = "params.json"
_MP_NAME = re.compile(r"mp(\d+)/(.+)")
_OWNED = re.compile(r"consolidated\.\d+\.pth")


def pth_file_name(k: int) -> str:
    """Meta's name of model-parallel file `k`: `consolidated.0k.pth`."""
    return f"consolidated.{k:02d}.pth"


def stored_name(name: str) -> str:
    """The dict key of output tensor `name` (without its `mp<r>/` file prefix)."""
    match = _MP_NAME.fullmatch(name)
    return match.group(2) if match else name


def mp_rank(name: str) -> int:
    """The model-parallel file of output tensor `name` (0 without an `mp<r>/` prefix)."""
    match = _MP_NAME.fullmatch(name)
    return int(match.group(1)) if match else 0


def dict_pickle(entries: Sequence[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """`data.pkl` of torch.save({name: tensor}) for fresh contiguous CPU tensors (name, dtype, shape), storage
    keys "0", "1", ... in order. Pickled by Python's own pickler (protocol 2, as torch.save) with stand-ins."""
    import torch

    class _Storage:
        def __init__(self, key: str, dtype: str, numel: int) -> None:
            self.key, self.dtype, self.numel = key, dtype, numel

    class _Tensor:
        def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
            self.storage, self.shape = storage, shape

        def __reduce__(self) -> Any:
            return (torch._utils._rebuild_tensor_v2, (self.storage, 0, self.shape, contiguous_strides(self.shape), False, OrderedDict()))

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _Storage):
                return ("storage", getattr(torch, _LEGACY_STORAGE[obj.dtype]), obj.key, "cpu", obj.numel)
            return None

    state = {}
    for k, (name, dtype, shape) in enumerate(entries):
        numel = 1
        for d in shape:
            numel *= d
        state[name] = _Tensor(_Storage(str(k), dtype, numel), tuple(shape))
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(state)
    return out.getvalue()


def layout_pth_file(file: str, tensors: Sequence[TensorInfo]) -> DcpFileLayout:
    """Lay out one torch.save zip holding `tensors` (a dict keyed by `stored_name`), as writer streams."""
    archive = Path(file).stem
    entries = []
    seen: set[str] = set()
    for t in tensors:
        key = stored_name(t.name)
        if key in seen:
            raise PlanError(f"Cannot lay out {file}: tensor name {key!r} appears twice. Rename it.", tensor=t.name)
        if t.dtype not in _LEGACY_STORAGE:
            raise PlanError(f"Cannot lay out {file}: tensor {t.name!r} is {t.dtype}, which Meta's .pth layout does not hold here. "
                            "Cast it (dtype='bf16').", tensor=t.name)
        seen.add(key)
        entries.append((key, t.dtype, tuple(t.shape)))
    head = bytearray()
    central = bytearray()
    records = [("data.pkl", dict_pickle(entries)), *[(n, c) for n, c in _SMALL_RECORDS if n != "version"]]
    for name, content in records:
        raw = f"{archive}/{name}".encode()
        crc = zlib.crc32(content)
        central += _central_entry(raw, crc, len(content), len(head))
        head += _local_header(raw, crc, len(content), len(head)) + content
    pieces = []  # (offset of its head, head bytes, data length, CRC position in the head, CRC position in `central`)
    position = 0
    for k, t in enumerate(tensors):
        raw = f"{archive}/data/{k}".encode()
        length = nbytes_of(t.dtype, t.numel)
        header_at = len(head) if k == 0 else position
        local = _local_header(raw, 0, length, header_at)
        start = 0 if k == 0 else position
        piece_head = bytes(head) + local if k == 0 else local
        pieces.append((start, piece_head, length, len(piece_head) - len(local) + 14, len(central) + 16))
        central += _central_entry(raw, 0, length, header_at)
        position = start + len(piece_head) + length
    version = dict(_SMALL_RECORDS)["version"]
    raw = f"{archive}/version".encode()
    central += _central_entry(raw, zlib.crc32(version), len(version), position)
    trailer = _local_header(raw, zlib.crc32(version), len(version), position) + version
    cd_offset = position + len(trailer)
    n = len(records) + len(tensors) + 1
    end = bytearray(central)
    import struct

    end += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(central), cd_offset)
    end += struct.pack("<IIQI", 0x07064B50, 0, cd_offset + len(central), 1)
    end += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), len(central), min(cd_offset, 0xFFFFFFFF), 0)
    tail = trailer + bytes(end)
    places, slots = [], []
    for k, (t, (start, piece_head, length, crc_head, crc_central)) in enumerate(zip(tensors, pieces, strict=True)):
        data_end = start + len(piece_head) + length
        last = k == len(tensors) - 1
        crc_in_tail = position + len(trailer) + crc_central - data_end  # the central directory follows the last entry
        stream = TensorStream(piece_head, length, tail if last else b"", crc_head, crc_in_tail)
        places.append(StreamPlace(t.name, start, stream))
        slots.append(TensorInfo(t.name, t.dtype, tuple(t.shape), file, start + len(piece_head), data_end))
    size = cd_offset + len(end) if tensors else 0
    return DcpFileLayout(file, bytes(head), tuple(slots), size, tuple(places))


def open_written_pth(dest: Path, layouts: Sequence[FileLayout]) -> Any:
    """A catalog of written `.pth` files' data slots, after the zip's own directory confirmed each entry
    (name, offset, size) and its CRC-32; CheckpointError otherwise."""
    import zipfile

    from ..errors import CheckpointError

    slots = []
    for layout in layouts:
        path = dest / layout.file
        try:
            with zipfile.ZipFile(path) as archive:
                infos = {i.filename: i for i in archive.infolist()}
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            raise CheckpointError(f"Cannot verify {path}: it is not a readable zip ({exc}). Convert again.") from None
        if bad is not None:
            raise CheckpointError(f"Cannot verify {path}: entry {bad!r} fails its CRC-32. Convert again.")
        archive_name = Path(layout.file).stem
        for k, slot in enumerate(layout.tensors):
            entry = infos.get(f"{archive_name}/data/{k}")
            if entry is None or entry.file_size != slot.nbytes or entry.header_offset >= slot.begin:
                raise CheckpointError(f"Cannot verify {path}: the entry of {slot.name!r} is not where it was planned. Convert again.",
                                      tensor=slot.name)
            slots.append(slot)
    return slot_catalog(dest, "pth", slots)


# Meta's releases chose these (multiple_of, ffn_dim_multiplier) pairs: Llama 2 7B/13B (256, none), Llama 2/3 70B
# (4096, 1.3), Llama 3 8B (1024, 1.3), Llama 3.1 405B (4096, 1.2). Tried in this order, those models get their own
# values back (Llama 3.2's smaller ones get another pair that gives the same width).
_MULTIPLIERS = (None, 1.3, 1.2, 1.5, 2.0)
_MULTIPLES = (4096, 1024, 256)
ROPE_THETA_LLAMA2 = 10000.0  # Llama 2's code has no rope_theta argument; it always uses this base
# config.json keys without which a folder is not a Llama Meta's params.json can describe (no params.json then)
META_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "rms_norm_eps")


def meta_ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The feed-forward width Meta's `FeedForward` computes from `dim` (its formula, restated)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def meta_ffn_arguments(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """`(multiple_of, ffn_dim_multiplier)` from which Meta's formula gives exactly `intermediate_size`: the first of
    Meta's usual pairs that fits, else a multiplier of intermediate / int(8 * dim / 3) and the largest power of two
    (up to 256) dividing the width."""
    for multiplier in _MULTIPLIERS:
        for multiple in _MULTIPLES:
            if meta_ffn_hidden(dim, multiple, multiplier) == intermediate_size:
                return multiple, multiplier
    base = int(2 * (4 * dim) / 3)
    multiple = 1
    while multiple < 256 and intermediate_size % (multiple * 2) == 0:
        multiple *= 2
    multiplier = intermediate_size / base
    while int(multiplier * base) < intermediate_size:  # float rounding may land just below the width
        multiplier = math.nextafter(multiplier, math.inf)
    if meta_ffn_hidden(dim, multiple, multiplier) != intermediate_size:
        raise PlanError(f"Cannot write Meta's params.json: no multiple_of / ffn_dim_multiplier gives intermediate_size "
                        f"{intermediate_size} for dim {dim} in Meta's FeedForward formula.")
    return multiple, multiplier


def meta_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """Meta's `params.json` model arguments from an HF Llama `config.json`, with the keys Meta's `ModelArgs` takes
    (it refuses unknown ones): dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of, ffn_dim_multiplier
    (when one is needed), norm_eps, and rope_theta (Llama 3 style, only when it is not Llama 2's fixed 10000) with
    use_scaled_rope for Llama 3.1's rope scaling. Every value is read by `ModelConfig`'s typed getters: a size
    out of range, a NaN or a string is refused naming config.json and the key, never copied."""
    values = ModelConfig.of(config)
    missing = [key for key in META_KEYS if values.get(key) is None]
    if missing:
        raise KeyError(missing[0])  # not a Llama config: no params.json arguments (the caller writes none)
    rope = values.rope()
    theta = float(rope.get("rope_theta") or values.real("rope_theta", ROPE_THETA_LLAMA2))
    dim = values.size("hidden_size")
    multiple_of, multiplier = meta_ffn_arguments(dim, values.size("intermediate_size"))
    heads = values.size("num_attention_heads")
    params: dict[str, Any] = {
        "dim": dim, "n_layers": values.size("num_hidden_layers"), "n_heads": heads,
        "n_kv_heads": values.size("num_key_value_heads", heads), "vocab_size": values.size("vocab_size", maximum=MAX_VOCAB),
        "multiple_of": multiple_of,
    }
    if multiplier is not None:
        params["ffn_dim_multiplier"] = multiplier
    params["norm_eps"] = values.real("rms_norm_eps", below=1.0)
    if theta != ROPE_THETA_LLAMA2:
        params["rope_theta"] = theta
    if rope.get("rope_type") == "llama3":
        params["use_scaled_rope"] = True
    return params


def _files_named(mapper: Any, nproc_mp: int) -> int:
    """How many model-parallel files the output has: `nproc_mp`, or as many as a user mapper's `mp<r>/` output names
    say (`output_presets.hf_to_meta_mp` with the default nproc_mp=1), read from its leaves without binding it."""
    if mapper is None or nproc_mp > 1 or not hasattr(mapper, "leaves"):
        return nproc_mp
    ranks = [mp_rank(name) for leaf in mapper.leaves() for name in getattr(leaf, "outputs", ()) if isinstance(name, str)]
    return max(ranks, default=0) + 1


class PthOutput(OutputFormat):
    """Meta's original layout: `consolidated.NN.pth` torch zips (one per model-parallel rank) and `params.json`."""

    name = "pth"
    title = "Meta .pth"
    label = " (Meta consolidated.pth)"
    keeps_header_metadata = False
    copies_extras = False
    default_shard_size = 1 << 62
    model_parallel = True

    def __init__(self, params: Mapping[str, Any] | None = None, mp: int = 1, stated: Any = None) -> None:
        self.params = dict(params or {})
        self.mp = mp
        self.stated = stated  # what Meta's model declares (output.statement.meta_statement), when the preset wrote it

    def statement(self) -> Any:
        return self.stated

    def prepare(self, catalog: Any, mapper: Any, options: Any, preset: Any = None) -> tuple[Any, OutputFormat, Any]:
        from .gguf.metadata import read_config

        root = Path(catalog.root)
        folder = root if root.is_dir() else root.parent
        params: dict[str, Any] = {}
        stated = None
        has_config = source_files.present(folder / "config.json")
        if options.nproc_mp > 1 and not has_config:
            raise PlanError(f"Cannot split {folder} into {options.nproc_mp} model-parallel files: it has no config.json "
                            "(heads and sizes decide the split). Convert an HF model folder, or pass a mapper that names "
                            "outputs mp<r>/<name>.")
        if has_config:
            config = read_config(folder, "Meta .pth")
            if preset is not None and hasattr(preset, "layout"):  # Meta's whole layout, whoever names the tensors (D3)
                from .statement import meta_statement_of

                stated = meta_statement_of(preset.layout, config, _files_named(mapper, options.nproc_mp))
            if preset is not None and (mapper is None or options.nproc_mp > 1):
                mapper = preset(config, options.nproc_mp, before=mapper)
            try:
                params = meta_params(config)
            except KeyError:
                params = {}
        if stated is None:
            from .statement import unchecked

            stated = unchecked("Meta's layout", f"{folder} has no config.json to state it" if not has_config else "no preset states it")
        return mapper, PthOutput(params, stated=stated), options

    def file_name(self, k: int, n: int) -> str:
        return pth_file_name(k)

    def owns(self, name: str) -> bool:
        """`consolidated.NN.pth` files and `params.json`."""
        return name == PARAMS_NAME or _OWNED.fullmatch(name) is not None

    def layout_file(self, name: str, tensors: Sequence[TensorInfo], metadata: Mapping[str, str] | None = None) -> FileLayout:
        return layout_pth_file(name, tensors)

    def open_writer(self, folder: str | os.PathLike, layout: FileLayout) -> SafetensorsWriter:
        return DcpShardWriter(folder, layout)

    def shard_of(self, name: str) -> int | None:
        """Files are model-parallel ranks: `mp<r>/...` outputs go to file r."""
        return mp_rank(name)

    def commit_files(self, layouts: Sequence[FileLayout], objects: bool) -> list[str]:
        return [PARAMS_NAME]

    def open_written(self, dest: Path, layouts: Sequence[FileLayout]) -> Any:
        return open_written_pth(dest, layouts)

    def commit(self, dest: Path, layouts: Sequence[FileLayout], reader: Any, *, objects: bool) -> bool:
        atomic_write(dest / PARAMS_NAME, json.dumps(self.params, indent=2) + "\n")
        return True


__all__ = ["PARAMS_NAME", "PthOutput", "dict_pickle", "layout_pth_file", "meta_ffn_arguments", "meta_ffn_hidden", "meta_params", "mp_rank", "pth_file_name", "stored_name"]
