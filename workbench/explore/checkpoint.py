"""The user-facing `Checkpoint`: a checkpoint seen as pandas tables, folded layers, diffs, stats and plots.

Opening reads headers only. Tables are built once, on first use, from the catalog; tensor values are
read only when asked for (`load`, `stats`, `diff(values=True)`, `plot_histogram`), one tensor and one
bounded chunk at a time. Nothing here writes to disk.
"""

from __future__ import annotations

import difflib
import html
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..api_types import CheckpointLike
from ..catalog import Catalog, TensorInfo
from ..display import format_bytes, format_shape
from ..dtypes import DTYPE_BITS, to_torch
from ..errors import CheckpointError, WorkbenchError
from ..names import filter_names, no_match_hint
from .layers import Fold, fold_names, natural_key
from .stats import DEFAULT_CHUNK_ELEMENTS, ReadHook, read_located

TENSOR_COLUMNS = ["dtype", "shape", "numel", "nbytes", "file", "begin", "end"]
LAYER_COLUMNS = ["count", "range", "dtype", "shape", "numel", "nbytes", "odd_layers"]
STATS_COLUMNS = ["dtype", "shape", "numel", "min", "max", "mean", "std", "nan", "inf"]
BYTES_BY = ("layer", "file", "dtype")
HTML_LAYER_ROWS = 15


def _layer_key(name: str) -> str:
    """The block a tensor belongs to: the name up to its first numeric segment, else its module path."""
    parts = name.split(".")
    for pos, part in enumerate(parts):
        if part.isdigit() and part.isascii():
            return ".".join(parts[: pos + 1])
    return ".".join(parts[:-1]) if len(parts) > 1 else name


def _format_column(index: pd.Index, values: dict[str, object]) -> pd.Series:
    """One per-tensor fact as a column over `index`: integers stay integers (nullable `Int64` when some
    tensors have no value), other missing values are None or NaN."""
    cells = [values.get(name) for name in index]
    present = [v for v in cells if v is not None]
    if present and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in present):
        return pd.Series(cells, index=index, dtype="int64" if len(present) == len(cells) else "Int64")
    if present and all(isinstance(v, (float, np.floating)) for v in present):
        return pd.Series(cells, index=index, dtype="float64")
    return pd.Series(cells, index=index, dtype=object)


@dataclass
class Summary:
    """Headline figures of a checkpoint: totals, parameters and bytes per dtype, shards, largest tensors."""

    format: str
    path: str
    n_tensors: int
    parameters: int
    total_bytes: int
    by_dtype: pd.DataFrame
    files: pd.DataFrame
    largest: pd.DataFrame

    def headline(self) -> str:
        """One line: counts, size and parameters."""
        return (
            f"{self.n_tensors:,} tensors in {len(self.files):,} file(s), {format_bytes(self.total_bytes)}, "
            f"{self.parameters:,} parameters"
        )

    def __repr__(self) -> str:
        return "\n".join(
            [
                f"Summary of {self.format} checkpoint {self.path}",
                "  " + self.headline(),
                "",
                "by dtype:",
                self.by_dtype.to_string(),
                "",
                "files:",
                self.files.to_string(),
                "",
                "largest tensors:",
                self.largest.to_string(),
            ]
        )

    def _repr_html_(self) -> str:
        return (
            f"<div><b>{html.escape(self.format)}</b> checkpoint <code>{html.escape(self.path)}</code><br>"
            f"{html.escape(self.headline())}"
            f"<h4>By dtype</h4>{self.by_dtype.to_html()}"
            f"<h4>Files</h4>{self.files.to_html()}"
            f"<h4>Largest tensors</h4>{self.largest.to_html()}</div>"
        )


class Checkpoint:
    """A checkpoint opened from its headers: tables of its tensors and files, folded layers, diff,
    on-demand value statistics and plots. Build one with `open_checkpoint(path)`.
    """

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    # --- identity -------------------------------------------------------------------------------
    @property
    def format(self) -> str:
        """The detected on-disk layout ('safetensors', 'hf-sharded', ...)."""
        return self.catalog.format

    @property
    def path(self) -> Path:
        """The file or folder that was opened."""
        return self.catalog.root

    @property
    def location(self) -> str:
        """Where the checkpoint is, for people: the URL of a remote one, else the path."""
        return self.catalog.location

    def __len__(self) -> int:
        return len(self.catalog)

    def __contains__(self, name: object) -> bool:
        return name in self.catalog

    def close(self) -> None:
        """Release open file descriptors (reads reopen them on demand)."""
        if self.catalog.reader is not None:
            self.catalog.reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- tables ----------------------------------------------------------------------------------
    @cached_property
    def tensors(self) -> pd.DataFrame:
        """One row per tensor, indexed by name, in on-disk order: dtype (safetensors code), shape (tuple),
        numel, nbytes, file, begin, end (absolute byte offsets, end exclusive), then the per-tensor facts
        the format knows (`format_columns`, e.g. a pipeline DCP's `stage`, a torch file's `shared_with`;
        None/NaN/<NA> where a tensor has no value)."""
        infos = list(self.catalog.tensors.values())
        dtypes = [t.dtype for t in infos]
        shapes = [t.shape for t in infos]
        index = pd.Index([t.name for t in infos], name="name")
        frame = pd.DataFrame(
            {
                "dtype": dtypes,
                "shape": pd.Series(shapes, index=index, dtype=object),
                "numel": np.fromiter((math.prod(s) for s in shapes), dtype=np.int64, count=len(shapes)),
                "file": [t.file for t in infos],
                "begin": np.fromiter((t.begin for t in infos), dtype=np.int64, count=len(infos)),
                "end": np.fromiter((t.end for t in infos), dtype=np.int64, count=len(infos)),
            },
            index=index,
        )
        bits = frame["dtype"].map(DTYPE_BITS).astype("int64")
        frame["nbytes"] = (frame["numel"] * bits + 7) // 8
        frame = frame[TENSOR_COLUMNS]
        for column, values in zip(self.format_columns, self.catalog.columns.values(), strict=True):
            frame[column] = _format_column(index, values)
        return frame

    @cached_property
    def metadata(self) -> pd.DataFrame:
        """The checkpoint's header key/values, one row per key: for a GGUF file its type ('UINT32', 'STRING',
        'ARRAY[STRING]' ...), count (items of an array) and value (arrays summarised: type, length, first items);
        for other formats the header metadata (a safetensors `__metadata__`) as `value`."""
        listing = getattr(self.catalog.reader, "key_values", None)
        if listing is not None:
            rows = [(v.key, v.type, v.count, v.shown()) for v in listing()]
            return pd.DataFrame.from_records(rows, columns=["key", "type", "count", "value"]).set_index("key")
        rows = [(k, v) for k, v in self.catalog.metadata.items()]
        return pd.DataFrame.from_records(rows, columns=["key", "value"]).set_index("key")

    @cached_property
    def tokenizer(self) -> pd.DataFrame:
        """The vocabulary a GGUF file embeds, one row per token: id (index), token, score, type ('normal', 'control',
        'byte' ...); an empty table for checkpoints that hold none. Reads the vocabulary arrays of the header only."""
        table = getattr(self.catalog.reader, "tokenizer_table", None)
        columns = table() if table is not None else {}
        if not columns:
            return pd.DataFrame({"token": [], "score": [], "type": []}, index=pd.Index([], name="id"))
        return pd.DataFrame(columns).set_index("id")

    @cached_property
    def format_columns(self) -> list[str]:
        """Names of the extra `.tensors` columns this checkpoint's format fills, in catalog order (a name
        that clashes with a standard column gets a `format_` prefix)."""
        return [f"format_{name}" if name in TENSOR_COLUMNS else name for name in self.catalog.columns]

    @cached_property
    def files(self) -> pd.DataFrame:
        """One row per file holding tensors: size, header_bytes, n_tensors, tensor_bytes."""
        tensor_bytes = self.tensors.groupby("file", sort=False)["nbytes"].sum()
        rows = [(f.path, f.size, f.header_bytes, f.n_tensors) for f in self.catalog.files.values()]
        frame = pd.DataFrame.from_records(rows, columns=["file", "size", "header_bytes", "n_tensors"]).set_index("file")
        frame["tensor_bytes"] = tensor_bytes.reindex(frame.index, fill_value=0).astype("int64")
        return frame

    @cached_property
    def folds(self) -> list[Fold]:
        """Tensor names folded over their numeric segments, in natural name order (see workbench.explore.layers)."""
        folds = fold_names(self.catalog.tensors)
        return sorted(folds, key=lambda f: natural_key(f.names[0]))

    @cached_property
    def layers(self) -> pd.DataFrame:
        """One row per folded pattern (e.g. `model.layers.{i}.mlp.up_proj.weight` ×32): count, index range,
        dtype, shape and numel of the typical member, nbytes of all members together, and `odd_layers`
        listing members whose dtype or shape differ from the typical one ('' when all agree)."""
        infos = self.catalog.tensors
        rows = []
        for fold in self.folds:
            members = [infos[n] for n in fold.names]
            kinds = Counter((t.dtype, t.shape) for t in members)
            (dtype, shape), _ = kinds.most_common(1)[0]
            odd = ""
            if len(kinds) > 1:
                odd = ", ".join(
                    f"{fold.label(k)} ({t.dtype} {list(t.shape)})"
                    for k, t in enumerate(members)
                    if (t.dtype, t.shape) != (dtype, shape)
                )
            rows.append(
                (fold.template, fold.count, fold.index_range(), dtype, shape, math.prod(shape), sum(t.nbytes for t in members), odd)
            )
        frame = pd.DataFrame.from_records(rows, columns=["pattern", *LAYER_COLUMNS]).set_index("pattern")
        return frame

    def summary(self, largest: int = 10) -> Summary:
        """Parameters and bytes per dtype, the files, and the `largest` biggest tensors."""
        t = self.tensors
        by_dtype = t.groupby("dtype", sort=False).agg(tensors=("numel", "size"), parameters=("numel", "sum"), bytes=("nbytes", "sum"))
        total = int(t["nbytes"].sum())
        by_dtype["share"] = (by_dtype["bytes"] / total).round(4) if total else 0.0
        by_dtype = by_dtype.sort_values("bytes", ascending=False)
        biggest = t.nlargest(largest, "nbytes")[["dtype", "shape", "nbytes", "file"]]
        return Summary(
            format=self.format,
            path=self.location,
            n_tensors=len(t),
            parameters=self.parameter_count,
            total_bytes=total,
            by_dtype=by_dtype,
            files=self.files,
            largest=biggest,
        )

    # --- data ------------------------------------------------------------------------------------
    def _info(self, name: str) -> TensorInfo:
        info = self.catalog.tensors.get(name)
        if info is None:
            raise self._unknown(name)
        return info

    def _unknown(self, name: str, extra: str = "") -> CheckpointError:
        close = difflib.get_close_matches(str(name), list(self.catalog.tensors), n=3, cutoff=0.6)
        hint = f"Did you mean {', '.join(repr(c) for c in close)}?" if close else "See .tensors for the names it holds."
        hint += f" {extra}" if extra else ""
        return CheckpointError(f"Cannot find tensor {name!r} in {self.location}: the checkpoint has no such tensor. {hint}", tensor=str(name))

    def load(self, name: str) -> Any:
        """One tensor as a torch.Tensor, reading only that tensor's bytes."""
        from ..iostats import open_for_read

        info = self._info(name)
        if DTYPE_BITS[info.dtype] % 8:
            raise CheckpointError(
                f"Cannot load tensor {name!r} as a torch tensor: its dtype {info.dtype} packs several values per byte. "
                "Read its raw bytes with .catalog.read_bytes(name).",
                tensor=name,
            )
        import torch

        dtype = to_torch(info.dtype)
        if info.numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        where = self.catalog.locate(name)
        if where is None:
            buffer = bytearray(self.catalog.read_bytes(name))
        else:
            path, begin, end = where
            buffer = bytearray(end - begin)
            fd = open_for_read(path)
            try:
                read_located(fd, memoryview(buffer), begin, path, name)
            finally:
                os.close(fd)
        return torch.frombuffer(buffer, dtype=dtype).reshape(info.shape)

    def select(self, names_or_pattern: str | Iterable[str]) -> list[str]:
        """Tensor names from a name, a filter pattern, or a list of those.

        A pattern selects the names it matches whole or in a run of dotted segments, with `*` globs and
        `{i}` placeholders (the rule of `workbench.names.name_filter`): `ck.select("layers.{i}.self_attn.*")`.
        """
        patterns = [names_or_pattern] if isinstance(names_or_pattern, str) else list(names_or_pattern)
        chosen: dict[str, None] = {}
        for pattern in patterns:
            if pattern in self.catalog:
                chosen[pattern] = None
                continue
            found = filter_names(self.catalog.tensors, pattern)
            if not found:
                raise self._unknown(pattern, no_match_hint(pattern))
            chosen.update(dict.fromkeys(found))
        return list(chosen)

    def stats(
        self, names_or_pattern: str | Iterable[str], *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, on_read: ReadHook | None = None
    ) -> pd.DataFrame:
        """Value statistics per tensor: min, max, mean, std (over finite values; std unbiased like
        torch.std) and nan, inf counts. Tensors are read in chunks of `chunk_elements` values; `on_read(nbytes)`
        is called after each chunk (raise from it to stop)."""
        from .stats import tensor_stats

        rows = []
        for name in self.select(names_or_pattern):
            info = self.catalog[name]
            figures = tensor_stats(self.catalog, name, chunk_elements, on_read)
            rows.append({"name": name, "dtype": info.dtype, "shape": info.shape, "numel": info.numel, **figures})
        return pd.DataFrame.from_records(rows, columns=["name", *STATS_COLUMNS]).set_index("name")

    def suggest(self, config: Any = None) -> pd.DataFrame:
        """The presets that apply (columns `preset`, `why`; model type in `.attrs['model_type']`), from the tensor
        names and config.json (beside the checkpoint unless `config` is given). Reads no tensor data."""
        from ..mapper.presets.suggest import model_config, suggest

        return suggest(self.catalog.tensors, config if config is not None else model_config(self.path, self.catalog))

    def diff(
        self,
        other: Checkpoint | Catalog | str | os.PathLike,
        values: bool = False,
        *,
        include_same: bool = False,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        mapper: Any = None,
        rest: str = "keep",
        on_read: ReadHook | None = None,
    ) -> pd.DataFrame:
        """What changed from this checkpoint to `other`: one row per differing tensor, indexed by name, with
        status ('added', 'removed', 'dtype changed', 'shape changed', 'values changed', 'same'), both
        dtypes and shapes, and with `values=True` the max absolute difference (data compared chunk-wise).

        With `mapper`, this checkpoint is first seen through it (outputs computed group by group on demand),
        so a converted checkpoint can be compared with its source up to the layout change. A GGUF file compared with
        a checkpoint of another format is seen through `M.presets.gguf_to_hf` (HF names, de-quantised to F32 where
        quantised), with columns saying which GGUF tensor and type each row comes from. `on_read(nbytes)` is
        called after each chunk read for the value comparison (raise from it to stop)."""
        from .diff import diff_catalogs

        theirs = open_checkpoint(other).catalog
        mine = self.catalog
        if mapper is None and (mine.format == "gguf") != (theirs.format == "gguf"):
            from .gguf_diff import diff_gguf

            return diff_gguf(mine, theirs, values=values, include_same=include_same, chunk_elements=chunk_elements, on_read=on_read)
        if mapper is not None:
            from .mapped import mapped_catalog

            mine = mapped_catalog(mine, mapper, rest)
        return diff_catalogs(mine, theirs, values=values, include_same=include_same, chunk_elements=chunk_elements, on_read=on_read)

    # --- plots -----------------------------------------------------------------------------------
    def bytes_by(self, by: str = "layer") -> pd.Series:
        """Tensor bytes grouped by 'layer' (block up to the first numeric segment, e.g. `model.layers.3`,
        else the module), 'file' or 'dtype'."""
        t = self.tensors
        if by == "file":
            return t.groupby("file", sort=True)["nbytes"].sum()
        if by == "dtype":
            return t.groupby("dtype", sort=False)["nbytes"].sum().sort_values(ascending=False)
        if by == "layer":
            keys = pd.Series([_layer_key(n) for n in t.index], index=t.index)
            sums = t["nbytes"].groupby(keys, sort=False).sum()
            return sums.reindex(sorted(sums.index, key=natural_key))
        raise WorkbenchError(f"Cannot group bytes by {by!r}: choose one of {', '.join(BYTES_BY)}.")

    def plot_bytes(self, by: str = "layer") -> Any:
        """A bar chart (matplotlib Figure) of tensor bytes per layer, file or dtype."""
        from .plots import bar_chart_of_bytes

        series = self.bytes_by(by)
        return bar_chart_of_bytes(series, f"{self.path.name}: tensor bytes by {by}")

    def plot_histogram(
        self, name: str, bins: int = 100, *, log: bool = True, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        on_read: ReadHook | None = None, value_range: tuple[float, float] | None = None,
    ) -> Any:
        """A histogram (matplotlib Figure) of one tensor's finite values, computed chunk-wise (the tensor is
        read twice: min/max, then counts, or once when `value_range` is given; `on_read(nbytes)` is called
        after each chunk)."""
        from .plots import histogram_figure
        from .stats import histogram

        info = self._info(name)
        counts, edges = histogram(self.catalog, name, bins=bins, value_range=value_range, chunk_elements=chunk_elements, on_read=on_read)
        return histogram_figure(counts, edges, f"{name} ({info.dtype} {list(info.shape)})", log=log)

    # --- display ---------------------------------------------------------------------------------
    def headline(self) -> str:
        """One line: tensors, files, bytes and parameters, for listings and widget titles."""
        t = self.tensors
        return (
            f"{len(t):,} tensors in {len(self.catalog.files):,} file(s), {format_bytes(int(t['nbytes'].sum()))}, "
            f"{self.parameter_count:,} parameters"
        )

    @cached_property
    def parameter_count(self) -> int:
        """Values held by the tensors: their numel, except where the format lists a tensor's stored bytes rather
        than its values (a GGUF Q4_K tensor, `logical_shape` column): there the values of its logical shape."""
        logical = self.catalog.columns.get("logical_shape", {})
        if not logical:
            return int(self.tensors["numel"].sum())
        return sum(math.prod(logical[n]) if n in logical else t.numel for n, t in self.catalog.tensors.items())

    def _dtype_lines(self) -> list[str]:
        t = self.tensors
        by = t.groupby("dtype", sort=False).agg(n=("numel", "size"), p=("numel", "sum"), b=("nbytes", "sum"))
        return [f"{dt}: {row.n:,} tensors, {row.p:,} parameters, {format_bytes(row.b)}" for dt, row in by.sort_values("b", ascending=False).iterrows()]

    def __repr__(self) -> str:
        lines = [f"<Checkpoint {self.format} {self.location}>", "  " + self.headline()]
        lines += ["  " + s for s in self._dtype_lines()]
        layers = self.layers
        lines.append(f"  {len(layers)} patterns after folding layers:")
        for pattern, row in layers.head(HTML_LAYER_ROWS).iterrows():
            odd = f"  odd: {row.odd_layers}" if row.odd_layers else ""
            lines.append(f"    {pattern}  ×{row['count']}  {row['dtype']} {list(row['shape'])}{odd}")
        if len(layers) > HTML_LAYER_ROWS:
            lines.append(f"    ... {len(layers) - HTML_LAYER_ROWS} more (see .layers)")
        for warning in self.catalog.warnings:
            lines.append(f"  warning: {warning}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        layers = self.layers
        shown = layers.head(HTML_LAYER_ROWS).copy()
        shown["count"] = shown["count"].map(lambda n: f"×{n}")
        shown["shape"] = shown["shape"].map(format_shape)
        shown["nbytes"] = shown["nbytes"].map(format_bytes)
        shown = shown.drop(columns="numel")
        if not (shown["odd_layers"] != "").any():
            shown = shown.drop(columns="odd_layers")
        more = f"<p>… {len(layers) - HTML_LAYER_ROWS} more patterns in <code>.layers</code></p>" if len(layers) > HTML_LAYER_ROWS else ""
        dtypes = "".join(f"<li>{html.escape(s)}</li>" for s in self._dtype_lines())
        warnings = "".join(f"<li>⚠ {html.escape(w)}</li>" for w in self.catalog.warnings)
        return (
            '<div class="workbench-checkpoint">'
            f"<b>Checkpoint</b> <code>{html.escape(self.location)}</code> — format <b>{html.escape(self.format)}</b><br>"
            f"{html.escape(self.headline())}"
            f"<ul>{dtypes}{warnings}</ul>"
            f"<b>Layers</b> ({len(layers)} patterns after folding numbered segments)"
            f"{shown.to_html(index_names=False)}{more}</div>"
        )


def open_checkpoint(path: CheckpointLike, **options: object) -> Checkpoint:
    """Open a checkpoint file, folder or URL (`hf://org/repo[@rev][/sub]`, `https://`, `s3://`) from its headers alone;
    the format is detected.

        ck = wb.open_checkpoint("llama/")
        ck.tensors.head(); ck.load("model.norm.weight")
        both = wb.open_checkpoint({"base": "llama/", "adapter": "lora/"})

    Passing a `Checkpoint` returns it; passing a `Catalog` wraps it. A mapping of source names to paths
    (`{"base": "base/", "adapter": "lora/"}`) opens them as one catalog: the first source keeps its
    names, the others are scoped `NAME::tensor` (see workbench.formats.multi).

    `options` choose what some formats list, e.g. a DeepSpeed run's
    `wb.open_checkpoint("run/", weights="module", moments=True)` (see docs/deepspeed.md).
    """
    if options and not isinstance(path, (str, os.PathLike)):
        raise WorkbenchError(f"Cannot open with {', '.join(sorted(options))}: options apply to a path, not to an opened "
                             f"{type(path).__name__}. Pass the path.")
    if isinstance(path, Checkpoint):
        return path
    if isinstance(path, Catalog):
        return Checkpoint(path)
    if isinstance(path, Mapping):
        from ..formats.multi import open_sources

        return Checkpoint(open_sources(path))
    from ..formats import open_catalog
    from ..mapper.presets.packed import annotate_found

    catalog = open_catalog(path, **options)
    annotate_found(catalog)  # packed quantised tensors (compressed-tensors, GPTQ, AWQ): what each one is
    return Checkpoint(catalog)
