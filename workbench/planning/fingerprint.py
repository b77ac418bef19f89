"""Fingerprints that identify a plan, so workers and resumed runs can prove they execute the same one.

The layout fingerprint covers everything that decides the output bytes (source tensors and their
locations, the source files' sizes and modification times, the groups and their recipes, the mapper's
export, every output header); the run fingerprint adds the rank assignment. Both are independent of
PYTHONHASHSEED and of the machine.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from ..catalog import Catalog
from ..mapper.groups import ByteSlice
from ..mapper.recipes import LazyRecipe
from .runs import CastRun, CopyRun
from .schedule import Step
from .sharding import OutputFile
from .span_runs import SpanRun

_BATCH = 2048


def _mtime_ns(catalog: Catalog, rel: str) -> object:
    """A source file's modification time: a source edited after an interrupted run makes a different plan,
    so the shards written from its old bytes are never kept by the resumed run. A remote source gives its
    version tag (ETag, LFS sha256) instead."""
    remote_state = getattr(catalog.reader, "file_state", None)
    if remote_state is not None:
        return remote_state(rel)
    path = catalog.root / rel if catalog.root.is_dir() else catalog.root
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def source_states(catalog: Catalog) -> dict[str, list]:
    """Each source file's size and state (modification time, or a remote file's version tag) as the plan saw them:
    the manifest keeps them so that a resume refused for a changed source can name the file that changed."""
    out = {}
    for rel, info in sorted(catalog.files.items()):
        state = _mtime_ns(catalog, rel)
        out[rel] = [info.size, list(state) if isinstance(state, tuple) else state]
    return out


def changed_sources(before: object, catalog: Catalog) -> list[str]:
    """'file (what changed)' for each source file whose recorded state (`source_states`) differs from now."""
    if not isinstance(before, dict):
        return []
    now = source_states(catalog)
    changed = []
    for rel, old in sorted(before.items()):
        new = now.get(rel)
        if new is None:
            changed.append(f"{rel} (no longer in the source)")
        elif new != old and isinstance(old, list) and len(old) == 2:
            what = []
            if new[0] != old[0]:
                what.append(f"size {old[0]} -> {new[0]}")
            if new[1] != old[1]:
                kind = "version" if isinstance(new[1], list) else "modification time"
                old_tag, new_tag = (v[1] if isinstance(v, list) and len(v) == 2 else v for v in (old[1], new[1]))
                what.append(f"{kind} {old_tag!r} -> {new_tag!r}" if kind == "version" else kind)
            changed.append(f"{rel} ({', '.join(what) or 'changed'})")
    return changed


def layout_fingerprint(catalog: Catalog, steps: list[Step], files: list[OutputFile], mapper_json: str | None) -> str:
    """A hex digest of what decides the output bytes of a plan."""
    digest = hashlib.sha256(b"workbench-layout-v1\n")
    digest.update((mapper_json or "").encode())
    for rel, info in sorted(catalog.files.items()):
        digest.update(f"\nsrc {rel} {info.size} {_mtime_ns(catalog, rel)}".encode())
    lines: list[str] = []
    shapes: dict[tuple[int, ...], str] = {}  # str(shape), once per distinct shape
    heads: dict[tuple[str, str | None, type, str], str] = {}  # a step line's start, once per kind, cast, op type, label
    for step in steps:
        group = step.group
        inputs = group.inputs
        recipe = group.recipe
        key = (step.kind, group.chunk_cast, type(group.op), group.label)
        head = heads.get(key)
        if head is None:
            head = heads[key] = f"\nstep {step.kind} {group.chunk_cast} {type(group.op).__name__} {group.label} <"
        if type(recipe) is CopyRun or type(recipe) is SpanRun:  # neighbours copied (whole or in ranges): once per run
            lines.append(f"{head}{recipe.text()}> <>")
        elif type(group.op) is CastRun:  # neighbours cast: the same, once per run
            lines.append(f"{head}{group.op.text()}> <>")
        elif len(inputs) == 1:  # the common case, spelled out: this loop runs once per tensor
            t = inputs[0]
            shape = shapes.get(t.shape) if type(t.shape) is tuple else None
            if shape is None:
                shape = str(t.shape)
                if type(t.shape) is tuple:
                    shapes[t.shape] = shape
            if recipe is None:
                text = ""
            elif len(recipe) == 1 and len(pieces := next(iter(recipe.values()))) == 1:  # _recipe_text's common case, inlined
                p = pieces[0]
                text = f"{next(iter(recipe))}={p.source}[{p.begin}:{p.end}]"
            else:
                text = _recipe_text(recipe)
            lines.append(f"{head}{t.name}|{t.dtype}|{shape}|{t.file}|{t.begin}|{t.end}> <{text}>")
        else:
            texts = []
            for t in inputs:
                shape = shapes.get(t.shape) if type(t.shape) is tuple else None
                if shape is None:
                    shape = str(t.shape)
                    if type(t.shape) is tuple:
                        shapes[t.shape] = shape
                texts.append(f"{t.name}|{t.dtype}|{shape}|{t.file}|{t.begin}|{t.end}")
            ins = ";".join(texts)
            text = "" if recipe is None else _recipe_text(recipe)
            lines.append(f"{head}{ins}> <{text}>")
        if len(lines) >= _BATCH:
            digest.update("".join(lines).encode())
            lines.clear()
    digest.update("".join(lines).encode())
    for f in files:
        digest.update(f"\nout {f.name} ".encode())
        digest.update(hashlib.sha256(f.layout.header).digest())
    return digest.hexdigest()


def _recipe_text(recipe: Mapping[str, tuple[ByteSlice, ...]]) -> str:
    if type(recipe) is LazyRecipe:  # a shared recipe: the same text from a format made once per shape, no ByteSlices
        return recipe.text()
    if len(recipe) == 1:
        ((out, pieces),) = recipe.items()
        if len(pieces) == 1:
            p = pieces[0]
            return f"{out}={p.source}[{p.begin}:{p.end}]"
    return ";".join(f"{o}=" + ",".join(f"{p.source}[{p.begin}:{p.end}]" for p in ps) for o, ps in recipe.items())


def run_fingerprint(layout: str, files: list[OutputFile], nproc: int) -> str:
    """A hex digest of the layout plus who writes which file."""
    text = layout + f"\nnproc {nproc}\n" + "\n".join(f"{f.name} {f.rank}{f.ranks or ''}" for f in files)
    return hashlib.sha256(text.encode()).hexdigest()
