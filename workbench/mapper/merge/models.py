"""`MergeModels`: a whole-checkpoint merge, written before any source is opened and bound lazily.

    M.presets.merge("slerp", ["a", "b"], base_model="a", parameters={"t": [0, 0.5, 1]})

names the models by their source names in a multi-source checkpoint (`wb.open_checkpoint({"a": ..., "b": ...})`:
the first source keeps its tensor names, the others are `b::name`). When bound, it becomes one `Merge` per
tensor name the models hold, each with its parameters resolved for that tensor in mergekit's forms (scalar,
gradient over the layers, `{"filter": ..., "value": ...}` lists; see `parameters`), the model's own
`model_parameters` before the global `parameters`. The base model, when not among `models`, is merged as the
last input (mergekit's order). Unknown parameters, a model that is not a source, a tensor some model lacks:
plan problems naming the key, the model or the tensor. Tensors of the checkpoint's other sources are dropped
(they would otherwise land on the merged names or keep their `NAME::` prefix). `rng='mergekit'` places each random
merge (DARE, DELLA) in mergekit's one stream (`stream.assign_draws`), as configs read by `wb.merge_config` do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import MapperError
from ..base import Meta
from ..op import Op, build_unchecked
from ..ops import Drop
from .methods import method
from .op import Merge, _dtype_or_none, check_seed
from .parameters import check, first_set, layer_of, position

SCOPE = "::"
RNG = ("tensor", "mergekit")  # the random methods' streams: one per output tensor, or mergekit's one stream


def check_rng(rng: Any, where: str) -> None:
    """MapperError unless `rng` names a stream kind of RNG."""
    if rng not in RNG:
        raise MapperError(f"Cannot {where}: rng {rng!r} is unknown. Use 'tensor' (a stream per output tensor) or 'mergekit' "
                          "(mergekit's one stream, for its bytes under the same seed).")


def _plain(value: Any) -> Any:
    """`value` as JSON data (mappings with string keys, lists), or MapperError."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise MapperError(f"Cannot use merge parameters {value!r}: use numbers, booleans, strings, lists and mappings.") from None


@dataclass(frozen=True, init=False, repr=False)
class MergeModels(Op):
    """Merge every tensor of `models` by `method` (see the module docstring); binds to one `Merge` per tensor."""

    method: str
    models: tuple[str, ...]
    base_model: str | None = None
    parameters: str = "{}"  # JSON text: a mapping stays hashable and compares by value
    model_parameters: str = "{}"
    dtype: str | None = None
    out_dtype: str | None = None
    seed: int | None = None
    rng: str = "tensor"

    POSITIONAL = ("method", "models")
    BIND_WITH_SOURCES = True  # the binder passes the checkpoint's source names to `bind_instances`

    def __init__(self, method: str, models: Sequence[str], *, base_model: str | None = None,
                 parameters: Mapping[str, Any] | None = None, model_parameters: Mapping[str, Mapping[str, Any]] | None = None,
                 dtype: str | None = None, out_dtype: str | None = None, seed: int | None = None, rng: str = "tensor") -> None:
        spec = _known(method)
        where = f"merge {spec.name!r}"
        check_rng(rng, where)
        if isinstance(models, str) or not isinstance(models, Sequence) or not models or not all(isinstance(m, str) for m in models):
            raise MapperError(f"Cannot {where}: models must be a list of source names, e.g. ['a', 'b'] (got {models!r}).")
        names = list(models)
        if len(set(names)) != len(names):
            raise MapperError(f"Cannot {where}: a model is listed twice in {names}. List each model once.")
        if base_model is not None and base_model not in names:
            names.append(base_model)  # mergekit merges the base as the last input when the models omit it
        parameters = _plain(dict(parameters or {}))
        model_parameters = _plain({str(k): dict(v) for k, v in (model_parameters or {}).items()})
        for key, value in parameters.items():
            check(value, key)
        for model, values in model_parameters.items():
            if model not in names:
                raise MapperError(f"Cannot {where}: model_parameters names {model!r}, which is not among the models {names}.")
            for key, value in values.items():
                check(value, key)
        check_seed(seed, where)
        for name, value in (("method", spec.name), ("models", tuple(names)), ("base_model", base_model),
                            ("parameters", json.dumps(parameters)), ("model_parameters", json.dumps(model_parameters)),
                            ("dtype", _dtype_or_none(dtype, "dtype", where)), ("out_dtype", _dtype_or_none(out_dtype, "out_dtype", where)),
                            ("seed", seed), ("rng", rng)):
            object.__setattr__(self, name, value)

    # Every name present where the step runs is a candidate: the op reads like a glob (bound where its step runs).
    @property
    def inputs(self) -> tuple[str, ...]:
        return ("*",)

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("*",)

    def arguments(self) -> dict[str, Any]:
        """Constructor arguments worth writing (export)."""
        out: dict[str, Any] = {"method": self.method, "models": list(self.models)}
        if self.base_model is not None:
            out["base_model"] = self.base_model
        for name in ("parameters", "model_parameters"):
            value = json.loads(getattr(self, name))
            if value:
                out[name] = value
        for name in ("dtype", "out_dtype", "seed"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.rng != "tensor":
            out["rng"] = self.rng
        return out

    def _infer(self, metas: list[Meta]) -> list[Meta]:  # pragma: no cover - binding uses the instances
        raise MapperError(f"Cannot apply {self.short()} before binding: bind it to the multi-source checkpoint.")

    # -- binding -----------------------------------------------------------------------------------------------
    def bind_instances(self, nodes: Mapping[str, Meta | None], sources: Sequence[str] | None = None
                       ) -> tuple[list[Op], list[tuple[str, str | None, str]]]:
        """The `Merge` of every tensor the models hold among `nodes` (name -> metadata where the step runs), and the
        problems as (message, tensor, kind). `sources`: the checkpoint's source names, the primary first (unknown for
        a plain mapping of tensors: then the one model whose names are unscoped is taken as the primary)."""
        spec = _known(self.method)
        problems: list[tuple[str, str | None, str]] = []
        parameters = json.loads(self.parameters)
        model_parameters = json.loads(self.model_parameters)
        for key in dict.fromkeys([*parameters, *(k for values in model_parameters.values() for k in values)]):
            if spec.parameter(key) is None:
                problems.append((f"Cannot merge by {spec.name}: parameter {key!r} is unknown to this method (it takes "
                                 f"{', '.join(spec.names) or 'no parameters'}). mergekit ignores such keys silently; remove "
                                 "it or fix its spelling.", None, "invalid"))
        reason = spec.check_inputs(self.models, self.base_model)
        if reason:
            return [], [*problems, (f"Cannot merge {list(self.models)} by {spec.name}: {reason}.", None, "invalid")]
        tensors = self._tensors_by_model(nodes, problems, sources)
        if tensors is None:
            return [], problems
        merged = {full for names in tensors.values() for full in names.values()}
        ops: list[Op] = [build_unchecked(Drop, name=name) for name in nodes if name not in merged]  # sources not merged
        first = tensors[self.models[0]]
        layers = [index for name in first if (index := layer_of(name)) is not None]
        num_layers = max(layers) + 1 if layers else 0
        missing_reported = 0
        base = self.base_model if spec.base != "ignored" else None
        for name in dict.fromkeys(n for model in self.models for n in tensors[model]):
            lacking = [m for m in self.models if name not in tensors[m]]
            if lacking:
                missing_reported += 1
                if missing_reported <= 20:
                    problems.append((f"Cannot merge {name!r}: model {lacking[0]!r} has no such tensor. Merge models of one "
                                     "architecture, or drop the tensor first.", tensors[next(m for m in self.models if m not in lacking)][name], "missing"))
                continue
            t = position(layer_of(name), num_layers)
            inputs = {m: tensors[m][name] for m in self.models}
            params = resolve_parameters(spec, inputs, base, [parameters], {m: [model_parameters.get(m)] for m in self.models},
                                        name, t)
            ops.append(Merge(spec.name, name, inputs, base=self.base_model, params=params, dtype=self.dtype,
                             out_dtype=self.out_dtype, seed=self.seed))
        if self.rng == "mergekit" and spec.random:
            from .stream import assign_draws

            merges = [op for op in ops if isinstance(op, Merge)]
            placed, more = assign_draws(merges, nodes)
            problems += more
            ops = [op for op in ops if not isinstance(op, Merge)] + placed
        return ops, problems

    def _tensors_by_model(self, nodes: Mapping[str, Meta | None], problems: list[tuple[str, str | None, str]],
                          sources: Sequence[str] | None) -> dict[str, dict[str, str]] | None:
        """model -> (tensor name -> name where the step runs); None, with a problem, when a model is not a source."""
        scopes = {name.partition(SCOPE)[0] for name in nodes if SCOPE in name}
        primary = sources[0] if sources else None
        unscoped = [m for m in self.models if m not in scopes]
        has_primary = any(SCOPE not in name for name in nodes)
        absent = [m for m in unscoped if m != primary] if primary else unscoped[1:] if has_primary else unscoped
        if absent:
            have = f"its sources are {list(sources)}" if sources else f"it has {sorted(scopes)} besides its first source"
            problems.append((f"Cannot merge models {absent}: the checkpoint has no such sources ({have}). Open them together, e.g. "
                             "wb.open_checkpoint({'a': 'a/', 'b': 'b/'}), and name the models as the sources.", None, "missing"))
            return None
        out: dict[str, dict[str, str]] = {}
        for model in self.models:
            if model in scopes:
                prefix = model + SCOPE
                out[model] = {name[len(prefix):]: name for name in nodes if name.startswith(prefix)}
            else:
                out[model] = {name: name for name in nodes if SCOPE not in name}
        return out


def _known(name: str) -> Any:
    return method(name)


def resolve_parameters(spec: Any, inputs: Mapping[str, str], base: str | None, shared: Sequence[Mapping[str, Any] | None],
                       own: Mapping[str, Sequence[Mapping[str, Any] | None]], output: str, t: float) -> dict[str, Any]:
    """The parameters of `spec` (a Method) for one output tensor at gradient position `t`, as mergekit resolves them:
    a shared parameter from the first of the `shared` scopes that sets it for `output`; a per-model one, for each model
    of `inputs` (model -> input tensor name; the base skipped for 'non_base' ones), from the model's `own` scopes then
    the shared ones, filtered on the model's input name. Unset values are left out (the method's default applies)."""
    params: dict[str, Any] = {}
    for parameter in spec.parameters:
        if parameter.scope == "shared":
            value = first_set(list(shared), parameter.name, output, t)
            if value is not None:
                params[parameter.name] = value
            continue
        per = {}
        for model, full in inputs.items():
            if parameter.scope == "non_base" and model == base:
                continue
            value = first_set([*own.get(model, ()), *shared], parameter.name, full.rpartition(SCOPE)[2], t)
            if value is not None:
                per[model] = value
        if per:
            params[parameter.name] = per
    return params


def merge(method: str, models: Sequence[str], *, base_model: str | None = None, parameters: Mapping[str, Any] | None = None,
          model_parameters: Mapping[str, Mapping[str, Any]] | None = None, dtype: str | None = None,
          out_dtype: str | None = None, seed: int | None = None, base: str | None = None, rng: str = "tensor",
          **more_parameters: Any) -> MergeModels:
    """A mapper merging whole checkpoints (the sources `models` of a multi-source checkpoint) by a mergekit method:
    linear, slerp, nuslerp, multislerp, karcher, task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs,
    breadcrumbs_ties, della, della_linear, sce, model_stock, nearswap, passthrough. `parameters` and
    `model_parameters` take mergekit's forms (scalars, gradients over layers, filtered lists); see docs/merging.md.
    The short form `merge("slerp", ["a", "b"], base="a", t=0.5)` is the same: `base` names the base model and
    further keywords are global parameters. `seed` seeds the random methods (DARE, DELLA); `rng` picks their stream:
    'tensor' (default: one per output tensor, independent of the other tensors) or 'mergekit' (mergekit's one
    stream, so the bytes equal `mergekit-yaml --random-seed SEED`'s; see `stream`)."""
    if base is not None and base_model is not None and base != base_model:
        raise MapperError(f"Cannot merge: base={base!r} and base_model={base_model!r} name two base models. Pass one.")
    if more_parameters:
        clash = sorted(set(more_parameters) & set(parameters or {}))
        if clash:
            raise MapperError(f"Cannot merge: parameter {clash[0]!r} is given twice (as a keyword and in parameters=). "
                              "Pass it once.")
        parameters = {**(parameters or {}), **more_parameters}
    return MergeModels(method, models, base_model=base_model if base_model is not None else base,
                       parameters=parameters, model_parameters=model_parameters, dtype=dtype, out_dtype=out_dtype,
                       seed=seed, rng=rng)
