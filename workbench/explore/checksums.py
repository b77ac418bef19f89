"""Per-tensor SHA-256 checksums kept in a sidecar file: prove a copy intact or a conversion lossless.

The first `record` writes `checksums.sha256.json` beside the checkpoint (inside a checkpoint folder; for
a single file, `<file>.checksums.sha256.json` next to it); later `check`s re-hash every tensor and report
each one that differs, disappeared or appeared. A tensor's digest is the SHA-256 of its row-major bytes,
whatever the format stores around them, so the sidecar of a torch or DCP checkpoint also checks its
safetensors conversion (pass it with `sidecar=`). Bytes are hashed in bounded chunks when they lie
contiguous in a file; other tensors (multi-chunk DCP, strided torch views) are assembled once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog import Catalog
from ..digest import CHUNK_BYTES, tensor_sha256
from ..errors import CheckpointError, UnsafeFileError
from ..files import atomic_write, read_regular
from ..formats.json_errors import json_problem
from ..formats.safetensors_folder import CHECKSUMS_NAME

SIDECAR_NAME = CHECKSUMS_NAME
_KIND = "workbench-checksums"
STATUSES = ("ok", "mismatch", "changed", "missing", "unrecorded")


def default_sidecar(path: str | os.PathLike) -> Path:
    """Where the sidecar of the checkpoint at `path` lives by default."""
    p = Path(path)
    if p.is_dir():
        return p / SIDECAR_NAME
    if p.name.endswith(".index.json") or p.name == ".metadata":
        return p.parent / SIDECAR_NAME
    return p.parent / f"{p.name}.{SIDECAR_NAME}"


def _hashed(catalog: Catalog, name: str, chunk_bytes: int, on_read: Callable[[int], None] | None) -> str:
    digest = tensor_sha256(catalog, name, chunk_bytes)
    if on_read is not None:
        on_read(catalog.tensors[name].nbytes)
    return digest


def compute(catalog: Catalog, chunk_bytes: int = CHUNK_BYTES, on_read: Callable[[int], None] | None = None) -> dict[str, dict]:
    """name -> {dtype, shape, nbytes, sha256} for every tensor of `catalog`, in name order (`on_read(nbytes)`
    after each tensor is hashed; raise from it to stop)."""
    return {
        name: {"dtype": info.dtype, "shape": list(info.shape), "nbytes": info.nbytes, "sha256": _hashed(catalog, name, chunk_bytes, on_read)}
        for name, info in sorted(catalog.tensors.items())
    }


def write_sidecar(path: Path, sums: dict[str, dict], checkpoint_format: str) -> None:
    """Write a sidecar atomically (a crash leaves the old one or none, never half of one)."""
    body = {"kind": _KIND, "version": 1, "algorithm": "sha256", "checkpoint_format": checkpoint_format,
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%S"), "tensors": sums}
    atomic_write(path, json.dumps(body, indent=1, sort_keys=True) + "\n")


def read_sidecar(path: Path) -> dict[str, dict]:
    """The recorded tensors of a sidecar; a file that is not one raises CheckpointError."""
    try:
        body = json.loads(read_regular(path))  # a FIFO, symlink or folder under the sidecar's name is refused
    except UnsafeFileError as exc:
        raise CheckpointError(
            f"Cannot read checksum sidecar {path}: it is {exc.what}, not a file the workbench wrote. Remove it, or pass "
            "--record (record=True) to write a new one.", file=str(path)) from None
    except OSError as exc:
        raise CheckpointError(f"Cannot read checksum sidecar {path}: {exc}. Record it again (--record).", file=str(path)) from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"Cannot read checksum sidecar {path}: it is not valid JSON ({json_problem(exc)}). Record it again (--record).", file=str(path)
        ) from None
    tensors = body.get("tensors") if isinstance(body, dict) and body.get("kind") == _KIND else None
    if not isinstance(tensors, dict) or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in tensors.values()):
        raise CheckpointError(f"Cannot read checksum sidecar {path}: it is not a workbench checksum file. Record it again (--record).", file=str(path))
    return tensors


@dataclass
class ChecksumResult:
    """What a checksum run did: `recorded` a new sidecar or `checked` against one, with one row per tensor."""

    action: str
    sidecar: Path
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # (tensor, status, expected, actual)

    def names(self, status: str) -> list[str]:
        """Tensors with this status ('ok', 'mismatch', 'changed', 'missing', 'unrecorded')."""
        return [name for name, s, _, _ in self.rows if s == status]

    @property
    def ok(self) -> bool:
        return all(s in ("ok", "unrecorded") for _, s, _, _ in self.rows)

    def summary(self) -> str:
        """One line for reports."""
        if self.action == "recorded":
            return f"checksums: recorded {len(self.rows)} tensors in {self.sidecar}"
        counts = {s: len(self.names(s)) for s in STATUSES if self.names(s)}
        detail = ", ".join(f"{n} {s}" for s, n in counts.items())
        verdict = "all match" if self.ok else "MISMATCH"
        return f"checksums: {verdict} against {self.sidecar} ({detail or 'no tensors'})"

    def frame(self):
        """The rows as a DataFrame indexed by tensor (imports pandas)."""
        import pandas as pd

        return pd.DataFrame(self.rows, columns=["tensor", "status", "expected", "actual"]).set_index("tensor")


def compare(
    recorded: dict[str, dict], catalog: Catalog, chunk_bytes: int = CHUNK_BYTES, on_read: Callable[[int], None] | None = None
) -> list[tuple[str, str, str, str]]:
    """One row per tensor in either: ok, mismatch (bytes), changed (dtype or shape), missing, unrecorded."""
    rows = []
    for name in sorted(set(recorded) | set(catalog.tensors)):
        want = recorded.get(name)
        if name not in catalog.tensors:
            rows.append((name, "missing", want["sha256"], ""))
            continue
        actual = _hashed(catalog, name, chunk_bytes, on_read)
        info = catalog.tensors[name]
        if want is None:
            rows.append((name, "unrecorded", "", actual))
        elif [info.dtype, list(info.shape)] != [want.get("dtype", info.dtype), want.get("shape", list(info.shape))]:
            rows.append((name, "changed", f"{want.get('dtype')} {want.get('shape')}", f"{info.dtype} {list(info.shape)}"))
        else:
            rows.append((name, "ok" if actual == want["sha256"] else "mismatch", want["sha256"], actual))
    return rows


def record_or_check(
    catalog: Catalog, sidecar: Path, *, record: bool = False, chunk_bytes: int = CHUNK_BYTES, on_read: Callable[[int], None] | None = None
) -> ChecksumResult:
    """Record `sidecar` when it does not exist (or `record=True`), else check every tensor against it."""
    if record or not os.path.lexists(sidecar):
        sums = compute(catalog, chunk_bytes, on_read)
        write_sidecar(sidecar, sums, catalog.format)
        return ChecksumResult("recorded", sidecar, [(n, "ok", "", s["sha256"]) for n, s in sums.items()])
    return ChecksumResult("checked", sidecar, compare(read_sidecar(sidecar), catalog, chunk_bytes, on_read))
