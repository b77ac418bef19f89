"""Re-reading a finished conversion and comparing every output tensor with what its sources make it.

`check_outputs(plan)` opens the destination like any checkpoint (so its headers and index are
validated too) and, group by group: byte-level outputs must equal the source byte ranges their recipe
names (compared by SHA-256 in bounded chunks); cast outputs must equal a fresh cast of the source (bit
for bit, i.e. within the dtype's rounding of the source values, whose largest absolute difference is
reported); computed outputs must equal the group's op re-applied to the source tensors (row jobs re-applied
by row chunks with numpy, as the engine ran them: no torch). Source values
the output's dtype cannot hold are counted again, independently of the run (the `overflow` column): such
an output matches its planned cast yet is not the source's values. The result is one row per output
tensor: `OutputCheck.frame()` is the DataFrame `RunReport.verification` holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..digest import tensor_sha256
from ..dtypes import DTYPE_BITS, is_float, to_torch
from ..errors import WorkbenchError
from ..overflow import attributed, collect, count_torch, may_overflow
from ..planning.schedule import CAST, COPY, PIECES, ROWS
from .sources import SourceFiles

CHUNK_BYTES = 16 << 20
COLUMNS = ("tensor", "check", "status", "max_abs_diff", "overflow", "detail")


@dataclass
class OutputCheck:
    """Per-output-tensor verdicts of a verification; `ok` when none is a mismatch or missing."""

    dest: str
    # (tensor, check, status, max_abs_diff, overflow: source values the output's dtype cannot hold, detail)
    rows: list[tuple[str, str, str, float | None, int, str]] = field(default_factory=list)
    # what the output was also checked against, besides the plan (`output.statement`), e.g. "the llama.cpp GGUF (llama)
    # statement (292 tensors; every source tensor accounted for)"; None when the format states nothing
    statement: str | None = None
    # what the output could not be checked against, and why ("not checked against transformers: ..."); None when nothing
    unchecked: str | None = None

    @property
    def ok(self) -> bool:
        return all(row[2] == "ok" for row in self.rows)

    @property
    def mismatches(self) -> list[str]:
        """Output tensors that are missing or differ from what their sources make them."""
        return [row[0] for row in self.rows if row[2] != "ok"]

    @property
    def overflowed(self) -> dict[str, int]:
        """Output tensors whose source holds values their dtype cannot (they became ±inf, saturated, NaN or wrapped)."""
        return {row[0]: row[4] for row in self.rows if row[4]}

    def largest_difference(self) -> tuple[str, float] | None:
        """(tensor, its max_abs_diff) for the output farthest from its source values; None when none was measured."""
        measured = [(row[3], row[0]) for row in self.rows if row[3] is not None]
        if not measured:
            return None
        diff, name = max(measured, key=lambda item: (item[0], item[1]))
        return name, diff

    def summary(self) -> str:
        """Two lines: how many outputs were re-read, how, and the verdict; the largest difference and any overflow."""
        kinds: dict[str, int] = {}
        for row in self.rows:
            kinds[row[1]] = kinds.get(row[1], 0) + 1
        how = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        if self.ok:
            line = f"verify: {len(self.rows)} output tensors re-read and compared with the source ({how}): all match"
            if self.statement is not None:
                line += f", and with {self.statement}"
            if self.unchecked is not None:
                line += f"; {self.unchecked}"
            largest = self.largest_difference()
            if largest is not None:
                line += f"\n  largest absolute difference from the source values: {largest[1]:g} ({largest[0]})"
            overflowed = self.overflowed
            if overflowed:
                line += (f"; {sum(overflowed.values())} source values in {_count(len(overflowed), 'tensor')} overflowed their dtype "
                         "(the `overflow` column): the output equals the planned cast, not the source values")
            return line
        bad = self.mismatches
        return (f"verify: {len(bad)} of {len(self.rows)} output tensors do NOT match the source "
                f"(e.g. {bad[0]!r}); the output in {self.dest} is not a faithful conversion")

    def frame(self) -> Any:
        """The rows as a DataFrame indexed by tensor (imports pandas)."""
        import pandas as pd

        return pd.DataFrame(self.rows, columns=list(COLUMNS)).set_index("tensor")


class _Bytes:
    """Row-major byte ranges of tensors of one catalog: preads when located, else one whole read (cached).

    `on_read(nbytes)` is told of every range read (progress; raising from it stops the check)."""

    def __init__(self, catalog: Catalog, on_read: Callable[[int], None] | None = None) -> None:
        self.catalog = catalog
        self.files = SourceFiles()
        self._whole: tuple[str, bytes] | None = None
        self.on_read = on_read

    def read(self, info: TensorInfo, begin: int, end: int) -> bytes:
        if self.on_read is not None:
            self.on_read(end - begin)
        where = self.catalog.locate(info.name)
        if where is not None:
            from ..iostats import read_at

            path, start, _ = where
            return read_at(self.files.fd(path), end - begin, start + begin)
        if self._whole is None or self._whole[0] != info.name:
            self._whole = (info.name, self.catalog.read_bytes(info.name))
        return self._whole[1][begin:end]

    def close(self) -> None:
        self.files.close()
        self._whole = None


def _chunks(begin: int, end: int, size: int = CHUNK_BYTES):
    for start in range(begin, end, size):
        yield start, min(end, start + size)


def _check_copy(group, source: _Bytes, output: _Bytes, out_catalog: Catalog, rows: list, skip: frozenset[str] = frozenset()) -> None:
    inputs = {t.name: t for t in group.inputs}
    single = group.inputs[0] if len(group.inputs) == 1 else None
    for out_name, pieces in group.recipe.items():
        if out_name in skip:
            continue
        digest = hashlib.sha256()
        for piece in pieces:
            info = single if single is not None else inputs[piece.source]
            for a, b in _chunks(piece.begin, piece.end):
                digest.update(source.read(info, a, b))
        same = digest.hexdigest() == tensor_sha256(out_catalog, out_name, CHUNK_BYTES)
        if output.on_read is not None:
            output.on_read(out_catalog[out_name].nbytes)
        rows.append((out_name, "bytes", "ok" if same else "mismatch", 0.0 if same else None, 0,
                     "" if same else "bytes differ from the source ranges the plan names"))


def _check_cast(group, source: _Bytes, output: _Bytes, out_catalog: Catalog, rows: list, skip: frozenset[str] = frozenset()) -> None:
    for src, out in zip(group.inputs, group.outputs, strict=True):  # one pair, or a cast run's (`planning.runs`)
        if out.name not in skip:
            _check_cast_one(src, out_catalog[out.name], source, output, rows)


def _check_cast_one(src: TensorInfo, out: TensorInfo, source: _Bytes, output: _Bytes, rows: list) -> None:
    import torch

    src_dtype, out_dtype = to_torch(src.dtype), to_torch(out.dtype)
    per = max(1, CHUNK_BYTES // max(DTYPE_BITS[src.dtype] // 8, 1))
    counted = may_overflow(src.dtype, out.dtype)
    equal, worst, overflowed = True, 0.0, 0
    for start in range(0, src.numel, per):
        count = min(per, src.numel - start)
        a = torch.frombuffer(bytearray(source.read(src, start * src_dtype.itemsize, (start + count) * src_dtype.itemsize)), dtype=src_dtype)
        b = torch.frombuffer(bytearray(output.read(out, start * out_dtype.itemsize, (start + count) * out_dtype.itemsize)), dtype=out_dtype)
        expected = a.to(out_dtype)
        equal = equal and bool(torch.equal(expected.view(torch.uint8), b.view(torch.uint8)))
        if counted:
            overflowed += count_torch(a, src.dtype, out.dtype, expected)[0]
        if is_float(src.dtype) or is_float(out.dtype):
            worst = max(worst, _max_abs_diff(b, a))
    rows.append((out.name, "cast", "ok" if equal else "mismatch", worst, overflowed,
                 "" if equal else f"differs from the source cast to {out.dtype}"))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _max_abs_diff(got: Any, source: Any) -> float:
    """Largest |got - source| over the elements; a NaN made from a number counts as an infinite difference."""
    import torch

    got, source = got.double(), source.double()
    diff = (got - source).abs()
    made_nan = torch.isnan(got) & ~torch.isnan(source)
    if bool(made_nan.any()):
        return float("inf")
    diff = diff[~torch.isnan(diff)]
    return float(diff.max()) if diff.numel() else 0.0


def _check_compute(group, source: _Bytes, output: _Bytes, out_catalog: Catalog, rows: list) -> None:
    import torch

    tensors = {}
    for info in group.inputs:
        data = bytearray(source.read(info, 0, info.nbytes))
        dtype = to_torch(info.dtype)
        tensors[info.name] = torch.frombuffer(data, dtype=dtype).reshape(info.shape) if info.numel else torch.empty(info.shape, dtype=dtype)
    with collect() as found:
        results = group.apply(tensors)
    overflowed = {name: entry[0] for name, entry in attributed(found, [t.name for t in group.outputs], group.label).items()}
    for planned in group.outputs:
        got = out_catalog[planned.name]
        expected = results[planned.name].detach().contiguous()
        written = output.read(got, 0, got.nbytes) if expected.numel() else b""
        same = bytes(expected.reshape(-1).view(torch.uint8).numpy()) == written if expected.numel() else True
        diff = None
        if expected.is_floating_point() and expected.numel():
            actual = torch.frombuffer(bytearray(written), dtype=expected.dtype).reshape(expected.shape)
            delta = (actual.double() - expected.double()).abs()
            diff = float(delta[~torch.isnan(delta)].max()) if delta.numel() else 0.0
        rows.append((planned.name, "compute", "ok" if same else "mismatch", 0.0 if same else diff,
                     overflowed.get(planned.name, 0), "" if same else "differs from the op re-applied to the source"))


def _check_pieces(group, source: _Bytes, output: _Bytes, out_catalog: Catalog, rows: list) -> None:
    """An output the engine made piece by piece (`mapper.pieces`), re-computed a piece at a time from the source and
    compared with the bytes at that piece's range: memory stays one piece's, as in the run."""
    import torch

    from ..mapper.pieces import output_pieces

    pieces = output_pieces(group)
    if pieces is None:  # the planner made a PIECES step of it, so it is one; anything else is re-applied whole
        _check_compute(group, source, output, out_catalog, rows)
        return
    got = out_catalog[pieces.output.name]

    def read(info, rows=None):  # noqa: ANN001, ANN202 - a piece's source tensor (or dim-0 rows of it), from the source's bytes
        begin, end, shape = 0, info.nbytes, info.shape
        if rows is not None:
            row = info.nbytes // info.shape[0]
            begin, end, shape = rows[0] * row, rows[1] * row, (rows[1] - rows[0],) + tuple(info.shape[1:])
        data = bytearray(source.read(info, begin, end))
        return torch.frombuffer(data, dtype=to_torch(info.dtype)).reshape(shape)

    same, worst, overflowed, at = True, 0.0, 0, 0
    for piece in pieces.pieces:
        with collect() as found:
            expected = piece.compute(read).contiguous()
        overflowed += sum(entry[0] for entry in attributed(found, [got.name], group.label).values())
        size = piece.rows * pieces.row_bytes
        written = output.read(got, at, at + size)
        if bytes(expected.reshape(-1).view(torch.uint8).numpy()) != written:
            same = False
            if expected.is_floating_point():
                actual = torch.frombuffer(bytearray(written), dtype=expected.dtype).reshape(expected.shape)
                delta = (actual.double() - expected.double()).abs()
                worst = max(worst, float(delta[~torch.isnan(delta)].max()) if delta.numel() else 0.0)
        at += size
    rows.append((got.name, "compute", "ok" if same else "mismatch", 0.0 if same else worst, overflowed,
                 "" if same else "differs from the op re-applied to the source, piece by piece"))


def _check_rows(group, source: _Bytes, output: _Bytes, out_catalog: Catalog, rows: list) -> None:
    """An output the engine converted by row chunks (the row job its op offers, `mapper.row_jobs`), converted again
    the same way a chunk at a time and compared byte for byte; a "compute" row like any op re-applied to the source."""
    from ..mapper.row_jobs import row_job

    job = row_job(group)
    if job is None:  # the planner made a ROWS step of it, so it is one; anything else is re-applied by torch
        _check_compute(group, source, output, out_catalog, rows)
        return
    outputs = getattr(job, "outputs", None)  # one per input (a stacked tensor unstacked): each checked on its own
    if outputs is not None:
        for k, output_info in enumerate(outputs):
            _check_row_inputs(job, (k,), out_catalog[output_info.name], source, output, rows)
        return
    _check_row_inputs(job, tuple(range(len(job.inputs))), out_catalog[job.output.name], source, output, rows)


def _check_row_inputs(job, inputs: tuple[int, ...], got, source: _Bytes, output: _Bytes, rows: list) -> None:
    """Convert the job's `inputs` again (into consecutive rows of output `got`) and compare; one row of `rows`."""
    import numpy as np

    from ..dtypes import numpy_dtype

    per = job.chunk_rows(CHUNK_BYTES)
    in_row, out_row = job.in_row, job.out_row
    convert = job.converter(per)
    same, worst, overflowed, at = True, 0.0, 0, 0
    for k in inputs:
        info = job.inputs[k]
        listed = source.catalog.tensors.get(info.name)
        base = info.begin - listed.begin if listed is not None and info.end - info.begin != listed.nbytes else 0  # a part's offset
        whole = [source.read(extra, 0, extra.nbytes) for extra in job.whole(k)]
        for first in range(0, job.rows, per):
            n = min(per, job.rows - first)
            data, count, _ = convert(k, first, source.read(info, base + first * in_row, base + (first + n) * in_row), whole)
            written = output.read(got, at, at + n * out_row)
            overflowed += count
            if data.tobytes() != written:
                same = False
                if job.value_dtype is not None:  # how far the written values are from the conversion's
                    kind = numpy_dtype(job.value_dtype)
                    delta = np.abs(np.frombuffer(written, kind).astype(np.float64) - data.view(kind).astype(np.float64))
                    worst = max(worst, float(np.nanmax(delta)) if delta.size else 0.0)
            at += n * out_row
    diff = 0.0 if same else worst if job.value_dtype is not None else None
    rows.append((got.name, "compute", "ok" if same else "mismatch", diff, overflowed,
                 "" if same else "differs from the op re-applied to the source"))


def _groups(plan) -> list:
    """The plan's steps, a group cut into parts for several ranks (`planning.parts`) once: each output checked once."""
    return [s for s in plan.steps if s.part is None or not s.part[0]]


def check_bytes(plan) -> int:
    """About how many bytes `check_outputs(plan)` reads: every group's inputs and outputs (for a progress bar)."""
    return sum(t.nbytes for step in _groups(plan) for t in (*step.group.inputs, *step.group.outputs))


def check_outputs(plan, on_read: Callable[[int], None] | None = None) -> OutputCheck:
    """Re-read every output of a finished conversion of `plan` and compare it with its sources.

    `on_read(nbytes)` is called as ranges are read (about `check_bytes(plan)` in all); raise from it to stop."""
    from ..formats import open_catalog

    remote = getattr(plan, "remote", None)
    result = OutputCheck(remote.read_url if remote is not None else str(plan.dest))
    try:
        if remote is not None:  # the uploaded objects, read back by range (the spool copies are gone)
            out_catalog = open_catalog(remote.read_url)
        else:
            out_catalog = plan.output_format.open_written(plan.dest, [f.layout for f in plan.output_file_list])
        if out_catalog is None:
            out_catalog = open_catalog(plan.dest)
    except WorkbenchError as exc:
        result.rows = [(t.name, "open", "missing", None, 0, exc.message) for s in _groups(plan) for t in s.group.outputs]
        return result
    try:
        fresh = _fresh_source(plan, result)
    except WorkbenchError as exc:  # the server cannot be reached now: the committed output stays, unverified
        fresh = None
        result.rows = [(t.name, "source", "unchecked", None, 0, f"the source could not be re-read to check this output "
                        f"({exc.message})") for s in _groups(plan) for t in s.group.outputs]
    if fresh is None:
        if out_catalog.reader is not None:
            out_catalog.reader.close()
        return result
    source, output = _Bytes(fresh, on_read), _Bytes(out_catalog, on_read)
    try:
        for step in _groups(plan):
            group = step.group
            absent = [t for t in group.outputs if t.name not in out_catalog or _meta(out_catalog[t.name]) != _meta(t)]
            for t in absent:
                found = out_catalog.tensors.get(t.name)
                detail = "not in the output" if found is None else f"is {found.dtype} {list(found.shape)}, planned {t.dtype} {list(t.shape)}"
                result.rows.append((t.name, step.kind, "missing" if found is None else "mismatch", None, 0, detail))
            if absent and step.run:  # a run (`planning.runs`): its tensors are independent, the others still checked
                (_check_copy if step.kind == COPY else _check_cast)(group, source, output, out_catalog, result.rows,
                                                                   frozenset(t.name for t in absent))
                continue
            if absent:
                continue
            check = {COPY: _check_copy, CAST: _check_cast, ROWS: _check_rows, PIECES: _check_pieces}.get(step.kind, _check_compute)
            check(group, source, output, out_catalog, result.rows)
        result.rows += plan.output_format.check_generated([f.layout for f in plan.output_file_list], out_catalog)
        result.rows += _statement_rows(plan, out_catalog, result)
        lossy = plan.output_format.lossy_errors(plan.source, out_catalog)
        result.rows = [(r[0], r[1] + "+dequantised", r[2], lossy[r[0]], *r[4:]) if r[0] in lossy else r for r in result.rows]
    finally:
        source.close()
        output.close()
        if out_catalog.reader is not None:
            out_catalog.reader.close()
        if fresh is not plan.source and fresh.reader is not None:
            fresh.reader.close()
    return result


def _statement_rows(plan, out_catalog: Catalog, result: OutputCheck) -> list[tuple[str, str, str, float | None, int, str]]:
    """Rows for what the written output and the conversion do not share with the format's own statement of the output
    (`output.statement`): a stated tensor missing, an unstated one present, one of another dtype or shape, a source tensor
    dropped without a word. None when the format states nothing beyond the plan; `result.statement` names what was checked."""
    from ..output.statement import statement_rows

    statement = plan.output_format.statement()
    written = {name: _meta(info) for name, info in out_catalog.tensors.items()}
    model = statement is None
    if model:
        statement = _model_statement(plan, written)
        if statement is None:
            return []
    if statement.why_unchecked:
        result.unchecked = f"not checked against {statement.family}: {statement.why_unchecked}"
        return []
    if model:
        source = plan.source.tensors  # a tensor the statement lacks that the source holds too is not this conversion's doing
        rows = [row for row in statement_rows(statement, written, [], set())
                if row[0] in statement.tensors or row[0] not in source or tuple(source[row[0]].shape) != tuple(written[row[0]][1])]
        why = _not_stated(statement, plan, rows)
        if why is not None:
            result.unchecked = f"not checked against {statement.family}: {why}"
            return []
        result.statement = f"the {statement.family} statement ({_count(len(statement.tensors), 'tensor')})"
        return rows
    read = {t.name for step in plan.steps for t in step.group.inputs}
    accounted = "; every source tensor made into one or left out on purpose" if statement.accounted is not None else ""
    result.statement = f"the {statement.family} statement ({_count(len(statement.tensors), 'tensor')}{accounted})"
    return statement_rows(statement, written, list(plan.source.tensors), read)


def _model_statement(plan, written: dict) -> Any:
    """For an output that carries a config.json (an HF model folder), what transformers declares the folder must hold
    (`mapper.presets.transformers_declared`), the stated layout nearest the written one; `unchecked` (why) when transformers
    cannot say; None for an output without config.json."""
    import json

    from ..output.statement import nearest_statement, unchecked

    if plan.dest is None or "config.json" not in plan.extras:
        return None
    from ..errors import MapperError
    from ..mapper.presets.transformers_declared import declared_layouts
    from ..planning.config_dtype import read_config

    remote = getattr(plan, "remote", None)
    if remote is not None:  # read back from the destination: the spool copy is gone
        raw = _remote_config(remote.read_url)
        if raw is None:
            return unchecked("transformers", f"the output's config.json could not be read back from {remote.read_url}")
    else:
        raw = read_config(plan.dest / "config.json")
    try:
        config = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        return unchecked("transformers", "the output's config.json is not a JSON object")
    try:
        family, layouts, optional = declared_layouts(config)
    except MapperError as exc:
        return unchecked("transformers", exc.message)
    return nearest_statement(family, layouts, optional, written)


def _remote_config(url: str) -> bytes | None:
    """The bytes of config.json under a remote output `url` (`s3://`, `hf://…@commit`), or None when it is missing,
    implausibly large or cannot be read."""
    from ..formats.remote import open_store
    from ..planning.config_dtype import MAX_CONFIG_BYTES

    try:
        store = open_store(url)
        info = store.file("config.json")
        if info is None or info.size > MAX_CONFIG_BYTES:
            return None
        return bytes(store.read("config.json", 0, info.size))
    except (WorkbenchError, OSError):
        return None


def _not_stated(statement: Any, plan, rows: list) -> str | None:
    """Why a transformers statement the output disagrees with (`rows`) says nothing about this output, or None when the
    disagreement is the output's fault: config.json did not describe the source either (a config that leaves the
    sizes to defaults), or the mapper changed the layout config.json describes without stating a config edit."""
    if not rows:
        return None
    source = plan.source.tensors
    for name, (_, shape) in statement.tensors.items():
        info = source.get(name)
        if name not in statement.optional and (info is None or tuple(info.shape) != tuple(shape)):
            found = "missing" if info is None else f"{list(info.shape)}, stated {list(shape)}"
            return f"config.json does not describe the source either ({name!r} {found}), so it states nothing about the output"
    change = _layout_change(plan)
    if change is not None:
        return f"the mapper {change}, and config.json describes the source's layout ({rows[0][0]!r} {rows[0][2]})"
    return None


def _layout_change(plan) -> str | None:
    """How the mapper changes the layout config.json describes (`planning.extras.layout_change`), when it states no
    config edit of its own; None when the output keeps the source's layout (copies, casts, drops, in-place merges)."""
    from ..mapper.config_update import config_updates
    from ..planning.extras import layout_change

    if plan.mapper is None or config_updates(plan.mapper)[0]:
        return None
    return layout_change(plan.binding.groups)


def _fresh_source(plan, result: OutputCheck) -> Catalog | None:
    """The catalog the outputs are compared with: for a remote source, reopened from the server with the header cache
    bypassed, so a cached header that was altered cannot vouch for the output it produced; None (rows added) when
    the source's headers on the server differ from those the conversion used."""
    if not plan.source.url:
        return plan.source
    from ..formats.remote_safetensors import reopen_uncached

    fresh = reopen_uncached(plan.source.url)
    used = {t.name for step in plan.steps for t in step.group.inputs}
    changed = sorted(n for n in used if n not in fresh or _place(fresh[n]) != _place(plan.source[n]))
    if not changed:
        return fresh
    if fresh.reader is not None:
        fresh.reader.close()
    result.rows = [(n, "source", "mismatch", None, 0, "the source's header on the server places this tensor differently "
                    "from the header the conversion used (an altered or stale header cache): convert again")
                   for n in changed]
    return None


def _place(info: TensorInfo) -> tuple:
    return info.dtype, tuple(info.shape), info.file, info.begin, info.end


def _meta(info: TensorInfo) -> tuple[str, tuple[int, ...]]:
    return info.dtype, tuple(info.shape)


__all__ = ["OutputCheck", "check_bytes", "check_outputs"]
