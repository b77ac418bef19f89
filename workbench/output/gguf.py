"""Writing GGUF files (llama.cpp, Ollama) with the header planned before the first data byte.

A GGUF file is: a fixed header, key/value metadata, one record per tensor (name, dims, GGML type, offset),
padding to 32 bytes, then the tensors' data, each starting 32-aligned. Given the output tensors' types
and shapes, every byte position is known in advance, so the planner lays the file out like a safetensors
shard (the header bytes and one data slot per tensor) and the engine fills the slots with its ordinary
copies, casts and computes, in bounded memory. Q8_0 tensors arrive as their GGUF bytes (U8 slots made by
the preset's quantiser); F32 / F16 / BF16 slots hold plain little-endian values.

The tensors, names and metadata follow llama.cpp's `convert_hf_to_gguf.py` for the same folder (see
`workbench.mapper.presets.gguf_preset` and `gguf_metadata`); the container is packed with the `gguf` package.
Split outputs (`shard_size=`) carry llama.cpp's `split.no` / `split.count` / `split.tensors.count` keys; as llama.cpp
writes them, only the first split holds the model's key/values (metadata and vocabulary), the others the split keys.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..catalog import TensorInfo
from ..errors import PlanError
from .base import OutputFormat
from .gguf_packed import PackedArray
from .gguf_rope import GeneratedTensor
from .safetensors import FileLayout, SafetensorsWriter
from .slots import slot_catalog

ALIGNMENT = 32  # GGUF's default data alignment
_SPLIT_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.gguf")
DTYPE_NAMES = {"f32": "F32", "float32": "F32", "f16": "F16", "float16": "F16", "half": "F16", "bf16": "BF16",
               "bfloat16": "BF16", "q8_0": "Q8_0", "q8": "Q8_0", "q4_0": "Q4_0"}
QUANTIZED_TYPES = ("Q8_0", "Q4_0")  # arrive as their GGUF bytes (U8 slots)


def gguf_file_name(k: int, n: int) -> str:
    """`model.gguf`, or llama.cpp's split naming `model-0000k-of-0000N.gguf` (k from 1)."""
    return "model.gguf" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.gguf"


@dataclass(frozen=True)
class GgufFileLayout(FileLayout):
    """A GGUF file laid out in advance: `tensors` are the data slots; `types` the GGUF type and logical shape of each."""

    types: tuple[tuple[str, str, tuple[int, ...]], ...] = ()  # (name, GGUF type, logical shape), generated tensors first
    kv: tuple[tuple[str, Any], ...] = ()  # (key, value) as written, for plans and reports
    # Tensors generated from config.json (Llama 3's rope_freqs) placed at the start of the data: their bytes end the
    # `header` (written with it), so they need no step; file, begin and end as for `tensors`.
    generated: tuple[TensorInfo, ...] = ()


@dataclass(frozen=True)
class GgufSpec:
    """What the planner decided for a GGUF output: the metadata and each tensor's GGUF type and shape."""

    arch: str
    kv: Mapping[str, Any]  # key -> gguf.GGUFValue (or a PackedArray for vocabulary arrays), in writing order
    tensors: Mapping[str, Any]  # output name -> GgufTensor
    tokenizer_bytes: int = 0  # size of the tokenizer.json read for the vocabulary (planning.rss counts its cost)
    tokenizer_tokens: int = 0  # tokens listed from it
    generated: tuple[GeneratedTensor, ...] = ()  # tensors made from config.json, written first in the first file


def _pack_kv(kv: Mapping[str, Any]) -> bytes:
    import gguf

    packer = gguf.GGUFWriter(None, "")
    out = bytearray()
    for key, val in kv.items():
        out += packer._pack_val(key, gguf.GGUFValueType.STRING, add_vtype=False)
        if isinstance(val, PackedArray):  # a vocabulary array, kept packed since it was read
            out += val.packed()
        else:
            out += packer._pack_val(val.value, val.type, add_vtype=True, sub_type=val.sub_type)
    return bytes(out)


def _shown(value: Any) -> Any:
    """A key's value for plans and reports: long arrays as their length."""
    if isinstance(value, PackedArray):
        return f"[{value.count} values]"
    return value.value if not isinstance(value.value, list) or len(value.value) <= 8 else f"[{len(value.value)} values]"


def _pack_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def layout_gguf_file(file: str, tensors: Sequence[TensorInfo], spec: GgufSpec, split: tuple[int, int, int] | None) -> GgufFileLayout:
    """Header bytes and every tensor's data offset of one GGUF file. `split`: (index, count, total tensors) when split.

    The first file starts with the spec's generated tensors, as llama.cpp's converter writes them before the model's:
    their records come first (the first at offset 0) and their bytes, known now, follow the header's padding inside
    the planned `header` bytes, so the writer puts them down with it; the tensors' slots follow them."""
    import gguf

    # llama.cpp (gguf-py's GGUFWriter, gguf-split) writes the model's key/values in the first split only; later
    # splits carry the split.* keys alone
    kv = dict(spec.kv) if split is None or split[0] == 0 else {}
    if split is not None:
        kv["split.no"] = gguf.GGUFValue(split[0], gguf.GGUFValueType.UINT16)
        kv["split.count"] = gguf.GGUFValue(split[1], gguf.GGUFValueType.UINT16)
        kv["split.tensors.count"] = gguf.GGUFValue(split[2], gguf.GGUFValueType.INT32)
    records = bytearray()
    types = []
    offset = 0
    relative = []
    rank = {name: k for k, name in enumerate(spec.tensors)}  # the converter's order, whatever the schedule's
    tensors = sorted(tensors, key=lambda t: rank.get(t.name, len(rank)))
    made = spec.generated if split is None or split[0] == 0 else ()
    constant = bytearray()
    for g in made:
        records += _pack_string(g.name) + struct.pack("<I", len(g.shape))
        records += b"".join(struct.pack("<Q", d) for d in reversed(g.shape))
        records += struct.pack("<IQ", int(gguf.GGMLQuantizationType[g.type]), offset)
        types.append((g.name, g.type, tuple(g.shape)))
        constant += g.data + bytes(_pad(g.nbytes))
        offset += g.nbytes + _pad(g.nbytes)
    for t in tensors:
        planned = spec.tensors.get(t.name)
        if planned is None:
            raise PlanError(f"Cannot lay out {file}: tensor {t.name!r} has no place in a llama.cpp {spec.arch} model. "
                            "Drop it (rest='drop') or map it to a GGUF name.", tensor=t.name)
        kind = gguf.GGMLQuantizationType[planned.type]
        expected = "U8" if planned.type in QUANTIZED_TYPES else planned.type
        if t.dtype != expected:
            raise PlanError(f"Cannot lay out {file}: tensor {t.name!r} arrives as {t.dtype}, but GGUF type {planned.type} "
                            f"needs {expected}. The GGUF mapper and the plan disagree.", tensor=t.name)
        shape = planned.shape
        records += _pack_string(t.name) + struct.pack("<I", len(shape))
        records += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        records += struct.pack("<IQ", int(kind), offset)
        relative.append(offset)
        types.append((t.name, planned.type, tuple(shape)))
        offset += t.nbytes + _pad(t.nbytes)
    count = len(made) + len(tensors)
    head = struct.pack("<IIQQ", gguf.GGUF_MAGIC, gguf.GGUF_VERSION, count, len(kv)) + _pack_kv(kv) + bytes(records)
    start = len(head) + _pad(len(head))
    at = start
    placed = []
    for g in made:
        placed.append(TensorInfo(g.name, g.type, tuple(g.shape), file, at, at + g.nbytes))
        at += g.nbytes + _pad(g.nbytes)
    header = head + bytes(_pad(len(head))) + bytes(constant)
    slots = tuple(TensorInfo(t.name, t.dtype, tuple(t.shape), file, start + at, start + at + t.nbytes)
                  for t, at in zip(tensors, relative, strict=True))
    shown = tuple((k, _shown(v)) for k, v in kv.items())
    return GgufFileLayout(file, header, slots, start + offset, tuple(types), shown, tuple(placed))


def _tokenizer_json_bytes(folder: Path) -> int:
    """Bytes of the tokenizer.json the vocabulary is read from (0 when tokenizer.model is read instead)."""
    from .source_files import present

    if present(folder / "tokenizer.model"):
        return 0
    try:
        return (folder / "tokenizer.json").stat().st_size
    except OSError:
        return 0


class GgufOutput(OutputFormat):
    """llama.cpp GGUF: `model.gguf` (or `model-0000k-of-0000N.gguf` splits), tensors named, permuted, typed and
    described exactly as llama.cpp's converter does for the same HF folder."""

    name = "gguf"
    title = "GGUF"
    label = " (GGUF)"
    keeps_header_metadata = False
    copies_extras = False
    applies_dtype_policy = False  # the dtype names the GGUF type of matrices; the preset casts (norms stay F32)
    default_shard_size = 1 << 62  # one file unless a split size is asked for

    def __init__(self, spec: GgufSpec | None = None) -> None:
        self.spec = spec

    def policy(self, dtype: Any) -> str:
        key = str(dtype).lower().removeprefix("torch.")
        if key not in DTYPE_NAMES:
            raise PlanError(f"Cannot write GGUF with dtype={dtype!r}: choose 'f32', 'f16', 'bf16', 'q8_0' or 'q4_0' "
                            "(vectors and norms always stay F32, as in llama.cpp).")
        return DTYPE_NAMES[key]

    def prepare(self, catalog: Any, mapper: Any, options: Any, preset: Any = None) -> tuple[Any, OutputFormat, Any]:
        from .gguf_metadata import kv_metadata, parameter_counts, read_config
        from .gguf_rope import generated_tensors

        try:
            import gguf  # noqa: F401
        except ImportError:
            raise PlanError("Cannot write GGUF: the `gguf` package (llama.cpp's container library) is not installed. "
                            "Install it: pip install 'workbench[gguf]' (or pip install gguf).") from None
        if preset is None:
            raise PlanError("Cannot plan a GGUF output: no HF -> GGUF mapper preset is registered (workbench.mapper.presets.gguf_preset).")

        root = Path(catalog.root)
        config = read_config(root if root.is_dir() else root.parent)
        wanted = options.dtype or "F16"
        combined, planned, arch = preset(config, catalog, wanted, before=mapper)
        made = generated_tensors(config, arch)  # counted among the parameters too, as llama.cpp's writer counts them
        counts = parameter_counts({**{g.name: g.shape for g in made}, **{name: tuple(t.shape) for name, t in planned.items()}})
        kinds = {t.type for t in planned.values() if len(t.shape) > 1}
        file_type = wanted if wanted in kinds or not kinds else sorted(kinds)[0]
        folder = root if root.is_dir() else root.parent
        kv = kv_metadata(folder, arch, config, file_type, counts)
        tokens = kv.get("tokenizer.ggml.tokens")
        spec = GgufSpec(arch, kv, planned, _tokenizer_json_bytes(folder), len(tokens) if isinstance(tokens, PackedArray) else 0, made)
        return combined, GgufOutput(spec), dataclasses.replace(options, rest="drop", extras=False)

    def file_name(self, k: int, n: int) -> str:
        return gguf_file_name(k, n)

    def statement(self) -> Any:
        """The GGUF preset's statement of every tensor (`output.statement.gguf_statement`), for `--verify`."""
        from .statement import gguf_statement

        return gguf_statement(self.spec) if self.spec is not None else None

    def layout_file(self, name: str, tensors: Sequence[TensorInfo], metadata: Mapping[str, str] | None = None) -> FileLayout:
        if self.spec is None:
            raise PlanError("Cannot lay out a GGUF file without its source: plan it with wb.plan(..., to='gguf').")
        match = _SPLIT_NAME.fullmatch(name)
        split = None
        if match:
            split = (int(match.group(1)) - 1, int(match.group(2)), self.split_total)
        return layout_gguf_file(name, tensors, self.spec, split)

    @property
    def split_total(self) -> int:
        """Tensors across all split files (every planned tensor is written, and the generated ones)."""
        return len(self.spec.tensors) + len(self.spec.generated) if self.spec is not None else 0

    def open_writer(self, folder: str | os.PathLike, layout: FileLayout) -> SafetensorsWriter:
        return SafetensorsWriter(folder, layout)

    def commit_files(self, layouts: Sequence[FileLayout], objects: bool) -> list[str]:
        return []

    def open_written(self, dest: Path, layouts: Sequence[FileLayout]) -> Any:
        return open_written_gguf(dest, layouts)

    def details(self, layouts: Sequence[FileLayout]) -> list[tuple[str, list[str], list[tuple]]]:
        from ..display import format_bytes

        tensors, metadata = [], []
        origins = {g.name: f"generated from {g.origin}" for g in self.spec.generated} if self.spec is not None else {}
        planned = self.spec.tensors if self.spec is not None else {}
        for layout in layouts:
            slots = {**{t.name: t for t in getattr(layout, "generated", ())}, **layout.by_name()}
            for name, kind, shape in getattr(layout, "types", ()):
                made = planned.get(name)
                origin = origins.get(name) or (f"{len(made.stacked)} experts from {made.stacked[0]}" if made is not None and made.stacked
                                               else made.source if made is not None else "")
                tensors.append((name, kind, "x".join(map(str, shape)), format_bytes(slots[name].nbytes), layout.file, origin))
            if not metadata:
                metadata = [(key, str(value)[:80]) for key, value in getattr(layout, "kv", ())]
        return [("GGUF tensors", ["tensor", "type", "shape", "size", "file", "from"], tensors),
                ("GGUF metadata (first file)", ["key", "value"], metadata)]

    def lossy_errors(self, source: Any, written: Any) -> dict[str, float]:
        """Q8_0 / Q4_0 tensors de-quantised (by the `gguf` package) against the source, permuted as planned, in float32.
        numpy alone (ml_dtypes for bfloat16), as the conversion: `--verify` of a GGUF output does not import torch."""
        import gguf
        import numpy as np

        errors: dict[str, float] = {}
        if self.spec is None:
            return errors
        for name, planned in self.spec.tensors.items():
            if planned.type not in QUANTIZED_TYPES or name not in written:
                continue
            parts = []
            for part in planned.stacked or (planned.source,):
                values = _float32(source, part)
                if planned.fp8_block:  # an FP8 weight: de-quantised by its tiles' scales, as the preset does
                    values = _dequantized(source, part, values, planned.fp8_block)
                parts.append(values)
            expected = np.stack(parts) if planned.stacked else parts[0]
            if planned.part:  # per head, some rows of the source (transposed for MLA's k_b)
                heads, first, rows, transposed = planned.part
                expected = expected.reshape(heads, -1, expected.shape[-1])[:, first:first + rows]
                expected = expected.swapaxes(1, 2) if transposed else expected
            if planned.heads:
                rows = expected.shape[0]  # llama.cpp's q/k order: per head (2, half) rows -> (half, 2)
                expected = expected.reshape(planned.heads, 2, rows // planned.heads // 2, -1).swapaxes(1, 2).reshape(expected.shape)
            stored = np.frombuffer(written.read_bytes(name), dtype=np.uint8).reshape(written[name].shape)
            values = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[planned.type])
            errors[name] = float(np.abs(values.reshape(expected.shape) - expected).max()) if expected.size else 0.0
        return errors

    def check_generated(self, layouts: Sequence[FileLayout], written: Any) -> list[tuple[str, str, str, float | None, int, str]]:
        """For `--verify`: each generated tensor (Llama 3's rope_freqs) computed again from its config parameters and
        compared with the bytes the written file's own header points at."""
        made = {g.name: g for g in self.spec.generated} if self.spec is not None else {}
        rows = []
        for layout in layouts:
            for slot in getattr(layout, "generated", ()):
                if slot.name not in written:
                    rows.append((slot.name, "generated", "missing", None, 0, "not in the output"))
                    continue
                same = written.read_bytes(slot.name) == made[slot.name].compute()
                rows.append((slot.name, "generated", "ok" if same else "mismatch", 0.0 if same else None, 0,
                             "" if same else f"differs from the values computed from {made[slot.name].origin}"))
        return rows

    def commit(self, dest: Path, layouts: Sequence[FileLayout], reader: Any, *, objects: bool) -> bool:
        return False


def _dequantized(source: Any, name: str, weight: Any, block: tuple[int, int]) -> Any:
    """The float32 values of FP8 `weight` (numpy, 2-D) times its tiles' scales, `<name>_scale_inv` in `source`
    (the names `mapper.gguf_fp8` pairs); partial edge tiles use their own scale. One float32 multiplication per
    value, as the preset de-quantises."""
    import numpy as np

    scales = _float32(source, name + "_scale_inv")
    rows, cols = weight.shape
    return weight * np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[:rows, :cols]


def _float32(catalog: Any, name: str) -> Any:
    """Source tensor `name` as a float32 numpy array: BF16 / F16 / F32 / FP8 read by numpy (ml_dtypes for bfloat16 and float8), any other
    dtype (a quantised tensor a user mapper made from, say, FP8) through torch."""
    import numpy as np

    from ..dtypes import numpy_dtype

    info = catalog[name]
    raw = catalog.read_bytes(name)
    if info.dtype in ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2"):
        return np.frombuffer(raw, dtype=numpy_dtype(info.dtype)).astype(np.float32).reshape(info.shape)
    import torch

    from ..dtypes import to_torch

    return torch.frombuffer(bytearray(raw), dtype=to_torch(info.dtype)).reshape(info.shape).to(torch.float32).numpy()


def open_written_gguf(dest: Path, layouts: Sequence[FileLayout]) -> Any:
    """A catalog of written GGUF files whose slots are where each file's own header (read by the `gguf`
    package) says its tensors are, with the planned types and shapes; CheckpointError otherwise."""
    import gguf

    from ..errors import CheckpointError

    infos = []
    for layout in layouts:
        path = dest / layout.file
        try:
            reader = gguf.GGUFReader(path)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"Cannot verify {path}: the gguf package does not read it ({exc}). Convert again.") from None
        found = {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), int(t.data_offset)) for t in reader.tensors}
        types = {name: (kind, shape) for name, kind, shape in getattr(layout, "types", ())}
        for slot in (*getattr(layout, "generated", ()), *layout.tensors):
            kind, shape = types.get(slot.name, ("", ()))
            if found.get(slot.name) != (kind, shape, slot.begin):
                raise CheckpointError(f"Cannot verify {path}: tensor {slot.name!r} is {found.get(slot.name)} in the file, planned "
                                      f"{(kind, shape, slot.begin)}. Convert again.", tensor=slot.name)
            infos.append(slot)
    return slot_catalog(dest, "gguf", infos)


__all__ = ["ALIGNMENT", "GgufFileLayout", "GgufOutput", "GgufSpec", "gguf_file_name", "layout_gguf_file"]
