"""`plan()`: bind, schedule, lay out, assign ranks and check the destination, from metadata only."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..catalog import Catalog
from ..errors import PlanError
from ..mapper.files import code_digest
from ..mapper.groups import Binding, Problem
from .destination import INDEX_NAME, check_destination
from .dtype_policy import apply_dtype
from .fingerprint import layout_fingerprint, run_fingerprint
from .gc_pause import gc_paused
from .model import Plan, PlanOptions
from .ranks import assign_ranks
from .schedule import SourceAccess, build_steps
from .sharding import layout_outputs
from .sizes import parse_size
from .sources import bind, mapper_json, resolve_catalog

DEFAULT_CHUNK = "32MiB"


def _duplicate_outputs(binding: Binding) -> list[Problem]:
    seen: set[str] = set()
    problems = []
    for group in binding.groups:
        for out in group.outputs:
            if out.name in seen:
                problems.append(
                    Problem("error", f"Cannot write output {out.name!r}: two groups produce it. Give one of them another name.",
                            tensor=out.name)
                )
            seen.add(out.name)
    return problems


def _extras_bytes(catalog: Catalog, names: list[str]) -> int:
    total = 0
    for name in names:
        try:
            total += os.path.getsize(catalog.root / name)
        except OSError:
            pass
    return total


OUTPUT_FORMATS = {"safetensors": "safetensors", "hf": "safetensors", "dcp": "dcp"}


def make_options(shard_size: int | str, nproc: int, rest: str, dtype: Any, extras: bool, overwrite: bool,
                 chunk_size: int | str, to: str = "safetensors") -> PlanOptions:
    """Validate and normalise the user's options."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise PlanError(f"Cannot plan with nproc={nproc!r}: it must be a whole number of processes, at least 1.")
    if not isinstance(to, str) or to.lower() not in OUTPUT_FORMATS:
        raise PlanError(f"Cannot plan an output in format {to!r}: choose to='safetensors' (HF shards) or to='dcp' "
                        "(torch.distributed.checkpoint).")
    code = None
    if dtype is not None:
        from ..dtypes import normalize_dtype

        code = normalize_dtype(dtype)
    return PlanOptions(
        shard_size=parse_size(shard_size),
        nproc=nproc,
        rest=rest,
        dtype=code,
        extras=bool(extras),
        overwrite=bool(overwrite),
        chunk_bytes=parse_size(chunk_size, what="chunk size"),
        to=OUTPUT_FORMATS[to.lower()],
    )


def build_plan(
    catalog: Catalog,
    mapper: Any,
    options: PlanOptions,
    dest: str | os.PathLike | None,
    *,
    check_dest: bool = True,
    kept: Iterable[str] = (),
) -> Plan:
    """The plan for validated options. Workers pass `check_dest=False` and the launcher's `kept` list."""
    with gc_paused():
        return _build_plan(catalog, mapper, options, dest, check_dest, kept)


def _build_plan(
    catalog: Catalog, mapper: Any, options: PlanOptions, dest: str | os.PathLike | None, check_dest: bool,
    kept: Iterable[str],
) -> Plan:
    binding = bind(catalog, mapper, options.rest)
    if options.dtype is not None:
        binding = apply_dtype(binding, options.dtype)
    problems = list(binding.problems) + _duplicate_outputs(binding)
    steps = build_steps(binding.groups, SourceAccess(catalog.reader), options.chunk_bytes)
    if not steps:
        problems.append(Problem("error", "Cannot convert: the mapper produces no tensors (everything is dropped). "
                                          "Check the mapper and the rest= policy."))
    try:
        files, warnings = layout_outputs(steps, options.shard_size, options.to)
    except PlanError as exc:
        problems.append(Problem("error", exc.message, tensor=exc.tensor))
        files, warnings = [], []
    problems += warnings
    if files:
        problems += assign_ranks(files, steps, options.nproc)
    exported = mapper_json(mapper)
    layout_fp = layout_fingerprint(catalog, steps, files, exported)
    extras = list(catalog.extras) if options.extras and catalog.root.is_dir() else []
    committed: list[str] = []  # files written at commit beside the shards (DCP: objects file, .metadata)
    if options.to == "dcp":
        from ..formats.dcp_writer import commit_files, source_objects

        objects, object_warnings = source_objects(catalog.reader) if options.rest == "keep" else ([], [])
        problems += [Problem("warning", w) for w in object_warnings]
        outputs = {t.name for step in steps for t in step.group.outputs}
        for name in sorted({o.name for o in objects} & outputs):
            problems.append(Problem("error", f"Cannot write DCP entry {name!r}: it is both an output tensor and a non-tensor "
                                             "entry of the source. Rename the tensor, or drop the entries with rest='drop'.",
                                    tensor=name))
        committed = commit_files(len(files), bool(objects))
    elif len(files) > 1:
        committed = [INDEX_NAME]  # the HF index, the commit marker of a sharded output
    dest_path = Path(os.path.abspath(dest)) if dest is not None else None
    kept_names = set(kept)
    complete = False
    code = code_digest(mapper)
    if dest_path is not None and check_dest and files:
        sources = [catalog.root / rel if catalog.root.is_dir() else catalog.root for rel in catalog.files]
        state = check_destination(
            dest_path, files, extras + committed, layout_fp, overwrite=options.overwrite, source_root=catalog.root,
            source_files=sources, extra_bytes=_extras_bytes(catalog, extras), code_digest=code,
        )
        problems += state.problems
        kept_names |= state.kept
        complete = state.complete
    for f in files:
        f.kept = f.name in kept_names
    return Plan(
        source=catalog, dest=dest_path, options=options, binding=binding, steps=steps, files=files, problems=problems,
        extras=extras, layout_fingerprint=layout_fp, fingerprint=run_fingerprint(layout_fp, files, options.nproc),
        mapper=mapper, mapper_json=exported, complete=complete, code_digest=code,
    )


def plan(
    source: Any,
    mapper: Any = None,
    *,
    shard_size: int | str = "5GB",
    nproc: int = 1,
    rest: str = "keep",
    dest: str | os.PathLike | None = None,
    dtype: Any = None,
    extras: bool = True,
    overwrite: bool = False,
    chunk_size: int | str = DEFAULT_CHUNK,
    to: str = "safetensors",
) -> Plan:
    """Dry-run a conversion from metadata only; no tensor data is read.

    `source`: a checkpoint path, a Checkpoint or a Catalog. `mapper`: a workbench mapper, a Binding,
    or None to copy every tensor. `shard_size`: bytes or '5GB' / '500MiB'. `rest`: what happens to
    source tensors the mapper does not mention ('keep', 'drop', 'error'). `dtype`: store every
    floating-point output in this dtype. `dest`: checked for leftovers, resumability and free space.
    `chunk_size`: input bytes a chunked cast converts at a time. `to`: 'safetensors' (HF shards + index)
    or 'dcp' (a torch.distributed.checkpoint folder that loads at any world size).
    """
    options = make_options(shard_size, nproc, rest, dtype, extras, overwrite, chunk_size, to)
    with gc_paused():
        return build_plan(resolve_catalog(source), mapper, options, dest)


__all__ = ["Plan", "PlanOptions", "build_plan", "make_options", "plan"]
