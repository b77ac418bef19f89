"""`MergeSlices`: an output built from layer ranges of several models (mergekit's `slices:`, frankenmerges).

    MergeSlices("passthrough", [
        {"sources": [{"model": "a", "layer_range": [0, 3]}]},
        {"sources": [{"model": "b", "layer_range": [1, 4]}]},
    ])

Each slice lists one source per model, all spanning the same number of layers; the output's layers are the
slices' layers in order, renumbered from 0. Layer `k` of a slice merges layer `layer_range[0] + k` of every
source by `method`, its gradient position `t = k / (n - 1)` over the slice's `n` layers (1 when `n == 1`),
as mergekit plans them. Tensors outside the layers come from the first slice's models when their name holds
`embed` (or GPT-2's `wte` / `wpe`: mergekit's "pre" weights) and from the last slice's models otherwise (final norm,
lm_head: its "post" weights), at `t = 0`. Parameters are looked up as mergekit does: a source's own
`parameters`, then the slice's, then the global ones; a model's parameters filter on its input tensor's name,
the shared ones on the output's. With `passthrough` and one source per slice (no `scale`) every output is a
byte copy. Tensors of the checkpoint no slice reads are dropped. Binding needs the multi-source checkpoint
whose sources the models name (the first source unscoped, the others `NAME::tensor`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import MapperError
from ..base import Mapper, Meta
from ..compose import Sequential
from ..layout import Sym
from ..op import Op, build_unchecked
from ..ops import Drop
from .methods import method
from .models import SCOPE, _plain, check_rng, resolve_parameters
from .op import Merge, _dtype_or_none, _thaw, check_seed
from .parameters import LAYER, check

SLICE_KEYS = {"sources", "base_model", "parameters"}
# Tensors before the layers (mergekit's "pre" weights: token and position embeddings); the others outside the layers
# (final norm, lm_head) are "post" weights.
PRE_WEIGHT = re.compile(r"embed|(?:^|\.)(?:wte|wpe)\.")
SOURCE_KEYS = {"model", "layer_range", "parameters"}


def _where(index: int, key: str = "") -> str:
    return f"slices[{index}]" + (f".{key}" if key else "")


def check_slices(slices: Any) -> list[dict]:
    """The slices as plain data, or MapperError naming the first key or value that is not mergekit's slice form."""
    slices = _plain(slices)
    if not isinstance(slices, list) or not slices:
        raise MapperError(f"Cannot merge slices {slices!r}: give a non-empty list of {{'sources': [...]}} entries.")
    for i, item in enumerate(slices):
        if not isinstance(item, dict) or "sources" not in item:
            raise MapperError(f"Cannot merge {_where(i)}: {item!r} has no 'sources' list. Give {{'sources': [{{'model': ..., "
                              "'layer_range': [start, end]}]}}.")
        unknown = sorted(set(item) - SLICE_KEYS)
        if unknown:
            raise MapperError(f"Cannot merge {_where(i)}: key {unknown[0]!r} is not supported (a slice takes "
                              f"{sorted(SLICE_KEYS)}). Remove it.")
        sources = item["sources"]
        if not isinstance(sources, list) or not sources:
            raise MapperError(f"Cannot merge {_where(i, 'sources')}: give a non-empty list of sources.")
        lengths = set()
        for j, source in enumerate(sources):
            where = _where(i, f"sources[{j}]")
            if not isinstance(source, dict) or not isinstance(source.get("model"), str):
                raise MapperError(f"Cannot merge {where}: {source!r} names no model. Give {{'model': NAME, 'layer_range': [start, end]}}.")
            unknown = sorted(set(source) - SOURCE_KEYS)
            if unknown:
                raise MapperError(f"Cannot merge {where}: key {unknown[0]!r} is not supported (a source takes "
                                  f"{sorted(SOURCE_KEYS)}). Remove it.")
            span = source.get("layer_range")
            if (not isinstance(span, list) or len(span) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)
                    or not 0 <= span[0] < span[1]):
                raise MapperError(f"Cannot merge {where}: layer_range {span!r} must be [start, end] with 0 <= start < end "
                                  "(end excluded, as in mergekit).")
            lengths.add(span[1] - span[0])
            for key, value in (source.get("parameters") or {}).items():
                check(value, key)
        if len(lengths) != 1:
            raise MapperError(f"Cannot merge {_where(i)}: its sources span different numbers of layers ({sorted(lengths)}). "
                              "Give every source of a slice the same number of layers.")
        for key, value in (item.get("parameters") or {}).items():
            check(value, key)
    return slices


def num_layers(slices: Sequence[Mapping[str, Any]]) -> int:
    """The number of layers the slices make."""
    return sum(s["sources"][0]["layer_range"][1] - s["sources"][0]["layer_range"][0] for s in slices)


def slice_models(slices: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every model the slices read, in order of first mention."""
    return list(dict.fromkeys(src["model"] for s in slices for src in s["sources"]))


@dataclass(frozen=True, init=False, repr=False)
class MergeSlices(Op):
    """Build the output's layers from `slices` of several models by `method` (see the module docstring)."""

    method: str
    slices: str  # JSON text: hashable, compares by value
    base_model: str | None = None
    parameters: str = "{}"
    dtype: str | None = None
    out_dtype: str | None = None
    seed: int | None = None
    rng: str = "tensor"

    POSITIONAL = ("method", "slices")

    def __init__(self, method: str, slices: Sequence[Mapping[str, Any]], *, base_model: str | None = None,
                 parameters: Mapping[str, Any] | None = None, dtype: str | None = None, out_dtype: str | None = None,
                 seed: int | None = None, rng: str = "tensor") -> None:
        spec = _known(method)
        where = f"merge slices by {spec.name!r}"
        check_rng(rng, where)
        plain = check_slices(slices)
        parameters = _plain(dict(parameters or {}))
        for key, value in parameters.items():
            check(value, key)
        check_seed(seed, where)
        for name, value in (("method", spec.name), ("slices", json.dumps(plain)), ("base_model", base_model),
                            ("parameters", json.dumps(parameters)), ("dtype", _dtype_or_none(dtype, "dtype", where)),
                            ("out_dtype", _dtype_or_none(out_dtype, "out_dtype", where)), ("seed", seed), ("rng", rng)):
            object.__setattr__(self, name, value)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("*",)

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("*",)

    def arguments(self) -> dict[str, Any]:
        """Constructor arguments worth writing (export)."""
        out: dict[str, Any] = {"method": self.method, "slices": json.loads(self.slices)}
        if self.base_model is not None:
            out["base_model"] = self.base_model
        if json.loads(self.parameters):
            out["parameters"] = json.loads(self.parameters)
        for name in ("dtype", "out_dtype", "seed"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.rng != "tensor":
            out["rng"] = self.rng
        return out

    def _infer(self, metas: list[Meta]) -> list[Meta]:  # pragma: no cover - binding uses the instances
        raise MapperError(f"Cannot apply {self.short()} before binding: bind it to the multi-source checkpoint.")

    # -- binding -----------------------------------------------------------------------------------------------
    def bind_instances(self, nodes: Mapping[str, Meta | None]) -> tuple[list[Op], list[tuple[str, str | None, str]]]:
        """One `Merge` per output tensor, Drops for the rest, and the problems as (message, tensor, kind). An input read
        by several outputs is read under its copies' names (`SliceCopies`, the step before, made them)."""
        merges, problems = self._plan({k: v for k, v in nodes.items() if COPY not in k})
        if merges is None:
            return [], problems
        uses: dict[str, int] = {}
        ops: list[Op] = []
        for op in merges:
            inputs = {}
            for model, name in zip(op.models, op.inputs, strict=True):
                uses[name] = uses.get(name, 0) + 1
                inputs[model] = name if uses[name] == 1 else copy_name(name, uses[name])
            ops.append(op if inputs == dict(zip(op.models, op.inputs, strict=True)) else
                       Merge(op.method, op.output, inputs, base=op.base, params={k: _thaw(v) for k, v in op.params},
                             dtype=op.dtype, out_dtype=op.out_dtype, seed=op.seed, draws=op.draws))
        used = {name for op in ops for name in op.inputs}
        missing = sorted(name for name in used if name not in nodes)
        if missing:
            problems.append((f"Cannot merge slices: {missing[0]!r} is read by several layers but no copy of it exists. Build "
                             "the mapper with merge_slices(...), which copies such layers first.", missing[0], "missing"))
            return [], problems
        return [*(build_unchecked(Drop, name=name) for name in nodes if name not in used), *ops], problems

    def _plan(self, nodes: Mapping[str, Meta | None]) -> tuple[list[Merge] | None, list[tuple[str, str | None, str]]]:
        """The Merge of every output tensor, each reading the source names (None with the problems when impossible)."""
        spec = _known(self.method)
        slices = json.loads(self.slices)
        parameters = json.loads(self.parameters)
        problems: list[tuple[str, str | None, str]] = []
        keys = [*parameters, *(k for s in slices for k in (s.get("parameters") or {})),
                *(k for s in slices for src in s["sources"] for k in (src.get("parameters") or {}))]
        for key in dict.fromkeys(keys):
            if spec.parameter(key) is None:
                problems.append((f"Cannot merge by {spec.name}: parameter {key!r} is unknown to this method (it takes "
                                 f"{', '.join(spec.names) or 'no parameters'}). mergekit ignores such keys silently; remove "
                                 "it or fix its spelling.", None, "invalid"))
        tensors = _tensors_by_model(slice_models(slices), nodes, problems)
        if tensors is None:
            return None, problems
        ops: list[Merge] = []
        out_layer = 0
        for i, item in enumerate(slices):
            models = [src["model"] for src in item["sources"]]
            base = item.get("base_model") or self.base_model
            reason = spec.check_inputs(tuple(models), base if base in models else None)
            if reason:
                problems.append((f"Cannot merge {_where(i)} ({models}) by {spec.name}: {reason}.", None, "invalid"))
                return None, problems
            span = item["sources"][0]["layer_range"][1] - item["sources"][0]["layer_range"][0]
            for k in range(span):
                t = k / (span - 1) if span > 1 else 1.0
                layer_names = [(src, _layer_tensors(tensors[src["model"]], src["layer_range"][0] + k)) for src in item["sources"]]
                first_src, first = layer_names[0]
                if not first:
                    problems.append((f"Cannot merge {_where(i)}: model {first_src['model']!r} has no layer "
                                     f"{first_src['layer_range'][0] + k}. Fix the layer_range.", None, "missing"))
                    return None, problems
                for suffix, (prefix, _) in first.items():
                    output = f"{prefix}{out_layer}.{suffix}"
                    inputs = {}
                    for src, found in layer_names:
                        if suffix not in found:
                            problems.append((f"Cannot merge {output!r}: model {src['model']!r} has no "
                                             f"'{prefix}{src['layer_range'][0] + k}.{suffix}'. Merge models of one architecture.",
                                             output, "missing"))
                            continue
                        inputs[src["model"]] = found[suffix][1]
                    if len(inputs) == len(models):
                        ops.append(self._merge(spec, output, inputs, base, item, parameters, t))
                out_layer += 1
        outside = [name for name in tensors[slices[0]["sources"][0]["model"]] if LAYER.search(name) is None]
        for name in outside:
            item = slices[0] if PRE_WEIGHT.search(name) else slices[-1]
            models = [src["model"] for src in item["sources"]]
            lacking = [m for m in models if name not in tensors[m]]
            if lacking:
                problems.append((f"Cannot merge {name!r}: model {lacking[0]!r} has no such tensor. Merge models of one "
                                 "architecture.", name, "missing"))
                continue
            inputs = {m: tensors[m][name] for m in models}
            ops.append(self._merge(spec, name, inputs, item.get("base_model") or self.base_model, item, parameters, 0.0))
        if self.rng == "mergekit" and spec.random and not problems:
            from .stream import assign_draws

            ops, more = assign_draws(ops, nodes)
            problems += more
        return ops, problems

    def _merge(self, spec: Any, output: str, inputs: dict[str, str], base: str | None, item: Mapping[str, Any],
               parameters: Mapping[str, Any], t: float) -> Merge:
        """The Merge of one output tensor, parameters resolved as mergekit does for a slice at position t."""
        base = base if base in inputs else None
        own = {model: [src.get("parameters") for src in item["sources"] if src["model"] == model] for model in inputs}
        params = resolve_parameters(spec, inputs, base, [item.get("parameters"), parameters], own, output, t)
        return Merge(spec.name, output, inputs, base=base, params=params, dtype=self.dtype, out_dtype=self.out_dtype,
                     seed=self.seed)


COPY = "#"


def copy_name(name: str, use: int) -> str:
    """The name of the `use`-th read (2, 3, ...) of tensor `name` when several output layers read it."""
    return f"{name}{COPY}{use}"


@dataclass(frozen=True, repr=False)
class Duplicate(Op):
    """Tensor `src` written under every name of `dsts` (byte copies; `src` itself may be among them)."""

    src: str
    dsts: tuple[str, ...]

    NAME_FIELDS = ("src",)
    NAME_LIST_FIELDS = ("dsts",)

    def __post_init__(self) -> None:
        self._normalize()

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.src,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.dsts

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        return [metas[0]] * len(self.dsts)

    def _compute(self, tensors: list[Any]) -> list[Any]:
        return [tensors[0]] * len(self.dsts)

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        return [syms[0]] * len(self.dsts)


@dataclass(frozen=True, init=False, repr=False)
class SliceCopies(MergeSlices):
    """The step before `MergeSlices` when slices read a layer more than once (overlapping ranges, a layer
    repeated): every such tensor is duplicated (`name`, `name#2`, ...) so that each read has its own copy."""

    def bind_instances(self, nodes: Mapping[str, Meta | None]) -> tuple[list[Op], list[tuple[str, str | None, str]]]:
        """A `Duplicate` per tensor read more than once; no problems (MergeSlices reports them)."""
        merges, _ = self._plan(nodes)
        counts: dict[str, int] = {}
        for op in merges or []:
            for name in op.inputs:
                counts[name] = counts.get(name, 0) + 1
        return [Duplicate(name, (name, *(copy_name(name, k) for k in range(2, n + 1)))) for name, n in counts.items() if n > 1], []


def rereads(slices: Sequence[Mapping[str, Any]]) -> bool:
    """True when some model's layer is read by more than one slice (the slices then need `SliceCopies` first)."""
    seen: set[tuple[str, int]] = set()
    for item in slices:
        for src in item["sources"]:
            for layer in range(*src["layer_range"]):
                if (src["model"], layer) in seen:
                    return True
                seen.add((src["model"], layer))
    return False


def merge_slices(method: str, slices: Sequence[Mapping[str, Any]], **options: Any) -> Mapper:
    """A mapper building the output's layers from `slices` (mergekit's `slices:`; see the module docstring):
    `MergeSlices`, preceded by `SliceCopies` when a layer is read more than once. `options`: base_model,
    parameters, dtype, out_dtype, seed."""
    merged = MergeSlices(method, slices, **options)
    if not rereads(json.loads(merged.slices)):
        return merged
    return Sequential(SliceCopies(method, slices, **options), merged)


def _layer_tensors(names: Mapping[str, str], index: int) -> dict[str, tuple[str, str]]:
    """suffix after the layer index -> (prefix up to the index, full name) of layer `index`'s tensors."""
    out = {}
    for name, full in names.items():
        found = LAYER.search(name)
        if found and int(found.group(1)) == index:
            out[name[found.end():]] = (name[: found.start(1)], full)
    return out


def _tensors_by_model(models: Sequence[str], nodes: Mapping[str, Meta | None],
                      problems: list[tuple[str, str | None, str]]) -> dict[str, dict[str, str]] | None:
    """model -> (tensor name -> name where the step runs); None, with a problem, when a model is not a source."""
    scopes = {name.partition(SCOPE)[0] for name in nodes if SCOPE in name}
    unscoped = [m for m in models if m not in scopes]
    if len(unscoped) > 1 or (unscoped and not any(SCOPE not in name for name in nodes)):
        problems.append((f"Cannot merge slices of models {unscoped[1:] or unscoped}: the checkpoint has no such sources (it "
                         f"has {sorted(scopes)} besides its first source). Open them together, e.g. "
                         "wb.open_checkpoint({'a': 'a/', 'b': 'b/'}), and name the models as the sources.", None, "missing"))
        return None
    out: dict[str, dict[str, str]] = {}
    for model in models:
        if model in scopes:
            prefix = model + SCOPE
            out[model] = {name[len(prefix):]: name for name in nodes if name.startswith(prefix)}
        else:
            out[model] = {name: name for name in nodes if SCOPE not in name}
    return out


def _known(name: str) -> Any:
    return method(name)


