"""Hand-made hostile checkpoints, one builder per case, each with the outcome the readers must produce.

A builder writes its case into an empty folder and returns the path to open. Pickle cases embed a
payload that would create `marker` if anything ran it; the test asserts it never appears. Cases that
the format tests already cover (see `COVERED_ELSEWHERE`) are not repeated here.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from . import gguf_files as G
from .seeds import INDEX_NAME, TRAINING, _hf_index_seed, _safetensors_seed

MAX_HEADER = 100_000_000  # workbench.formats.safetensors.MAX_HEADER_BYTES (the reference reader's limit)

# Hostile inputs the per-format test modules already check (kept here so the corpus table is complete).
COVERED_ELSEWHERE = {
    "torch: __reduce__ calling os.system and open()": "formats/test_torch_zip.py::test_malicious_pickle_is_listed_never_executed",
    "DCP .metadata naming os.system": "formats/test_dcp.py::test_metadata_with_foreign_globals_is_refused_never_run",
    "atorch flat_meta naming print": "formats/test_atorch.py::test_damaged_checkpoints_raise_checkpoint_error",
    "HF index paths ../, absolute, C:\\, sub/../..": "formats/test_shard_index.py::test_index_paths_that_escape_the_folder_are_refused",
    "HF index shard symlinked outside": "formats/test_shard_index.py::test_symlink_leading_out_of_the_folder_is_refused",
    "safetensors header length 2**63 / 150 MB, duplicate keys, 2**64 dims, overflowing offsets":
        "formats/test_safetensors.py::test_malformed_file_is_refused_with_a_clear_message",
    "safetensors header length above 100 MB read no further than 8 bytes":
        "formats/test_safetensors.py::test_absurd_header_length_is_refused_before_reading_the_header",
    "legacy (pre-1.6) torch pickle": "formats/test_torch_zip.py::test_legacy_format_is_refused_clearly",
    "symlinked writes: lock, partials, sidecar, manifest, index, DCP files, extras planted as symlink / FIFO / folder":
        "core/test_files.py::test_a_planted_entry_is_never_written_through",
    "checksums.sha256.json.partial -> a file outside, then verify --checksums":
        "core/test_files.py::test_verify_checksums_with_a_symlinked_partial_records_a_real_sidecar",
    "safetensors shape [2**62, 2**62, 0], 5000-digit dims and offsets, dtype/shape/__metadata__ repeated through escapes":
        "formats/test_safetensors.py::test_malformed_file_is_refused_with_a_clear_message",
    "state set on an allowed builder does not reach the next file": "formats/test_torch_zip.py::test_state_a_pickle_sets_on_a_builder_never_reaches_the_next_file",
    "tensor names with terminal escapes (ESC [2J, BEL, CR, C1 CSI, bidi override) printed by the CLI":
        "cli/test_refusals.py::test_inspect_escapes_names_from_the_file",
    "an extra file named with 250 characters (its `.partial` name is too long)":
        "cli/test_refusals.py::test_an_extra_with_a_name_at_the_limit_is_copied",
    "weights of other formats beside the source (pytorch_model.bin, tf_model.h5, model.gguf, torch.save under a plain name)":
        "planning/test_extras.py::test_weight_files_of_other_formats_are_skipped_with_the_reason",
    "a Function named '__main__:fn' (a notebook cell) on 2 local ranks":
        "mapper/test_function.py::test_a_main_program_function_on_two_local_ranks_is_refused_at_plan_time",
    "FP8 quantisation with a block that does not divide a shape":
        "mapper/test_quantized_blocks.py::test_partial_fp8_tiles_are_a_plan_warning_naming_the_tensors",
    "Megatron args with vocab_size None (padded vocabulary kept)":
        "mapper/test_megatron.py::test_unknown_true_vocabulary_is_a_plan_warning",
    "MiniMax-shaped checkpoint offered fused_to_hf": "mapper/test_suggest.py::test_minimax_is_not_offered_fused_to_hf",
}


@dataclass(frozen=True)
class Case:
    """One hostile input: how to build it and what the readers must do with it.

    `expect` is 'refused' (a CheckpointError whose message contains `says`, on open or on reading a
    tensor) or 'listed' (opens; `check(catalog)` holds). `marker` is set for cases with a payload.
    """

    name: str
    build: Callable[[Path, Path], Path]  # (folder, marker) -> path to open
    expect: str
    says: str = ""
    check: Callable[[object], None] | None = field(default=None, repr=False)


# ----------------------------------------------------------------------------------------- pickle payloads


class RunsCommand:
    """Pickles as `os.system('touch marker')`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def exec_pickle(marker: Path) -> bytes:
    """A hand-written pickle calling builtins.exec on code that creates `marker` (no class needed to make it)."""
    code = f"open({str(marker)!r}, 'w').write('pwned')"
    return b"\x80\x02cbuiltins\nexec\nX" + struct.pack("<I", len(code)) + code.encode() + b"\x85R."


class _StorageProxy:
    pass


def torch_zip(path: Path, pickle_bytes: bytes, storages: dict[str, bytes] | None = None, *, deflate: bool = False) -> Path:
    """A torch.save-shaped zip around arbitrary pickle bytes (archive/data.pkl + archive/data/<key>)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", "little")
        for key, blob in (storages or {}).items():
            archive.writestr(zipfile.ZipInfo(f"archive/data/{key}"), blob, compress_type=zipfile.ZIP_STORED)
        archive.writestr("archive/version", "3\n")
    return path


def tensor_pickle(tensors: dict[str, tuple[int, tuple, tuple]], storage_numel: int) -> bytes:
    """A state-dict pickle of views (offset, size, stride) over one float32 storage '0', as torch writes it."""
    import torch

    class View:
        def __init__(self, offset, size, stride):
            self.args = (offset, size, stride)

        def __reduce__(self):
            offset, size, stride = self.args
            return (torch._utils._rebuild_tensor_v2, (_StorageProxy(), offset, size, stride, False, OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _StorageProxy):
                return ("storage", torch.FloatStorage, "0", "cpu", storage_numel)
            return None

    import io

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(OrderedDict((k, View(*v)) for k, v in tensors.items()))
    return buffer.getvalue()


# ----------------------------------------------------------------------------------------- builders


def _torch_evil(folder: Path, marker: Path) -> Path:
    import torch

    torch.save({"w": torch.ones(3), "config": {"hook": RunsCommand(marker)}}, folder / "evil.pt")
    return folder / "evil.pt"


def _torch_exec(folder: Path, marker: Path) -> Path:
    return torch_zip(folder / "exec.pt", exec_pickle(marker))


def _dcp(folder: Path, state: dict | None = None) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save(state or {"w": torch.arange(4.0), "b": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _rewrite_dcp_metadata(folder: Path, edit: Callable[[object], None]) -> None:
    with open(folder / ".metadata", "rb") as fh:
        meta = pickle.load(fh)  # our own, just written by torch: trusted
    edit(meta)
    with open(folder / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)


def _dcp_metadata_exec(folder: Path, marker: Path) -> Path:
    _dcp(folder)
    (folder / ".metadata").write_bytes(exec_pickle(marker))
    return folder


def _dcp_chunk_payload(folder: Path, marker: Path) -> Path:
    """The chunk stream that should hold tensor 'w' is a torch.save of a payload instead."""
    import io

    import torch

    _dcp(folder)
    buffer = io.BytesIO()
    torch.save(RunsCommand(marker), buffer)
    payload = buffer.getvalue()
    data = folder / "__0_0.distcp"
    start = data.stat().st_size
    with open(data, "ab") as fh:
        fh.write(payload)

    def point_w_at_payload(meta):
        for index, info in meta.storage_data.items():
            if index.fqn == "w":
                info.offset, info.length = start, len(payload)

    _rewrite_dcp_metadata(folder, point_w_at_payload)
    return folder


def _dcp_chunk_big_pickle(folder: Path, marker: Path) -> Path:
    """The chunk stream of tensor 'w' is a torch.save whose data.pkl is 2 MB (a tensor's is a few hundred bytes)."""
    import io

    import torch

    _dcp(folder)
    buffer = io.BytesIO()
    torch.save({"pad": b"\0" * (2 << 20)}, buffer)
    data = folder / "__0_0.distcp"
    start = data.stat().st_size
    with open(data, "ab") as fh:
        fh.write(buffer.getvalue())

    def point_w_at_it(meta):
        for index, info in meta.storage_data.items():
            if index.fqn == "w":
                info.offset, info.length = start, len(buffer.getvalue())

    _rewrite_dcp_metadata(folder, point_w_at_it)
    return folder


def _dcp_path(where: str) -> Callable[[Path, Path], Path]:
    def build(folder: Path, marker: Path) -> Path:
        _dcp(folder)
        (folder.parent / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())

        def redirect(meta):
            for info in meta.storage_data.values():
                info.relative_path = where

        _rewrite_dcp_metadata(folder, redirect)
        return folder

    return build


def _dcp_symlinked_data(folder: Path, marker: Path) -> Path:
    _dcp(folder)
    os.replace(folder / "__0_0.distcp", folder.parent / "outside.distcp")
    os.symlink(folder.parent / "outside.distcp", folder / "__0_0.distcp")
    return folder


def _dcp_huge_shape(folder: Path, marker: Path) -> Path:
    """Metadata claims w is 2**40 elements in one chunk whose stored stream is a few hundred bytes."""
    _dcp(folder)

    def inflate(meta):
        entry = meta.state_dict_metadata["w"]
        entry.size = type(entry.size)([2**40])
        entry.chunks[0].sizes = type(entry.chunks[0].sizes)([2**40])

    _rewrite_dcp_metadata(folder, inflate)
    return folder


def _dcp_size(shape: list) -> Callable[[Path, Path], Path]:
    """Metadata gives w (and its one chunk) a shape with a 0 whose other dimensions overflow 64 bits."""

    def build(folder: Path, marker: Path) -> Path:
        _dcp(folder)

        def resize(meta):
            entry = meta.state_dict_metadata["w"]
            zeros = (0,) * len(shape)  # plain tuples: torch.Size refuses integers beyond 64 bits
            entry.size = tuple(shape)
            entry.chunks[0] = type(entry.chunks[0])(offsets=zeros, sizes=tuple(shape))
            for index in list(meta.storage_data):
                if index.fqn == "w":
                    meta.storage_data[type(index)("w", zeros, index.index)] = meta.storage_data.pop(index)

        _rewrite_dcp_metadata(folder, resize)
        return folder

    return build


def _dcp_counted_bomb(folder: Path, marker: Path) -> Path:
    _dcp(folder)
    (folder / ".metadata").write_bytes(b"\x80\x04\x8d" + struct.pack("<Q", 2**40) + b"abc.")  # BINUNICODE8 of 1 TiB
    return folder


def _memo_bomb(folder: Path, marker: Path) -> Path:
    # ']' (an empty list) then LONG_BINPUT 2**31: CPython's unpickler would zero-fill a 32 GiB memo table.
    return torch_zip(folder / "memo.pt", b"\x80\x02]r" + struct.pack("<I", 2**31) + b".")


def _padded_after_stop(folder: Path, marker: Path) -> Path:
    return torch_zip(folder / "padded.pt", pickle.dumps({"epoch": 1}, protocol=2) + b"\0" * 4096)


def _memo_beyond_entries(folder: Path, marker: Path) -> Path:
    """A 1 MB bytes object, then memo slot 900,000: inside the pickle's bytes, far beyond its one memo entry."""
    return torch_zip(folder / "memo.pt", b"\x80\x02B" + struct.pack("<I", 1 << 20) + b"\0" * (1 << 20) + b"r" + struct.pack("<I", 900_000) + b".")


def _deflated_memo_bomb(folder: Path, marker: Path) -> Path:
    """The reported bomb, small: memo slot near the 20 MB an entry inflates to, paid for by bytes after STOP.

    The padding deflates about 57:1 (under the 64:1 bomb limit), so a ~350 KB file holds a 20 MB data.pkl
    whose memo table would take 16 bytes per byte of it.
    """
    size = 20_000_000
    rng = np.random.default_rng(12)
    padding = (rng.random(size) < 0.008).astype(np.uint8).tobytes()
    body = b"\x80\x02]r" + struct.pack("<I", size - 100) + b"." + padding
    path = torch_zip(folder / "bomb.pt", body, deflate=True)
    assert 40 * path.stat().st_size < len(body) < 64 * path.stat().st_size
    return path


def _object_bomb(unit: bytes, filler: bytes, count: int, *, head: bytes = b"", ratio: tuple[int, int] = (15, 60)) -> Callable[[Path, Path], Path]:
    """A deflated data.pkl that builds `count` objects from a few bytes each, no memo: `EMPTY_LIST, MARK, <head>,
    unit x count (a few units swapped for `filler`, so that it deflates about 23:1, under the 64:1 bomb limit),
    APPENDS, STOP`. Unbounded, the 175 KB file of empty sets took 1.7 GB."""

    def build(folder: Path, marker: Path) -> Path:
        rng = np.random.default_rng(29)
        units = np.frombuffer(unit * count, dtype=np.uint8).reshape(count, len(unit)).copy()
        swap = rng.random(count) < 0.04
        units[swap] = np.frombuffer(filler, dtype=np.uint8)
        body = b"\x80\x02](" + head + units.tobytes() + b"e."
        path = torch_zip(folder / "bomb.pt", body, deflate=True)
        low, high = ratio
        assert low * path.stat().st_size < len(body) < high * path.stat().st_size, len(body) / path.stat().st_size
        return path

    return build


def _set_attributes_on(qualified: str, state: bytes) -> Callable[[Path, Path], Path]:
    """BUILD on a global the reader provides: `state` is the pickled state (a dict, or (None, slots))."""
    module, _, name = qualified.rpartition(".")

    def build(folder: Path, marker: Path) -> Path:
        return torch_zip(folder / "attrs.pt", b"\x80\x02c" + f"{module}\n{name}\n".encode() + state + b"b.")

    return build


SLOT_DEFAULTS = b"N}X\x0c\x00\x00\x00__defaults__\x88\x85s\x86"  # (None, {'__defaults__': (True,)})
DICT_QUALNAME = b"}X\x0c\x00\x00\x00__qualname__X\x04\x00\x00\x00evils"  # {'__qualname__': 'evil'}


def _huge_version(folder: Path, marker: Path) -> Path:
    """A Lightning checkpoint whose version is an integer of 3000 bytes (7000+ digits: str() refuses it)."""
    return torch_zip(folder / "epoch.ckpt", pickle.dumps({"pytorch-lightning_version": 1 << 24_000, "state_dict": {}}, protocol=2))


def _long_text_integer(folder: Path, marker: Path) -> Path:
    return torch_zip(folder / "digits.pt", b"(L" + b"7" * 5000 + b"L\nl.")


def _hf_index_huge_integer(folder: Path, marker: Path) -> Path:
    _hf_index_seed(folder)
    text = (folder / INDEX_NAME).read_text()
    (folder / INDEX_NAME).write_text(text.replace('"total_size": 30', '"total_size": ' + "9" * 5000))
    return folder


def _hf_escaped_duplicate(folder: Path, marker: Path) -> Path:
    _hf_index_seed(folder)
    text = (folder / INDEX_NAME).read_text()
    (folder / INDEX_NAME).write_text(text.replace('"a.bias": ', '"b.weigh\\u0074": "model-00001-of-00002.safetensors", "a.bias": '))
    return folder


def _hf_shard_not_regular(kind: str) -> Callable[[Path, Path], Path]:
    def build(folder: Path, marker: Path) -> Path:
        _hf_index_seed(folder)
        shard = folder / "model-00002-of-00002.safetensors"
        shard.unlink()
        os.mkfifo(shard) if kind == "fifo" else shard.mkdir()
        return folder

    return build


def _dcp_data_fifo(folder: Path, marker: Path) -> Path:
    _dcp(folder)
    (folder / "__0_0.distcp").unlink()
    os.mkfifo(folder / "__0_0.distcp")
    return folder


def _atorch_rank_file_fifo(folder: Path, marker: Path) -> Path:
    _atorch(folder)
    (folder / "flat_param.00001-00002").unlink()
    os.mkfifo(folder / "flat_param.00001-00002")
    return folder


def _sparse(path: Path, size: int) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)  # a sparse file: its size is what the reader sees first


def _dcp_metadata_257mb(folder: Path, marker: Path) -> Path:
    _dcp(folder)
    _sparse(folder / ".metadata", 257 << 20)
    return folder


def _atorch_meta_65mb(folder: Path, marker: Path) -> Path:
    _atorch(folder)
    _sparse(folder / "ckpt_meta", 65 << 20)
    return folder


def _lightning_meta_65mb(folder: Path, marker: Path) -> Path:
    import torch

    _dcp(folder, {"model.w": torch.ones(2)})
    body = pickle.dumps({"epoch": 3, "pad": b"\0" * (65 << 20)}, protocol=2)
    torch_zip(folder / "meta.pt", body, deflate=True)
    return folder


def _deflate_bomb(folder: Path, marker: Path) -> Path:
    body = pickle.dumps({"pad": b"\0" * 20_000_000}, protocol=2)
    path = torch_zip(folder / "bomb.pt", body, deflate=True)
    assert len(zlib.compress(body)) < 64 * 1024  # a few KB on disk, 20 MB once inflated
    return path


def _deep_nesting(folder: Path, marker: Path) -> Path:
    depth = 50_000  # names grow with depth: unbounded, listing costs O(depth**2) (hours for a 50 MB file)
    return torch_zip(folder / "deep.pt", b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".")


def _key_repr_bomb(folder: Path, marker: Path) -> Path:
    """5,000 tuple keys sharing one 100 KB string: a full repr() of each key would build 500 MB of names."""
    shared = "k" * 100_000
    body = pickle.dumps({"state": {(i, shared): i for i in range(5_000)}}, protocol=2)
    assert len(body) < 200_000
    return torch_zip(folder / "keys.pt", body)


def _expand_bomb(folder: Path, marker: Path) -> Path:
    import torch

    torch.save({"ok": torch.ones(2, 3), "small_expand": torch.ones(3)[None].expand(2, 3), "bomb": torch.ones(1).expand(10**8)},
               folder / "expand.pt")
    return folder / "expand.pt"


def _torch_huge_view(folder: Path, marker: Path) -> Path:
    blob = np.arange(4, dtype=np.float32).tobytes()
    return torch_zip(folder / "huge.pt", tensor_pickle({"w": (0, (2**20, 2**20), (1, 1))}, storage_numel=4), {"0": blob})


def _torch_shape(shape: tuple, stride: tuple) -> Callable[[Path, Path], Path]:
    def build(folder: Path, marker: Path) -> Path:
        blob = np.arange(4, dtype=np.float32).tobytes()
        return torch_zip(folder / "shape.pt", tensor_pickle({"w": (0, shape, stride), "ok": (0, (4,), (1,))}, storage_numel=4), {"0": blob})

    return build


def _torch_view_past_storage(folder: Path, marker: Path) -> Path:
    blob = np.arange(4, dtype=np.float32).tobytes()
    return torch_zip(folder / "past.pt", tensor_pickle({"w": (3, (4,), (1,))}, storage_numel=4), {"0": blob})


def _atorch(folder: Path) -> Path:
    import shutil

    shutil.copytree(TRAINING / "atorch_flat", folder, dirs_exist_ok=True)
    return folder


def _atorch_meta_exec(folder: Path, marker: Path) -> Path:
    _atorch(folder)
    (folder / "flat_meta.00000-00002").write_bytes(exec_pickle(marker))
    return folder


def _atorch_huge_shape(folder: Path, marker: Path) -> Path:
    _atorch(folder)
    for path in sorted(folder.glob("flat_meta.*")):  # every rank agrees on the absurd shape
        meta = pickle.loads(path.read_bytes())  # the committed sample: trusted
        for info in meta["param_meta"].values():
            info["param_shapes"] = type(info["param_shapes"])([2**20, 2**20])
        path.write_bytes(pickle.dumps(meta))
    return folder


def _atorch_shape(shape: list) -> Callable[[Path, Path], Path]:
    def build(folder: Path, marker: Path) -> Path:
        _atorch(folder)
        for path in sorted(folder.glob("flat_meta.*")):  # every rank agrees on the shape
            meta = pickle.loads(path.read_bytes())  # the committed sample: trusted
            for info in meta["param_meta"].values():
                info["param_shapes"] = type(info["param_shapes"])(shape)
            path.write_bytes(pickle.dumps(meta))
        return folder

    return build


def _atorch_header_2_63(folder: Path, marker: Path) -> Path:
    _atorch(folder)
    path = folder / "flat_param.00001-00002"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**63) + raw[8:])
    return folder


def _atorch_symlinked_shard(folder: Path, marker: Path) -> Path:
    _atorch(folder)
    name = "flat_param.00001-00002"
    os.replace(folder / name, folder.parent / name)
    os.symlink(folder.parent / name, folder / name)
    return folder


def _lightning_meta_payload(folder: Path, marker: Path) -> Path:
    import torch

    _dcp(folder, {"model.w": torch.ones(2)})
    torch.save({"epoch": 3, "callbacks": {"cb": RunsCommand(marker)}, "ema": {"w": torch.zeros(2)}}, folder / "meta.pt")
    return folder


def _lightning_meta_symlink(folder: Path, marker: Path) -> Path:
    import torch

    _dcp(folder, {"model.w": torch.ones(2)})
    torch.save({"epoch": 3}, folder.parent / "meta.pt")
    os.symlink(folder.parent / "meta.pt", folder / "meta.pt")
    return folder


def _hf_shard_header_2_63(folder: Path, marker: Path) -> Path:
    _hf_index_seed(folder)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(struct.pack("<Q", 2**63) + shard.read_bytes()[8:])
    return folder


def _hf_duplicate_index_key(folder: Path, marker: Path) -> Path:
    _hf_index_seed(folder)
    text = (folder / INDEX_NAME).read_text()
    (folder / INDEX_NAME).write_text(text.replace('"a.bias": ', '"b.weight": "model-00001-of-00002.safetensors", "a.bias": '))
    return folder


def _header_at_the_limit(folder: Path, marker: Path) -> Path:
    """A header of exactly 100 MB (a 100 MB metadata string): accepted like the reference, memory bounded."""
    head = {"__metadata__": {"pad": ""}, "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}
    head["__metadata__"]["pad"] = "a" * (MAX_HEADER - len(json.dumps(head)))
    body = json.dumps(head).encode()
    assert len(body) == MAX_HEADER
    path = folder / "big-header.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(body)))
        fh.write(body)
        fh.write(b"\1\2\3\4")
    return path


def _unfinished_conversion(folder: Path, marker: Path) -> Path:
    """What a crash leaves: shards committed, the manifest, no index."""
    save_file({"a": np.ones(2, np.float32)}, str(folder / "model-00001-of-00002.safetensors"))
    (folder / ".workbench-convert.json").write_text('{"workbench_convert": 1}')
    return folder


def _zero_size_and_scalars(folder: Path, marker: Path) -> Path:
    import torch

    torch.save({"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "step": torch.tensor(7)}, folder / "small.pt")
    return folder / "small.pt"


def _dcp_zero_size_and_scalars(folder: Path, marker: Path) -> Path:
    import torch

    return _dcp(folder, {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "w": torch.ones(2)})


# ----------------------------------------------------------------------------------------- GGUF headers (hand-written)

_GGUF_KVS = [G.kv("general.architecture", "STRING", "llama")]
_GGUF_TENSORS = [("w", (2, 32), "F32"), ("q", (2, 32), "Q8_0")]


def _gguf(**kw) -> Callable[[Path, Path], Path]:
    """A small GGUF file (two tensors, one key) written with `gguf_files.write(**kw)`."""
    def build(folder: Path, marker: Path) -> Path:
        options = {"kvs": _GGUF_KVS, "tensors": _GGUF_TENSORS, **kw}
        return G.write(folder / "model.gguf", options.pop("kvs"), options.pop("tensors"), **options)

    return build


def _gguf_raw(tail: bytes, *, counts: tuple[int, int] = (0, 1), size: int = 0) -> Callable[[Path, Path], Path]:
    """A GGUF file: header with `counts` (tensors, key/values), then `tail`; made `size` bytes long (a hole) if larger."""
    def build(folder: Path, marker: Path) -> Path:
        path = folder / "model.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, *counts) + tail)
        if size > path.stat().st_size:
            _sparse(path, size)
        return path

    return build


def _gguf_record(dims: tuple[int, ...], type_id: int = 0, offset: int = 0, n_dims: int | None = None) -> Callable[[Path, Path], Path]:
    """One tensor record with these GGUF dims (innermost first), type id and offset, and 64 bytes of data."""
    record = G.string("t") + struct.pack("<I", len(dims) if n_dims is None else n_dims)
    record += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + record
    return lambda folder, marker: _write(folder / "model.gguf", head + bytes(-len(head) % 32) + bytes(64))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _gguf_nested(depth: int) -> bytes:
    value = struct.pack("<IQ", 0, 0)  # an empty UINT8 array
    for _ in range(depth):
        value = struct.pack("<IQ", 9, 1) + value
    return G.string("deep") + struct.pack("<I", 9) + value


def _gguf_overlap(folder: Path, marker: Path) -> Path:
    path = folder / "model.gguf"
    records = G.record("a", (16,), "F32", 0) + G.record("b", (16,), "F32", 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, 2, 0) + records
    return _write(path, head + bytes(-len(head) % 32) + bytes(128))


def _gguf_split_missing(folder: Path, marker: Path) -> Path:
    split = [G.kv("split.no", "UINT16", 0), G.kv("split.count", "UINT16", 3), G.kv("split.tensors.count", "INT32", 3)]
    G.write(folder / "model-00001-of-00003.gguf", split, [("a", (4,), "F32")])
    G.write(folder / "model-00003-of-00003.gguf", split, [("c", (4,), "F32")])
    return folder / "model-00001-of-00003.gguf"


def _gguf_long_string(folder: Path, marker: Path) -> Path:
    """A key whose string value is 1 GiB long (a hole): summarised, never read."""
    path = folder / "model.gguf"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + G.string("big") + struct.pack("<IQ", 8, 1 << 30)
    path.write_bytes(head)
    _sparse(path, len(head) + (1 << 30) + 32)
    return path


def _gguf_key(key: str, value: str) -> Callable[[object], None]:
    def check(catalog) -> None:
        assert catalog.metadata[key] == value, catalog.metadata

    return check


# ----------------------------------------------------------------------------------------- checks


def _listed(*names: str) -> Callable[[object], None]:
    def check(catalog) -> None:
        assert set(catalog.tensors) == set(names), sorted(catalog.tensors)

    return check


def _flagged_unsafe(*names: str) -> Callable[[object], None]:
    def check(catalog) -> None:
        _listed(*names)(catalog)
        assert "posix.system" in catalog.metadata.get("unsafe_globals", catalog.metadata.get("meta_unsafe_globals", ""))

    return check


def _warns(text: str, *names: str) -> Callable[[object], None]:
    def check(catalog) -> None:
        _listed(*names)(catalog)
        assert any(text in w for w in catalog.warnings), catalog.warnings

    return check


def _shapes(**shapes: tuple) -> Callable[[object], None]:
    def check(catalog) -> None:
        assert {n: catalog[n].shape for n in catalog.tensors} == shapes
        for name in shapes:
            assert len(catalog.read_bytes(name)) == catalog[name].nbytes

    return check


CASES: list[Case] = [
    # pickles that would run code: listed without running it, or refused where only metadata belongs
    Case("torch: nested __reduce__ -> os.system", _torch_evil, "listed", check=_flagged_unsafe("w")),
    Case("torch: hand-written GLOBAL builtins.exec + REDUCE", _torch_exec, "listed", check=_listed()),
    Case("DCP .metadata: builtins.exec", _dcp_metadata_exec, "refused", "builtins.exec, which is not allowed"),
    Case("DCP chunk stream: torch.save of a payload", _dcp_chunk_payload, "refused", "not a tensor"),
    Case("atorch flat_meta: builtins.exec", _atorch_meta_exec, "refused", "builtins.exec, which is not allowed"),
    Case("Lightning sharded meta.pt: callback payload", _lightning_meta_payload, "listed",
         check=_flagged_unsafe("model.w", "meta.ema.w")),
    # pickles that would exhaust memory or time
    Case("pickle memo index 2**31 (32 GiB memo table)", _memo_bomb, "refused", "memo index 2147483648"),
    Case("pickle BINUNICODE8 of 2**40 bytes", _dcp_counted_bomb, "refused", "declares 1099511627776 bytes"),
    Case("deflated data.pkl, 1000:1", _deflate_bomb, "refused", "decompression bomb"),
    Case("pickle nested 50,000 deep", _deep_nesting, "listed", check=_warns("names longer than", )),
    Case("dict keys whose repr() totals 500 MB", _key_repr_bomb, "listed", check=_listed()),
    Case("torch view expand()ed to 10**8 elements", _expand_bomb, "listed",
         check=_warns("repeats storage elements", "ok", "small_expand")),
    # sizes that overflow or point past the data
    Case("torch view of 2**40 elements over 4", _torch_huge_view, "refused", "reaches byte"),
    Case("torch view past the end of its storage", _torch_view_past_storage, "refused", "reaches byte 28"),
    Case("DCP tensor of 2**40 elements in one small chunk", _dcp_huge_shape, "refused", "its stored stream has"),
    Case("atorch param_shapes 2**40 elements", _atorch_huge_shape, "refused", "pieces hold"),
    Case("atorch flat_param header length 2**63", _atorch_header_2_63, "refused", "above the 100000000 byte limit"),
    Case("HF shard header length 2**63", _hf_shard_header_2_63, "refused", "model-00002-of-00002.safetensors"),
    Case("safetensors header of exactly 100 MB", _header_at_the_limit, "listed", check=_listed("x")),
    Case("HF index lists a tensor twice", _hf_duplicate_index_key, "refused", "lists the key 'b.weight' twice"),
    # the pickle's real extent bounds what it may ask for (issue 12 B2)
    Case("pickle with bytes after STOP", _padded_after_stop, "refused", "4096 bytes follow the STOP opcode"),
    Case("pickle memo index 900,000 after one entry (1 MB pickle)", _memo_beyond_entries, "refused", "memo index 900000"),
    Case("deflated 20 MB data.pkl: memo index paid for by bytes after STOP", _deflated_memo_bomb, "refused", "memo index 19999900"),
    # objects built from a byte or a few each, without a memo (issue 29 B3): refused before anything is built
    Case("deflated 4 MB of EMPTY_SET (175 KB file)", _object_bomb(b"\x8f", b"}", 4_000_000), "refused", "memory bomb"),
    Case("deflated 4 MB of EMPTY_DICT", _object_bomb(b"}", b"\x8f", 4_000_000), "refused", "memory bomb"),
    Case("deflated 4 MB of TUPLE1 nesting", _object_bomb(b"\x85", b"2", 4_000_000, head=b"N"), "refused", "memory bomb"),
    Case("deflated REDUCE of one memoized global x 1.3M", _object_bomb(b"h\x00)R", b"h\x00)\x81", 1_300_000, head=b"cfoo\nbar\nq\x00"),
         "refused", "memory bomb"),
    Case("DCP chunk stream whose data.pkl is 2 MB", _dcp_chunk_big_pickle, "refused", "above the 1048576-byte limit"),
    Case("DCP .metadata of 257 MB", _dcp_metadata_257mb, "refused", "above the 268435456-byte limit for a DCP index"),
    Case("atorch ckpt_meta of 65 MB", _atorch_meta_65mb, "refused", "above the 67108864-byte limit for an atorch metadata pickle"),
    Case("Lightning meta.pt whose data.pkl is 65 MB", _lightning_meta_65mb, "refused", "above the 67108864-byte limit for this kind"),
    # shapes that overflow 64 bits, a 0 elsewhere or not (B3)
    Case("torch size [2**62, 2**62, 0]", _torch_shape((2**62, 2**62, 0), (1, 1, 1)), "refused", "overflows 64 bits"),
    Case("torch size [2**40, 2**40] (2**80 elements)", _torch_shape((2**40, 2**40), (1, 1)), "refused", "overflows 64 bits"),
    Case("torch stride 2**64 on a zero-size view", _torch_shape((0, 4), (2**64, 1)), "refused", "is not a 64-bit index"),
    Case("DCP size [2**62, 2**62, 0]", _dcp_size([2**62, 2**62, 0]), "refused", "overflows 64 bits"),
    Case("DCP size of 4000-digit dimensions and a 0", _dcp_size([10**3999, 10**3999, 0]), "refused", "not a list of sizes"),
    Case("atorch param_shapes [2**62, 2**62, 0]", _atorch_shape([2**62, 2**62, 0]), "refused", "overflows 64 bits"),
    # integers of thousands of digits (B5)
    Case("Lightning version of 7000+ digits (LONG4)", _huge_version, "refused", "an integer of 3001 bytes"),
    Case("pickle LONG of 5000 digits", _long_text_integer, "refused", "an integer of 5001 digits"),
    Case("HF index integer of 5000 digits", _hf_index_huge_integer, "refused", "integer of more than 4300 digits"),
    # keys repeated through JSON escapes (B4)
    Case("HF index lists a tensor twice, once through an escape", _hf_escaped_duplicate, "refused", "lists the key 'b.weight' twice"),
    # state set on the reader's own builders (B6)
    Case("pickle sets __defaults__ on torch._utils._rebuild_tensor_v2", _set_attributes_on("torch._utils._rebuild_tensor_v2", SLOT_DEFAULTS),
         "refused", "tries to set attributes on torch._utils._rebuild_tensor_v2"),
    Case("pickle sets __qualname__ on torch.Size", _set_attributes_on("torch.Size", DICT_QUALNAME),
         "refused", "tries to set attributes on torch.Size"),
    # index entries that are not regular files (B7)
    Case("HF index shard is a FIFO", _hf_shard_not_regular("fifo"), "refused", "is not a regular file (a FIFO)"),
    Case("HF index shard is a directory", _hf_shard_not_regular("dir"), "refused", "is not a regular file (a directory)"),
    Case("DCP data file is a FIFO", _dcp_data_fifo, "refused", "is not a regular file (a FIFO)"),
    Case("atorch rank file is a FIFO", _atorch_rank_file_fifo, "refused", "is not a regular file (a FIFO)"),
    # paths leading out of the folder
    Case("DCP storage path ../outside.distcp", _dcp_path("../outside.distcp"), "refused", "outside the checkpoint folder"),
    Case("DCP storage path /etc/passwd", _dcp_path("/etc/passwd"), "refused", "outside the checkpoint folder"),
    Case("DCP data file symlinked outside", _dcp_symlinked_data, "refused", "link that leads outside"),
    Case("atorch shard symlinked outside", _atorch_symlinked_shard, "refused", "link that leads outside"),
    Case("Lightning meta.pt symlinked outside", _lightning_meta_symlink, "refused", "link that leads outside"),
    # outputs that must not look complete
    Case("unfinished conversion (shards, manifest, no index)", _unfinished_conversion, "refused", "unfinished conversion"),
    # legal but unusual tensors
    Case("safetensors 0-d and zero-size tensors", lambda f, m: _safetensors_seed(f), "listed",
         check=_shapes(**{"layer.weight": (2, 3), "layer.bias": (4,), "step": (), "empty": (0, 3), "mask": (3,)})),
    Case("torch 0-d and zero-size tensors", _zero_size_and_scalars, "listed", check=_shapes(scalar=(), empty=(0, 3), step=())),
    Case("DCP 0-d and zero-size tensors", _dcp_zero_size_and_scalars, "listed", check=_shapes(scalar=(), empty=(0, 3), w=(2,))),
    # GGUF headers: every count, length, dim and offset checked against the file before use (issue 33)
    Case("GGUF key/value count 2**63", _gguf_raw(b"", counts=(0, 2**63)), "refused", "claims 9223372036854775808 key/values"),
    Case("GGUF tensor count 2**63", _gguf_raw(b"", counts=(2**63, 0)), "refused", "claims 9223372036854775808 tensors"),
    Case("GGUF key of 2**62 bytes", _gguf_raw(struct.pack("<Q", 2**62), size=4096), "refused", "above the 65536-byte limit"),
    Case("GGUF string value past the end of the file", _gguf_raw(G.string("k") + struct.pack("<IQ", 8, 1 << 20) + b"abc"),
         "refused", "the file has only 3 left"),
    Case("GGUF UINT8 array of 2**62 items", _gguf_raw(G.string("k") + struct.pack("<IIQ", 9, 0, 2**62)), "refused",
         "claims 4611686018427387904 items"),
    Case("GGUF 2**25 empty strings in a 256 MiB hole", _gguf_raw(G.string("k") + struct.pack("<IIQ", 9, 8, 2**25), size=(2**25 + 16) * 8),
         "refused", "more than 16777216 strings"),
    Case("GGUF arrays nested 5 deep", _gguf_raw(_gguf_nested(5)), "refused", "nests arrays more than 3 deep"),
    Case("GGUF value type 99", _gguf_raw(G.string("k") + struct.pack("<I", 99) + bytes(8)), "refused", "value type 99"),
    Case("GGUF key repeated", _gguf(kvs=[*_GGUF_KVS, *_GGUF_KVS]), "refused", "'general.architecture' appears twice"),
    Case("GGUF unknown tensor type id 99", _gguf_record((16,), type_id=99), "refused", "GGML type id 99"),
    Case("GGUF dims 2**40 x 2**40", _gguf_record((2**40, 2**40)), "refused", "overflow 64 bits"),
    Case("GGUF dimension count 2**31", _gguf_record((16,), n_dims=2**31), "refused", "GGUF tensors have at most 4"),
    Case("GGUF Q8_0 rows of 17 elements", _gguf_record((17,), type_id=8), "refused", "not whole Q8_0 blocks of 32"),
    Case("GGUF tensor data past the end of the file", _gguf_record((64,), offset=32), "refused", "end past the end"),
    Case("GGUF tensor offset 2**64-32", _gguf_record((4,), offset=2**64 - 32), "refused", "end past the end"),
    Case("GGUF misaligned tensor offset", _gguf_record((4,), offset=4), "refused", "not a multiple of the alignment 32"),
    Case("GGUF overlapping tensor data", _gguf_overlap, "refused", "overlaps that of 'a'"),
    Case("GGUF tensor count larger than the records", _gguf(counts=(5, 1)), "refused", "end past the end"),
    Case("GGUF split set with a file missing", _gguf_split_missing, "refused", "model-00002-of-00003.gguf"),
    Case("GGUF string value of 1 GiB (a hole): summarised, not read", _gguf_long_string, "listed",
         check=lambda c: (_listed()(c), _gguf_key("big", "<string of 1073741824 bytes>")(c))),
    Case("GGUF Q8_0 and F32 tensors", _gguf(), "listed", check=_shapes(w=(2, 32), q=(2, 34))),
]
