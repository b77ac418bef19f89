"""The streaming safetensors writer: reference-compatible bytes, any write order, nothing half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from workbench.catalog import TensorInfo
from workbench.errors import PlanError
from workbench.formats.safetensors import read_header
from workbench.output.safetensors import (
    PAGE,
    PARTIAL_SUFFIX,
    WRITE_CALL_MAX,
    SafetensorsWriter,
    layout_file,
    save_tensors,
    shard_file_name,
    write_index,
)


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.weight": torch.randn(8, 4, generator=gen).bfloat16(),
        "model.layers.0.bias": torch.randn(8, generator=gen),
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.randn(5, generator=gen).to(torch.float8_e4m3fn),
        "ids": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "gewicht.größe": torch.ones(2, dtype=torch.float16),  # non-ASCII names are stored as raw UTF-8
        "packed_f4": torch.arange(4, dtype=torch.uint8).reshape(2, 2).view(torch.float4_e2m1fn_x2),
    }


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def assert_same_tensors(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert got.reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist(), name


def test_output_is_byte_identical_to_the_reference_writer(tmp_path: Path) -> None:
    tensors = sample_tensors()
    ours = save_tensors(tmp_path / "ours.safetensors", tensors)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert ours.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_output_loads_with_load_file_and_safe_open(tmp_path: Path) -> None:
    tensors = {k: v for k, v in sample_tensors().items() if k != "packed_f4"}  # the reference cannot load F4 back
    path = save_tensors(tmp_path / "model.safetensors", tensors)
    assert_same_tensors(load_file(str(path)), tensors)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert_same_tensors({k: f.get_tensor(k) for k in list(f.keys())}, tensors)
    assert leftovers(tmp_path) == ["model.safetensors"]


def _layout_and_data() -> tuple[object, dict[str, bytes]]:
    infos = [TensorInfo("a", "F32", (4, 4)), TensorInfo("b", "BF16", (3,)), TensorInfo("c", "U8", (5,))]
    data = {"a": bytes(range(64)), "b": b"\x01\x02\x03\x04\x05\x06", "c": b"hello"}
    return layout_file("out.safetensors", infos), data


def _read_back(path: Path) -> dict[str, bytes]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).reshape(-1).view(torch.uint8).numpy().tobytes() for k in list(f.keys())}


def test_writes_in_any_order_and_in_pieces(tmp_path: Path) -> None:
    layout, data = _layout_and_data()
    with SafetensorsWriter(tmp_path, layout) as writer:
        writer.write("c", data["c"])
        for at in (48, 16, 0, 32):  # out of order, 16-byte pieces
            writer.write("a", data["a"][at : at + 16], at=at)
        writer.write("b", memoryview(data["b"])[2:], at=2)
        writer.write("b", data["b"][:2])
        assert writer.missing() == {}
        path = writer.commit()
    assert _read_back(path) == data
    assert leftovers(tmp_path) == ["out.safetensors"]


def test_a_write_larger_than_one_system_call_lands_whole(tmp_path: Path) -> None:
    # The writer splits writes into calls of WRITE_CALL_MAX bytes (small page-cache folios): a tensor of
    # 2.5 calls plus an odd tail, written from a non-zero offset, must still come out byte for byte as safetensors'.
    tensor = torch.arange(WRITE_CALL_MAX * 5 // 4 + 3, dtype=torch.int16)
    tensors = {"big": tensor, "small": torch.ones(3)}
    ours = save_tensors(tmp_path / "ours.safetensors", tensors)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert ours.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    layout = layout_file("pieces.safetensors", [TensorInfo("big", "I16", tuple(tensor.shape))])
    raw = tensor.numpy().tobytes()
    with SafetensorsWriter(tmp_path, layout) as writer:
        writer.write("big", raw[1:], at=1)
        writer.write("big", raw[:1])
        path = writer.commit()
    assert load_file(str(path))["big"].equal(tensor)


@pytest.mark.parametrize("congruent", [True, False])
def test_copy_span_moves_bytes_whether_or_not_pages_line_up(tmp_path: Path, congruent: bool) -> None:
    # Page-congruent runs are kernel copies; the others go through the writer's buffer, WRITE_CALL_MAX bytes a call.
    tensors = {"a": torch.arange(WRITE_CALL_MAX + 5, dtype=torch.int16), "b": torch.arange(WRITE_CALL_MAX // 3, dtype=torch.int32)}
    layout = layout_file("out.safetensors", [TensorInfo(n, "I16" if n == "a" else "I32", tuple(t.shape)) for n, t in tensors.items()])
    slots = sorted(layout.by_name().values(), key=lambda info: info.begin)  # the file's order (safetensors sorts)
    data = b"".join(tensors[info.name].numpy().tobytes() for info in slots)
    begin = slots[0].begin
    skip = begin % PAGE if congruent else begin % PAGE + 3
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * skip + data + b"tail")
    fd = os.open(source, os.O_RDONLY)
    try:
        with SafetensorsWriter(tmp_path, layout) as writer:
            writer.copy_span(fd, skip, begin, [(info.name, 0, info.nbytes) for info in slots])
            path = writer.commit()
    finally:
        os.close(fd)
    assert (skip - begin) % PAGE == 0 if congruent else (skip - begin) % PAGE
    loaded = load_file(str(path))
    assert all(loaded[n].equal(t) for n, t in tensors.items())
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert path.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_gather_span_assembles_scattered_source_runs_in_one_write(tmp_path: Path, monkeypatch) -> None:
    # The output's tensors come from runs of the source in another order; runs adjacent in the source are
    # read by one scattering preadv (short reads continued), the window is written once.
    from workbench.output import safetensors as writer_module

    tensors = {n: torch.arange(k * 7, k * 7 + 5 + k, dtype=torch.float32) for k, n in enumerate(["a", "b", "c", "d"])}
    layout = layout_file("out.safetensors", [TensorInfo(n, "F32", tuple(t.shape)) for n, t in tensors.items()])
    slots = sorted(layout.by_name().values(), key=lambda info: info.begin)
    raw = {n: t.numpy().tobytes() for n, t in tensors.items()}
    # c+d and a+b are adjacent in the source, a gap between: two scattering reads (each continued when short)
    source = tmp_path / "source.bin"
    source.write_bytes(b"head" + raw["c"] + raw["d"] + b"gap" + raw["a"] + raw["b"])
    where = {"c": 4, "d": 4 + len(raw["c"])}
    where["a"] = where["d"] + len(raw["d"]) + 3
    where["b"] = where["a"] + len(raw["a"])
    calls = []
    real = os.preadv

    def short_preadv(fd, views, at):  # at most 9 bytes a call: the loop must continue short reads
        calls.append(len(views))
        return real(fd, [views[0][:9]], at)

    fd = os.open(source, os.O_RDONLY)
    try:
        with SafetensorsWriter(tmp_path, layout) as writer:
            reads, at = [], 0
            for info in slots:
                reads.append((fd, where[info.name], at, info.nbytes))
                at += info.nbytes
            with pytest.raises(PlanError, match="do not add up"):
                writer.gather_span(slots[0].begin, reads[:-1], [(i.name, 0, i.nbytes) for i in slots])
            monkeypatch.setattr(writer_module.os, "preadv", short_preadv)
            writer.gather_span(slots[0].begin, reads, [(i.name, 0, i.nbytes) for i in slots])
            path = writer.commit()
    finally:
        os.close(fd)
    assert calls[0] == 2 and len(calls) > 4  # the first call asks for two tensors at once; short reads go on
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert path.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_copy_from_moves_bytes_from_a_source_file(tmp_path: Path) -> None:
    layout, data = _layout_and_data()
    source = tmp_path / "source.bin"
    source.write_bytes(b"junk" + data["a"] + data["c"] + b"tail")
    fd = os.open(source, os.O_RDONLY)
    try:
        with SafetensorsWriter(tmp_path, layout) as writer:
            writer.copy_from("a", fd, 4, 40)
            writer.copy_from("a", fd, 44, 24, at=40)
            writer.copy_from("c", fd, 68, 5)
            writer.write("b", data["b"])
            path = writer.commit()
    finally:
        os.close(fd)
    assert _read_back(path) == data


def test_copy_from_without_copy_file_range_reads_and_writes_and_names_a_short_source(tmp_path: Path, monkeypatch) -> None:
    # Filesystems without copy_file_range: the same bytes through the writer's buffer; a source that ends early
    # is refused naming the tensor.
    def unsupported(*args):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    layout, data = _layout_and_data()
    source = tmp_path / "source.bin"
    source.write_bytes(b"junk" + data["a"] + data["c"])
    fd = os.open(source, os.O_RDONLY)
    try:
        with SafetensorsWriter(tmp_path, layout) as writer:
            writer.copy_from("a", fd, 4, 64)
            writer.copy_from("c", fd, 68, 5)
            writer.write("b", data["b"])
            path = writer.commit()
        assert _read_back(path) == data
        (tmp_path / "short").mkdir()
        with SafetensorsWriter(tmp_path / "short", layout) as writer, pytest.raises(PlanError, match="tensor 'c'.*ended early"):
            writer.copy_from("c", fd, 70, 5)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "wrong",
    [torch.zeros(8, 4, dtype=torch.float32), torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(33, dtype=torch.bfloat16)],
    ids=["dtype", "shape", "length"],
)
def test_declared_vs_real_mismatch_is_refused_and_nothing_is_left(tmp_path: Path, wrong: torch.Tensor) -> None:
    layout = layout_file("model.safetensors", [TensorInfo("w", "BF16", (8, 4))])
    with pytest.raises(PlanError) as caught, SafetensorsWriter(tmp_path, layout) as writer:
        writer.write_tensor("w", wrong)
    assert "'w'" in str(caught.value) and "model.safetensors" in str(caught.value)
    assert leftovers(tmp_path) == []


def test_raw_write_beyond_the_declared_length_is_refused(tmp_path: Path) -> None:
    layout = layout_file("model.safetensors", [TensorInfo("w", "F32", (2,))])
    with pytest.raises(PlanError, match="overflow its declared 8 bytes"), SafetensorsWriter(tmp_path, layout) as writer:
        writer.write("w", b"\0" * 4, at=6)
    assert leftovers(tmp_path) == []
    with pytest.raises(PlanError, match="not in the planned layout"), SafetensorsWriter(tmp_path, layout) as writer:
        writer.write("other", b"\0")
    assert leftovers(tmp_path) == []


def test_commit_with_missing_bytes_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    layout, data = _layout_and_data()
    writer = SafetensorsWriter(tmp_path, layout)
    writer.write("a", data["a"])
    writer.write("b", data["b"][:4])
    assert (tmp_path / ("out.safetensors" + PARTIAL_SUFFIX)).exists()
    with pytest.raises(PlanError) as caught:
        writer.commit()
    message = str(caught.value)
    assert "2 tensors were not completely written" in message and "Nothing was kept" in message
    assert leftovers(tmp_path) == []


def test_layout_refuses_what_safetensors_cannot_store() -> None:
    with pytest.raises(PlanError, match="appears twice"):
        layout_file("x.safetensors", [TensorInfo("a", "F32", (1,)), TensorInfo("a", "F32", (2,))])
    with pytest.raises(PlanError, match="reserved"):
        layout_file("x.safetensors", [TensorInfo("__metadata__", "F32", (1,))])
    with pytest.raises(PlanError, match="do not fill whole bytes"):
        layout_file("x.safetensors", [TensorInfo("q", "F4", (3,))])
    with pytest.raises(PlanError, match="unknown dtype"):
        layout_file("x.safetensors", [TensorInfo("q", "F128", (3,))])
    with pytest.raises(PlanError, match="not valid Unicode"):
        layout_file("x.safetensors", [TensorInfo("bad\ud800", "F32", (1,))])


def test_layout_header_is_aligned_and_read_back_exactly(tmp_path: Path) -> None:
    infos = [TensorInfo("small", "U8", (3,)), TensorInfo("big", "F64", (2,)), TensorInfo("mid", "F16", (5,))]
    layout = layout_file("m.safetensors", infos)
    assert len(layout.header) % 8 == 0
    assert [t.name for t in layout.tensors] == ["big", "mid", "small"]  # wide dtypes first, like the reference
    assert all(t.begin % 8 == 0 for t in layout.tensors[:1])
    given = layout_file("m.safetensors", infos, order="given")
    assert [t.name for t in given.tensors] == ["small", "big", "mid"]
    path = tmp_path / "m.safetensors"
    path.write_bytes(layout.header + bytes(layout.size - len(layout.header)))
    header = read_header(path)
    assert [(t.name, t.begin, t.end) for t in header.tensors] == [(t.name, t.begin, t.end) for t in layout.tensors]


def test_write_index_sorts_keys_and_records_total_size(tmp_path: Path) -> None:
    weight_map = {"z.weight": shard_file_name(2, 2), "a.weight": shard_file_name(1, 2), "m.bias": shard_file_name(1, 2)}
    path = write_index(tmp_path, weight_map, 1234, metadata={"total_parameters": 617})
    index = json.loads(path.read_text())
    assert list(index["weight_map"]) == ["a.weight", "m.bias", "z.weight"]
    assert index["weight_map"]["z.weight"] == "model-00002-of-00002.safetensors"
    assert index["metadata"] == {"total_size": 1234, "total_parameters": 617}
    assert leftovers(tmp_path) == ["model.safetensors.index.json"]
    assert shard_file_name(1, 1) == "model.safetensors"
