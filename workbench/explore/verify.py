"""Structural integrity of a checkpoint on disk: every problem at once, not just the first.

Opening a checkpoint stops at the first fault; `verify` keeps going and lists them all, so a user
repairing a download sees every missing or truncated shard in one pass. It reads headers only:
a header that validates proves its file is exactly as long as the header says (no missing or
trailing bytes). `checksums=True` adds per-tensor SHA-256 checks against a sidecar (`workbench.explore.checksums`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..catalog import Catalog
from ..errors import CheckpointError, WorkbenchError
from ..formats import open_catalog, safetensors_folder
from ..formats.remote import is_remote
from ..formats.safetensors import SUFFIX, SafetensorsHeader, gc_paused, read_header
from ..iostats import file_kind
from ..output.safetensors import PARTIAL_SUFFIX
from .checksums import ChecksumResult, default_sidecar, record_or_check


@dataclass(frozen=True)
class Finding:
    """One problem (error) or oddity (warning) found in a checkpoint."""

    level: Literal["error", "warning"]
    message: str
    file: str | None = None
    tensor: str | None = None

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


@dataclass
class VerifyReport:
    """What `verify` checked and what it found; `ok` when no finding is an error."""

    path: str
    format: str = "unknown"
    files_checked: int = 0
    tensors: int = 0
    tensor_bytes: int = 0
    findings: list[Finding] = field(default_factory=list)
    checksums: ChecksumResult | None = None  # set by verify(..., checksums=True)
    # set by verify(..., model=True): what the tensors were checked against ("the transformers ... statement (N
    # tensors)") or why they were not ("not checked against transformers: ...")
    model_check: str | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, message: str, file: str | None = None, tensor: str | None = None) -> None:
        self.findings.append(Finding("error", message, file, tensor))

    def warning(self, message: str, file: str | None = None, tensor: str | None = None) -> None:
        self.findings.append(Finding("warning", message, file, tensor))

    def summary(self) -> str:
        """One line: verdict, format, counts."""
        verdict = "OK" if self.ok else f"FAILED ({_count(len(self.errors), 'problem')})"
        warn = f", {_count(len(self.warnings), 'warning')}" if self.warnings else ""
        line = (
            f"{self.path}: {verdict}{warn} - {self.format}, {_count(self.files_checked, 'file')}, "
            f"{_count(self.tensors, 'tensor')}, {self.tensor_bytes:,} bytes of tensor data"
        )
        if self.model_check is not None:
            line += f"\n{self.model_check}"
        return line if self.checksums is None else f"{line}\n{self.checksums.summary()}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def verify(
    path: str | os.PathLike,
    *,
    checksums: bool = False,
    sidecar: str | os.PathLike | None = None,
    record: bool = False,
    on_read: Callable[[int], None] | None = None,
    model: bool = False,
) -> VerifyReport:
    """Check a checkpoint's headers, its index against its shards, and that every file is complete.

    `checksums=True` also hashes every tensor (SHA-256): the first time it records the sums in a sidecar
    (`checksums.sha256.json` beside the checkpoint, or `sidecar`), later it checks them and reports each
    tensor that differs; `record=True` records again. `sidecar` or `record` imply `checksums`.
    `on_read(nbytes)` is called after each tensor is hashed (raise from it to stop).
    `model=True` also checks the tensors' names and shapes against the model transformers builds (on the meta device)
    from the folder's config.json (`_model_check`): each tensor it declares that is missing, each one it does not
    declare and each of another shape is an error; it imports torch and transformers.
    """
    report = VerifyReport(os.fspath(path))
    if is_remote(path):  # opening checks every header, the index against the shards, and each file's size
        catalog = _open(str(path), report)
        if catalog is not None and (checksums or sidecar is not None or record):
            if sidecar is None:
                report.error(f"Cannot check the checksums of {path}: a remote checkpoint has no folder for the sidecar. "
                             "Name a local one with sidecar=... (--sidecar FILE); hashing downloads every tensor.")
            else:
                _checksums(catalog, Path(sidecar), record, report, on_read)
        if model:
            report.model_check = "not checked against transformers: verify reads a remote checkpoint's headers only"
        return report
    p = Path(path)
    if not p.exists():
        report.error(f"Cannot verify {p}: no such file or folder. Check the path.", file=str(p))
        return report
    if safetensors_folder.detect(p):
        with gc_paused():
            _verify_safetensors(p, report)
    if report.ok:
        catalog = _open(p, report)
        if catalog is not None and (checksums or sidecar is not None or record):
            _checksums(catalog, Path(sidecar) if sidecar is not None else default_sidecar(p), record, report, on_read)
        if catalog is not None and model:
            _model_check(p if p.is_dir() else p.parent, catalog, report)
    elif model:
        report.model_check = "not checked against transformers: the checkpoint's structure is broken (see above)"
    return report


def _model_check(folder: Path, catalog: Catalog, report: VerifyReport) -> None:
    """Compare the checkpoint's tensors with what transformers declares for `folder`/config.json (see
    `mapper.presets.transformers_declared`), as the conversions' `--verify` does: one error per disagreement."""
    import json

    from ..errors import MapperError
    from ..mapper.presets.transformers_declared import declared_layouts
    from ..output.statement import nearest_statement, statement_rows
    from ..planning.config_dtype import read_config

    config_path = folder / "config.json"
    raw = read_config(config_path) if config_path.is_file() and not config_path.is_symlink() else None
    try:
        config = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        why = "no config.json beside the weights" if raw is None else "config.json is not a JSON object"
        report.model_check = f"not checked against transformers: {why}"
        return
    try:
        family, layouts, optional = declared_layouts(config)
    except MapperError as exc:
        report.model_check = f"not checked against transformers: {exc.message}"
        return
    written = {name: (info.dtype, tuple(info.shape)) for name, info in catalog.tensors.items()}
    statement = nearest_statement(family, layouts, optional, written)
    rows = statement_rows(statement, written, [], set())
    for name, _, status, _, _, detail in rows:
        report.error(f"{name!r} {status}: {detail}", file=str(config_path), tensor=name)
    report.model_check = (f"checked against the {statement.family} statement ({_count(len(statement.tensors), 'tensor')}): "
                          + ("all present with their shapes" if not rows else f"{_count(len(rows), 'disagreement')}"))


def _checksums(catalog: Catalog, sidecar: Path, record: bool, report: VerifyReport, on_read: Callable[[int], None] | None) -> None:
    try:
        result = record_or_check(catalog, sidecar, record=record, on_read=on_read)
    except WorkbenchError as exc:  # an unreadable sidecar, or a name the sidecar cannot be written under
        report.error(exc.message, exc.file, exc.tensor)
        return
    report.checksums = result
    for name, status, expected, actual in result.rows:
        if status == "mismatch":
            report.error(f"Tensor {name!r} does not match its recorded checksum (sha256 {actual[:16]}..., recorded {expected[:16]}...): "
                         "its bytes changed since they were recorded.", tensor=name)
        elif status == "changed":
            report.error(f"Tensor {name!r} is {actual} but was recorded as {expected}.", tensor=name)
        elif status == "missing":
            report.error(f"Tensor {name!r} is recorded in {sidecar.name} but the checkpoint does not hold it.", tensor=name)
        elif status == "unrecorded":
            report.warning(f"Tensor {name!r} is not recorded in {sidecar.name}; record again (--record) to include it.", tensor=name)


def _open(p: Path | str, report: VerifyReport) -> Catalog | None:
    """The final word: the checkpoint must open; fills counts for formats verified only this way."""
    try:
        catalog = open_catalog(p)
    except CheckpointError as exc:
        report.error(exc.message, exc.file, exc.tensor)
        return None
    report.format = catalog.format
    report.files_checked = len(catalog.files)
    report.tensors = len(catalog)
    report.tensor_bytes = catalog.total_bytes
    for warning in catalog.warnings:
        if not any(f.message == warning for f in report.findings):
            report.warning(warning)
    return catalog


def _header(path: Path, rel: str, report: VerifyReport) -> SafetensorsHeader | None:
    try:
        return read_header(path, rel=rel)
    except CheckpointError as exc:
        report.error(exc.message, rel, exc.tensor)
        return None


def _leftovers(folder: Path, report: VerifyReport, *, indexed: bool) -> None:
    if (folder / safetensors_folder.UNFINISHED_MARKER).is_file():
        if indexed:
            report.warning(
                f"{safetensors_folder.UNFINISHED_MARKER} remains from a conversion that wrote its index (its commit "
                "marker) and stopped before cleaning up; the shards are complete and the file can be deleted.",
                file=safetensors_folder.UNFINISHED_MARKER,
            )
        else:
            report.error(
                f"Cannot verify {folder}: it is an unfinished conversion ({safetensors_folder.UNFINISHED_MARKER} is there "
                "and no index was written). Run the same conversion again to finish it.",
                file=safetensors_folder.UNFINISHED_MARKER,
            )
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.endswith(PARTIAL_SUFFIX):
            report.warning(
                f"{entry.name} is an unfinished write (a conversion was interrupted); it is not part of the checkpoint "
                "and can be deleted.",
                file=entry.name,
            )


def _verify_safetensors(p: Path, report: VerifyReport) -> None:
    if p.is_file() and not p.name.endswith(".index.json"):
        report.format = "safetensors"
        report.files_checked = 1
        _header(p, p.name, report)
        return
    folder, index = (p.parent, p) if p.is_file() else (p, safetensors_folder.find_index(p))
    _leftovers(folder, report, indexed=index is not None)
    if index is None:
        files = sorted(e.name for e in os.scandir(folder) if e.name.endswith(SUFFIX) and e.is_file())
        report.format = "safetensors-folder"
        report.files_checked = len(files)
        for rel in files:
            _header(folder / rel, rel, report)
        return
    report.format = "hf-sharded"
    _verify_index(folder, index, report)


def _verify_index(folder: Path, index: Path, report: VerifyReport) -> None:
    """Every shard the index names exists, is safe, complete, and holds exactly what the index says."""
    try:
        weight_map, index_metadata = safetensors_folder.read_index(index)
    except CheckpointError as exc:
        report.error(exc.message, index.name)
        return
    shard_of: dict[str, str] = {}
    checked: dict[str, str | None] = {}  # index value -> normalized shard path (None: refused)
    for name, rel in weight_map.items():
        key = rel if isinstance(rel, str) else repr(rel)
        if key not in checked:
            try:
                checked[key] = safetensors_folder.safe_member(folder, rel, what=f"index {index.name} entry for tensor {name!r}")
            except CheckpointError as exc:
                checked[key] = None
                report.error(exc.message, index.name, name)
        if checked[key] is not None:
            shard_of[name] = checked[key]
    shards = sorted(set(shard_of.values()))
    report.files_checked = len(shards)
    headers: dict[str, SafetensorsHeader] = {}
    for rel in shards:
        kind = file_kind(folder / rel)
        if kind is not None:
            users = [n for n, r in shard_of.items() if r == rel]
            report.error(
                f"Cannot verify {folder}: shard {rel} named by {index.name} is {safetensors_folder.shard_state(kind)} "
                f"(it should hold {len(users)} tensors, e.g. {users[0]!r}). "
                f"{'Download the missing shard.' if kind == 'missing' else 'Replace it with the shard file.'}",
                rel,
                users[0],
            )
            continue
        header = _header(folder / rel, rel, report)
        if header is not None:
            headers[rel] = header

    home: dict[str, str] = {}
    for rel, header in headers.items():
        for info in header.tensors:
            if info.name in home:
                report.error(
                    f"Cannot verify {folder}: tensor {info.name!r} is stored in two shards ({home[info.name]} and {rel}). "
                    "Remove the stale copy or regenerate the checkpoint.",
                    rel,
                    info.name,
                )
                continue
            home[info.name] = rel
            report.tensor_bytes += info.nbytes if shard_of.get(info.name) == rel else 0
    for name, rel in shard_of.items():
        if rel in headers and home.get(name) != rel:
            where = f"it is in {home[name]}" if name in home else "the shard does not hold it"
            report.error(
                f"Cannot verify {folder}: {index.name} says tensor {name!r} is in {rel}, but {where}. Regenerate the index or re-download the shards.",
                rel,
                name,
            )
    report.tensors = sum(1 for name, rel in shard_of.items() if home.get(name) == rel)

    unlisted = [n for n, rel in home.items() if n not in shard_of]
    if unlisted:
        report.warning(
            f"{len(unlisted)} tensors stored in shards are not listed in {index.name} and are ignored (e.g. {unlisted[0]!r}).",
            home[unlisted[0]],
            unlisted[0],
        )
    stray = sorted(e.name for e in os.scandir(folder) if e.name.endswith(SUFFIX) and e.name not in headers and e.name not in shards)
    if stray:
        report.warning(f"{len(stray)} .safetensors files in the folder are not named by {index.name} and are ignored: {', '.join(stray[:5])}.")
    declared = index_metadata.get("total_size")
    if report.ok and type(declared) is int and declared != report.tensor_bytes:
        report.warning(
            f"{index.name} declares total_size {declared} but its tensors hold {report.tensor_bytes} bytes. "
            "Loaders ignore it; regenerate the index to fix it.",
            index.name,
        )
