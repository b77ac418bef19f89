"""One small, valid checkpoint per fuzz target, and how to put mutated bytes back into it.

Seeds are written without torch (numpy + safetensors, or copies of the committed samples) so that a
fuzz run measures the readers, not torch's import. Each target names the payloads a mutator may
change: usually whole files, for `torch-pickle` the `data.pkl` entry inside an otherwise valid zip.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SAMPLES = Path(__file__).resolve().parents[2] / "sample_checkpoints"
TRAINING = SAMPLES / "training"
INDEX_NAME = "model.safetensors.index.json"


def write_payload_file(folder: Path, key: str, data: bytes) -> None:
    """Default `apply`: the payload key is a file name relative to the checkpoint folder."""
    (folder / key).write_bytes(data)


@dataclass(frozen=True)
class Target:
    """A reader under fuzz: how to write its seed, which payloads mutate, how a payload is put back."""

    name: str
    build: Callable[[Path], Path]  # writes the seed into an empty folder; returns the path to open
    payloads: tuple[str, ...]
    apply: Callable[[Path, str, bytes], None] = write_payload_file
    read_payload: Callable[[Path, str], bytes] = field(default=lambda folder, key: (folder / key).read_bytes())


def _safetensors_seed(folder: Path) -> Path:
    tensors = {
        "layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "layer.bias": np.ones(4, dtype=np.float16),
        "step": np.array(7, dtype=np.int64),  # 0-d
        "empty": np.zeros((0, 3), dtype=np.uint8),
        "mask": np.array([True, False, True]),
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", "note": "seed"})
    return folder / "model.safetensors"


def _gguf_seed(folder: Path) -> Path:
    """A small GGUF file written by hand: scalar, string and array keys (a 5-token vocabulary), F32, F16 and Q8_0 tensors."""
    from .gguf_files import kv, write

    kvs = [kv("general.architecture", "STRING", "llama"), kv("llama.block_count", "UINT32", 1),
           kv("general.alignment", "UINT32", 32), kv("llama.rope.freq_base", "FLOAT32", 10000.0),
           kv("tokenizer.ggml.tokens", "ARRAY", ("STRING", ["<s>", "</s>", "a", "b", "ab"])),
           kv("tokenizer.ggml.scores", "ARRAY", ("FLOAT32", [0.0, 0.0, -1.0, -2.0, -3.0])),
           kv("tokenizer.ggml.token_type", "ARRAY", ("INT32", [3, 3, 1, 1, 1]))]
    data = {"norm": np.arange(8, dtype=np.float32).tobytes(), "half": np.ones((2, 4), np.float16).tobytes(),
            "q": bytes(range(68))}
    return write(folder / "model.gguf", kvs, [("norm", (8,), "F32"), ("half", (2, 4), "F16"), ("q", (2, 32), "Q8_0")], data=data)


def _hf_index_seed(folder: Path) -> Path:
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": np.ones((2, 2), np.float32), "a.bias": np.zeros(2, np.float32)},
        "model-00002-of-00002.safetensors": {"b.weight": np.ones((3,), np.float16)},
    }
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": 30}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return folder


def _copy_sample(sample: Path, name: str | None = None) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        if sample.is_dir():
            shutil.copytree(sample, folder, dirs_exist_ok=True)
            return folder
        shutil.copyfile(sample, folder / (name or sample.name))
        return folder / (name or sample.name)

    return build


TORCH_FILE = "pytorch_model.bin"


def _pickle_entry(folder: Path) -> tuple[str, list[tuple[zipfile.ZipInfo, bytes]]]:
    with zipfile.ZipFile(folder / TORCH_FILE) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    pkl = next(info.filename for info, _ in entries if info.filename.endswith("/data.pkl"))
    return pkl, entries


def _read_pickle(folder: Path, key: str) -> bytes:
    pkl, entries = _pickle_entry(folder)
    return next(data for info, data in entries if info.filename == pkl)


def _rezip_pickle(folder: Path, key: str, data: bytes, *, deflate: bool = False) -> None:
    """Put mutated pickle bytes back into a well-formed zip (so the pickle is what is fuzzed); stored
    uncompressed as torch writes it, or deflated (`data.pkl` only) as a re-zipped file may be."""
    pkl, entries = _pickle_entry(folder)
    out = folder / (TORCH_FILE + ".tmp")
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info, blob in entries:
            if info.filename == pkl:
                archive.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
            else:
                archive.writestr(info, blob)
    out.replace(folder / TORCH_FILE)


def _rezip_pickle_deflated(folder: Path, key: str, data: bytes) -> None:
    _rezip_pickle(folder, key, data, deflate=True)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("safetensors", _safetensors_seed, ("model.safetensors",)),
        Target("hf-index", _hf_index_seed, (INDEX_NAME,)),
        Target("gguf", _gguf_seed, ("model.gguf",)),
        Target("torch-zip", _copy_sample(TRAINING / "torch" / TORCH_FILE), (TORCH_FILE,)),
        Target("torch-pickle", _copy_sample(TRAINING / "torch" / TORCH_FILE), ("data.pkl",), _rezip_pickle, _read_pickle),
        # A deflated data.pkl multiplies what a few bytes on disk can ask of the unpickler (the memo bomb family).
        Target(
            "torch-pickle-deflated", _copy_sample(TRAINING / "torch" / TORCH_FILE), ("data.pkl",), _rezip_pickle_deflated, _read_pickle
        ),
        Target("dcp-metadata", _copy_sample(TRAINING / "dcp_2ranks"), (".metadata",)),
        Target("dcp-data", _copy_sample(TRAINING / "dcp_2ranks"), ("__0_0.distcp",)),
        Target(
            "atorch-meta",
            _copy_sample(TRAINING / "atorch_flat"),
            ("flat_meta.00000-00002", "flat_meta.00001-00002", "ckpt_meta", "optim_meta"),
        ),
    )
}


def build_seed(target: Target, folder: Path) -> tuple[Path, dict[str, bytes]]:
    """Write `target`'s seed into `folder` (created); returns the path to open and the original payloads."""
    folder.mkdir(parents=True, exist_ok=True)
    path = target.build(folder)
    return path, {key: target.read_payload(folder, key) for key in target.payloads}
