"""Digests of the committed tool-made fixtures (tests/fixtures/<tool>/), by what is deterministic in each file.

DeepSpeed and Megatron write pickles with run-specific bits (torch's `.data/serialization_id`, RNG states,
argparse namespaces), so a rebuilt fixture is not byte-identical as a file. What must not change between two runs
of the same script with the same tool versions is the tensor data: for a torch zip (`.pt`) the bytes of each
storage member (`<archive>/data/<n>`); for `.safetensors` the header's names, dtypes and shapes and each tensor's
bytes; for any other file (json, text, DCP's `.distcp`) its bytes. `digests(folder)` maps each file to that digest;
`MANIFEST.json` beside the runs records them with the tool versions and the script that made them, and
tests/system/test_fixtures_committed.py compares it with the committed files (always) and with a rebuild from
`make fixtures` (when one is present).

    python scripts/fixture_manifest.py tests/fixtures/deepspeed   # print the digests
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

MANIFEST = "MANIFEST.json"
# DCP's `.metadata` is a pickle of the plan (objects, not tensors); the `.distcp` files next to it hold the bytes.
SKIP = {MANIFEST, "done", ".metadata"}


def _zip_storages(path: Path) -> str:
    digest = hashlib.sha256()
    with zipfile.ZipFile(path) as archive:
        names = sorted(n for n in archive.namelist() if "/data/" in n and not n.split("/data/", 1)[1].startswith("."))
        for name in names:
            digest.update(name.split("/", 1)[1].encode() + b"\0")
            digest.update(archive.read(name))
    return "storages:" + digest.hexdigest()


def _safetensors(path: Path) -> str:
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    body = data[8 + size :]
    digest = hashlib.sha256()
    for name in sorted(header):
        entry = header[name]
        begin, end = entry["data_offsets"]
        digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
        digest.update(body[begin:end])
    return "tensors:" + digest.hexdigest()


def file_digest(path: Path) -> str:
    """The deterministic digest of one fixture file (see the module docstring)."""
    if path.suffix == ".pt" and zipfile.is_zipfile(path):
        return _zip_storages(path)
    if path.suffix == ".safetensors":
        return _safetensors(path)
    return "bytes:" + hashlib.sha256(path.read_bytes()).hexdigest()


def digests(folder: Path, runs: list[str] | None = None) -> dict[str, str]:
    """relative path -> digest of every file under `folder` (only the `runs` sub-folders when given)."""
    roots = [folder / r for r in runs] if runs is not None else [folder]
    out = {}
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            if path.name in SKIP or path.name.startswith(".") or path.suffix == ".py":  # scripts a tool drops are not data
                continue
            out[path.relative_to(folder).as_posix()] = file_digest(path)
    return out


def write_manifest(folder: Path, tools: dict[str, str], script: str, runs: list[str]) -> Path:
    """Write `folder/MANIFEST.json`: the tool versions, the script that made the runs, and each file's digest."""
    manifest = {"made_by": script, "tools": tools, "runs": runs, "files": digests(folder, runs)}
    path = folder / MANIFEST
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def read_manifest(folder: Path) -> dict:
    """The committed manifest of `folder`."""
    return json.loads((folder / MANIFEST).read_text())


if __name__ == "__main__":
    print(json.dumps(digests(Path(sys.argv[1])), indent=1))
