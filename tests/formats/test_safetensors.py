"""The strict safetensors reader against a corpus of malformed files and against the reference package.

Every malformed file must be refused with a CheckpointError that names the file and, where there is
one, the tensor. Where the reference reader (`safetensors.safe_open`) refuses a file we refuse it too;
where it accepts one, we read the same names, dtypes, shapes, metadata and bytes.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from workbench.catalog import TensorInfo
from workbench.dtypes import DTYPE_BITS
from workbench.errors import CheckpointError
from workbench.formats import open_catalog
from workbench.formats.safetensors import MAX_HEADER_BYTES, FileReader, read_header
from workbench.iostats import IO
from workbench.output.safetensors import _DTYPE_RANK, layout_file


def raw_file(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file from a header (dict or raw JSON bytes), a data buffer and an optional fake length."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def reference_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())
    except Exception:
        return False
    return True


GOOD_X = entry("U8", [4], 0, 4)

# name -> (file bytes, text the message must contain, tensor the message must name, reference rejects it)
CORPUS: dict[str, tuple[bytes, str, str | None, bool]] = {
    "shorter than the length field": (b"\x01\x02\x03", "shorter than the 8-byte header length", None, True),
    "truncated data": (raw_file({"x": GOOD_X}, b"\0\0"), "truncated file", "x", True),
    "header length beyond the file": (raw_file({"x": GOOD_X}, b"\0" * 4, length=4096), "truncated file", None, True),
    "header length 2**63": (raw_file(b"{}", length=2**63), "above the 100000000 byte limit", None, True),
    "header length 150 MB": (raw_file(b"{}", length=150_000_000), "above the 100000000 byte limit", None, True),
    "invalid JSON": (raw_file(b'{"x": {"dtype": "U8",', b""), "not valid JSON", None, True),
    "trailing characters after JSON": (raw_file(b'{"x":' + json.dumps(GOOD_X).encode() + b"}zz", b"\0" * 4), "not valid JSON", None, True),
    "not UTF-8": (raw_file(b'{"\xff\xfe": ' + json.dumps(GOOD_X).encode() + b"}", b"\0" * 4), "not valid UTF-8", None, True),
    "byte order mark": (raw_file(b"\xef\xbb\xbf" + json.dumps({"x": GOOD_X}).encode(), b"\0" * 4), "not a JSON object", None, True),
    "header is a list": (raw_file(b"[1, 2]"), "not a JSON object", None, True),
    "header is a string": (raw_file(b'"x"'), "not a JSON object", None, True),
    "entry is not an object": (raw_file({"x": 5}), "not an object", "x", True),
    "duplicate field in an entry": (
        raw_file(b'{"x": {"dtype": "U8", "dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}', b"\0" * 4),
        "repeats the key 'dtype' inside an entry",
        None,
        True,
    ),
    "duplicate __metadata__": (
        raw_file(b'{"__metadata__": {"a": "b"}, "__metadata__": {"a": "c"}, "x": ' + json.dumps(GOOD_X).encode() + b"}", b"\0" * 4),
        "repeats the key '__metadata__'",
        None,
        True,
    ),
    # The reference reader keeps the last of two equal names; we refuse the ambiguity.
    "duplicate tensor name": (
        raw_file(b'{"x": ' + json.dumps(GOOD_X).encode() + b', "x": ' + json.dumps(GOOD_X).encode() + b"}", b"\0" * 4),
        "repeats the key 'x'",
        "x",
        False,
    ),
    "duplicate tensor name spelled with an escape": (
        raw_file(b'{"x": ' + json.dumps(GOOD_X).encode() + b', "\\u0078": ' + json.dumps(GOOD_X).encode() + b"}", b"\0" * 4),
        "repeats the key 'x'",
        "x",
        False,
    ),
    # Keys spelled with JSON escapes decode to the same key: repeated all the same.
    "dtype repeated through an escape": (
        raw_file(b'{"x": {"dtype": "U8", "dt\\u0079pe": "I8", "shape": [4], "data_offsets": [0, 4]}}', b"\0" * 4),
        "repeats the key 'dtype' inside an entry", None, True,
    ),
    "shape repeated through an escape": (
        raw_file(b'{"x": {"dtype": "U8", "shape": [4], "sh\\u0061pe": [2, 2], "data_offsets": [0, 4]}}', b"\0" * 4),
        "repeats the key 'shape' inside an entry", None, True,
    ),
    "__metadata__ repeated through an escape": (
        raw_file(b'{"__metadata__": {"a": "b"}, "\\u005f_metadata__": {"a": "c"}, "x": ' + json.dumps(GOOD_X).encode() + b"}", b"\0" * 4),
        "repeats the key '__metadata__'", None, True,
    ),
    "gap between tensors": (raw_file({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}, b"\0" * 6), "gap of 2 bytes", "b", True),
    "overlapping tensors": (raw_file({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, b"\0" * 6), "overlaps the previous tensor", "b", True),
    "first tensor not at offset 0": (raw_file({"a": entry("U8", [2], 2, 4)}, b"\0" * 4), "gap of 2 bytes", "a", True),
    "trailing bytes after the last tensor": (raw_file({"x": GOOD_X}, b"\0" * 9), "trailing or missing data", None, True),
    "byte length != numel * itemsize": (raw_file({"w": entry("F32", [2, 2], 0, 8)}, b"\0" * 8), "needs 16 bytes but data_offsets span 8", "w", True),
    "unknown dtype": (raw_file({"w": entry("F128", [1], 0, 16)}, b"\0" * 16), "unknown dtype 'F128'", "w", True),
    "dtype is not a string": (raw_file({"w": entry(["U8"], [4], 0, 4)}, b"\0" * 4), "unknown dtype", "w", True),
    "dtype in lower case": (raw_file({"w": entry("f32", [1], 0, 4)}, b"\0" * 4), "unknown dtype 'f32'", "w", True),
    "negative dimension": (raw_file({"w": entry("U8", [-4], 0, 4)}, b"\0" * 4), "non-negative integers", "w", True),
    "float dimension": (raw_file({"w": entry("U8", [4.0], 0, 4)}, b"\0" * 4), "non-negative integers", "w", True),
    "boolean dimension": (raw_file({"w": entry("U8", [True], 0, 1)}, b"\0"), "non-negative integers", "w", True),
    "shape is not a list": (raw_file({"w": entry("U8", 4, 0, 4)}, b"\0" * 4), "non-negative integers", "w", True),
    "shape missing": (raw_file({"w": {"dtype": "U8", "data_offsets": [0, 4]}}, b"\0" * 4), "non-negative integers", "w", True),
    "dimension beyond 2**64": (raw_file({"w": entry("U8", [2**64], 0, 4)}, b"\0" * 4), "overflows 64 bits", "w", True),
    # A zero dimension does not excuse an element count that overflows 64 bits (the reference refuses it too).
    "overflowing shape with a zero dimension": (raw_file({"w": entry("U8", [2**62, 2**62, 0], 0, 0)}), "overflows 64 bits", "w", True),
    "overflowing bit count": (raw_file({"w": entry("F64", [2**61], 0, 0)}), "overflows 64 bits", "w", True),
    # The reference multiplies in order, so a leading 0 hides the overflow from it; no real tensor has this shape.
    "zero dimension before an overflowing count": (raw_file({"w": entry("U8", [0, 2**62, 2**62], 0, 0)}), "overflows 64 bits", "w", False),
    "dimension of 5000 digits": (
        raw_file(b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'),
        "integer of more than 4300 digits", None, True,
    ),
    "dimension of 4000 digits and a zero": (
        raw_file(b'{"w": {"dtype": "U8", "shape": [' + b"9" * 4000 + b', 0], "data_offsets": [0, 0]}}'),
        "overflows 64 bits", "w", True,
    ),
    "offset of 5000 digits": (
        raw_file(b'{"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, ' + b"9" * 5000 + b"]}}"),
        "integer of more than 4300 digits", None, True,
    ),
    "offsets of 4000 digits": (
        raw_file(b'{"w": {"dtype": "U8", "shape": [0], "data_offsets": [' + b"9" * 4000 + b", " + b"9" * 4000 + b"]}}"),
        "data_offsets must be", "w", True,
    ),
    "offsets reversed": (raw_file({"w": entry("U8", [0], 4, 0)}, b"\0" * 4), "data_offsets must be", "w", True),
    "three offsets": (raw_file({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4, 8]}}, b"\0" * 4), "data_offsets must be", "w", True),
    "negative offset": (raw_file({"w": entry("U8", [4], -4, 0)}, b"\0" * 4), "data_offsets must be", "w", True),
    "metadata value is a number": (raw_file({"__metadata__": {"a": 1}, "x": GOOD_X}, b"\0" * 4), "__metadata__ must be", None, True),
    "metadata is a list": (raw_file({"__metadata__": ["a"], "x": GOOD_X}, b"\0" * 4), "__metadata__ must be", None, True),
    "metadata nested object": (raw_file({"__metadata__": {"a": {"b": "c"}}, "x": GOOD_X}, b"\0" * 4), "__metadata__ must be", None, True),
    "F4 with an odd element count": (raw_file({"q": entry("F4", [3], 0, 2)}, b"\0" * 2), "do not fill whole bytes", "q", True),
    "F6 with a partial byte": (raw_file({"q": entry("F6_E2M3", [2], 0, 2)}, b"\0" * 2), "do not fill whole bytes", "q", True),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_malformed_file_is_refused_with_a_clear_message(tmp_path: Path, case: str) -> None:
    blob, expected, tensor, reference_rejects = CORPUS[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError) as caught:
        read_header(path)
    message = str(caught.value)
    assert str(path) in message
    assert expected in message
    assert caught.value.file == str(path)
    assert caught.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in message
    assert message.startswith("Cannot ") and message.rstrip().endswith(".")
    # Whatever opens the file (open_catalog, the folder reader) refuses it the same way.
    with pytest.raises(CheckpointError):
        open_catalog(path)
    assert reference_accepts(path) is not reference_rejects


def test_absurd_header_length_is_refused_before_reading_the_header(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(raw_file(b"{}", length=MAX_HEADER_BYTES + 1) + b" " * 64)
    IO.reset()
    with pytest.raises(CheckpointError):
        read_header(path)
    assert IO.snapshot()["bytes_read"] == 8


def test_leading_whitespace_and_padding_are_accepted_like_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "ws.safetensors"
    path.write_bytes(raw_file(b'  {"x": ' + json.dumps(GOOD_X).encode() + b"}    ", b"\1\2\3\4"))
    assert reference_accepts(path)
    header = read_header(path)
    assert [(t.name, t.dtype, t.shape) for t in header.tensors] == [("x", "U8", (4,))]
    assert FileReader(path).read_bytes(header.tensors[0]) == b"\1\2\3\4"


def test_dtype_codes_match_the_installed_safetensors(tmp_path: Path) -> None:
    """The reference reader lists every dtype it knows when it meets an unknown one: we know the same set."""
    path = tmp_path / "unknown.safetensors"
    path.write_bytes(raw_file({"x": entry("NOT_A_DTYPE", [1], 0, 1)}, b"\0"))
    with pytest.raises(Exception) as caught:
        safe_open(str(path), framework="pt")
    listed = re.search(r"expected one of (.*?)(?: at line|$)", str(caught.value))
    assert listed, str(caught.value)
    upstream = re.findall(r"`([A-Z0-9_]+)`", listed.group(1))
    assert len(upstream) >= 15
    assert set(upstream) == set(DTYPE_BITS)
    # The writer orders tensors by this list (the reference's enum order) to be byte-identical.
    assert upstream == _DTYPE_RANK


# ------------------------------------------------------------------------ round trip with the reference

# dtypes torch cannot hold shape-for-shape: written with hand-built headers instead of save_file.
_HAND_BUILT = {"F4", "F6_E2M3", "F6_E3M2"}
_NAME = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12).filter(lambda n: n != "__metadata__")


@st.composite
def tensor_specs(draw: st.DrawFn) -> tuple[str, tuple[int, ...], bytes]:
    dtype = draw(st.sampled_from(sorted(DTYPE_BITS)))
    bits = DTYPE_BITS[dtype]
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    numel = 1
    for d in shape:
        numel *= d
    if (numel * bits) % 8:  # sub-byte dtypes: pad the last dimension to whole bytes
        per_byte = 8 // __import__("math").gcd(8, bits)
        shape = (*shape[:-1], per_byte) if shape else (per_byte,)
        numel = 1
        for d in shape:
            numel *= d
    nbytes = numel * bits // 8
    if dtype == "BOOL":
        data = bytes(draw(st.lists(st.integers(0, 1), min_size=nbytes, max_size=nbytes)))
    else:
        data = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return dtype, shape, data


def _torch_tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    from workbench.dtypes import to_torch

    target = to_torch(dtype)
    if not data:
        return torch.empty(shape, dtype=target)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(target).reshape(shape)


def _write(path: Path, specs: dict[str, tuple[str, tuple[int, ...], bytes]], metadata: dict[str, str] | None) -> None:
    if any(dtype in _HAND_BUILT for dtype, _, _ in specs.values()):
        infos = [TensorInfo(n, d, s) for n, (d, s, _) in specs.items()]
        layout = layout_file(path.name, infos, metadata or {})
        buffer = bytearray(layout.size)
        buffer[: len(layout.header)] = layout.header
        for t in layout.tensors:
            buffer[t.begin : t.end] = specs[t.name][2]
        path.write_bytes(bytes(buffer))
    else:
        save_file({n: _torch_tensor(*spec) for n, spec in specs.items()}, str(path), metadata=metadata)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    specs=st.dictionaries(_NAME, tensor_specs(), min_size=0, max_size=4),
    metadata=st.none() | st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
)
def test_reference_files_are_read_identically(tmp_path: Path, specs: dict, metadata: dict | None) -> None:
    path = tmp_path / "roundtrip.safetensors"
    _write(path, specs, metadata)
    if not reference_accepts(path):
        # save_file({}, metadata={}) writes '{},"__metadata__":{}}' (safetensors 0.8): refused by both.
        with pytest.raises(CheckpointError):
            read_header(path)
        return
    header = read_header(path)
    ours = {t.name: t for t in header.tensors}
    reader = FileReader(path)
    with safe_open(str(path), framework="pt") as ref:
        assert sorted(ref.keys()) == sorted(ours) == sorted(specs)
        assert header.metadata == (ref.metadata() or {}) == (metadata or {})
        for name, (dtype, shape, data) in specs.items():
            info = ours[name]
            assert (info.dtype, info.shape, info.nbytes) == (dtype, shape, len(data))
            ref_slice = ref.get_slice(name)
            assert ref_slice.get_dtype() == dtype
            assert tuple(ref_slice.get_shape()) == shape
            assert reader.read_bytes(info) == data
            if dtype not in _HAND_BUILT and data:
                try:
                    loaded = ref.get_tensor(name)
                except Exception:  # dtypes the reference's torch glue cannot load (e.g. F8_E8M0)
                    continue
                assert loaded.reshape(-1).view(torch.uint8).numpy().tobytes() == data
    reader.close()
    assert header.file_size == path.stat().st_size


def test_torch_packed_f4_is_counted_in_four_bit_elements(tmp_path: Path) -> None:
    """torch stores two F4 values per element; the file (and our catalog) counts single values."""
    packed = torch.arange(6, dtype=torch.uint8).reshape(2, 3).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "f4.safetensors"
    save_file({"q": packed}, str(path))
    (info,) = read_header(path).tensors
    assert (info.dtype, info.shape, info.nbytes) == ("F4", (2, 6), 6)
