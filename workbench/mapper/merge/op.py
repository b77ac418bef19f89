"""`Merge`: one output tensor from the same-named tensors of several models, by a merge method.

    M.Merge("slerp", "model.layers.0.mlp.up_proj.weight",
            {"a": "model.layers.0.mlp.up_proj.weight", "b": "b::model.layers.0.mlp.up_proj.weight"},
            base="a", params={"t": 0.3})

`inputs` maps each model's name to the tensor it contributes (names of a multi-source catalog, templates
allowed: `{"a": "model.layers.{i}.w", "b": "b::model.layers.{i}.w"}`), in the order the method sees them
(mergekit's: the models as listed, the base model last when it is not among them). `params` are resolved
values for this tensor: global (`{"t": 0.3}`) or per model (`{"weight": {"a": 0.7, "b": 0.3}}`); missing
ones take the method's default, unknown ones are a plan problem naming the key. `dtype` casts the inputs
before merging (mergekit's `dtype`), `out_dtype` the result (mergekit's `out_dtype`); otherwise the method
computes in the inputs' promoted dtype, accumulating in float32 where mergekit does. `seed` seeds the random
methods (DARE, DELLA) per output tensor; with `draws` set, they draw instead from mergekit's one stream
(`torch.manual_seed(seed)`) after that many draws, as `mergekit-yaml --random-seed` does (see `stream`).
Non-floating inputs (step counters, integer buffers) must be equal and are copied. A merge reads arithmetic,
so it has no byte recipe (except an unscaled passthrough) and no inverse.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...dtypes import is_float, nbytes_of, normalize_dtype, to_torch
from ...errors import MapperError, WorkbenchError
from ..base import Meta
from ..layout import Sym
from ..op import Op
from .methods import MISSING, Method, method

POSITIONAL = ("method", "output", "inputs")

# Float dtypes by (width, kind): the promotion torch applies to two floats.
_FLOAT_RANK = {"F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "F32": 3, "F64": 4}


def promote(dtypes: Sequence[str]) -> str:
    """The dtype torch.promote_types gives for floating dtypes (F16 with BF16 -> F32)."""
    out = dtypes[0]
    for other in dtypes[1:]:
        if other == out:
            continue
        a, b = _FLOAT_RANK.get(out, 3), _FLOAT_RANK.get(other, 3)
        out = out if a > b else other if b > a else "F32"
    return out


def _freeze_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return tuple((str(k), _freeze_value(v, where)) for k, v in value.items())
    raise MapperError(f"Cannot build {where}: parameter value {value!r} is not a number, a boolean, or a mapping model -> number.")


def _thaw(value: Any) -> Any:
    return {k: v for k, v in value} if isinstance(value, tuple) else value


def _dtype_or_none(value: str | None, field: str, where: str) -> str | None:
    if value is None:
        return None
    try:
        dtype = normalize_dtype(value)
    except WorkbenchError as exc:
        raise MapperError(f"Cannot build {where}: {field} {value!r}: {exc.message}") from None
    if not is_float(dtype):
        raise MapperError(f"Cannot build {where}: {field} must be a floating dtype (got {value!r}). Use e.g. 'bfloat16' or 'float32'.")
    return dtype


def check_seed(seed: Any, where: str) -> None:
    """MapperError unless `seed` is None or an integer (a bool is not one): what seeds the random methods."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise MapperError(f"Cannot {where}: seed must be an integer (got {seed!r}).")


@dataclass(frozen=True, init=False, repr=False)
class Merge(Op):
    """Merge the tensors `inputs` (model name -> tensor name) into `output` by `method` (see module docstring)."""

    method: str
    output: str
    inputs: tuple[str, ...]
    models: tuple[str, ...]
    base: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    dtype: str | None = None
    out_dtype: str | None = None
    seed: int | None = None
    draws: int | None = None

    NAME_FIELDS = ("output",)
    NAME_LIST_FIELDS = ("inputs",)

    def __init__(self, method: str, output: str, inputs: Mapping[str, str] | Sequence[tuple[str, str]], *,
                 base: str | None = None, params: Mapping[str, Any] | None = None, dtype: str | None = None,
                 out_dtype: str | None = None, seed: int | None = None, draws: int | None = None) -> None:
        where = f"Merge({method!r}, {output!r})"
        spec = _method(method)
        pairs = list(inputs.items()) if isinstance(inputs, Mapping) else [tuple(pair) for pair in inputs]
        if not pairs or any(len(pair) != 2 or not isinstance(pair[0], str) or not isinstance(pair[1], str) for pair in pairs):
            raise MapperError(f"Cannot build {where}: inputs must map each model name to a tensor name, e.g. "
                              "{'a': 'model.embed_tokens.weight', 'b': 'b::model.embed_tokens.weight'}.")
        models = tuple(model for model, _ in pairs)
        if len(set(models)) != len(models):
            raise MapperError(f"Cannot build {where}: a model is listed twice in inputs {models}. List each model once.")
        if base is not None and base not in models:
            raise MapperError(f"Cannot build {where}: base {base!r} is not one of the inputs' models {list(models)}. "
                              "Add the base model's tensor to inputs.")
        check_seed(seed, f"build {where}")
        if draws is not None and (isinstance(draws, bool) or not isinstance(draws, int) or draws < 0):
            raise MapperError(f"Cannot build {where}: draws must be a count >= 0 (got {draws!r}).")
        frozen = tuple((str(k), _freeze_value(v, where)) for k, v in (params or {}).items())
        for field_name, value in (("method", spec.name), ("output", output), ("inputs", tuple(name for _, name in pairs)),
                                  ("models", models), ("base", base), ("params", frozen),
                                  ("dtype", _dtype_or_none(dtype, "dtype", where)),
                                  ("out_dtype", _dtype_or_none(out_dtype, "out_dtype", where)), ("seed", seed),
                                  ("draws", draws)):
            object.__setattr__(self, field_name, value)
        self._normalize()

    # -- names -------------------------------------------------------------------------------------------------
    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.output,)

    @property
    def spec(self) -> Method:
        """The method's description (parameters, base policy, kernel)."""
        return _method(self.method)

    def arguments(self) -> dict[str, Any]:
        """Constructor arguments worth writing (export: `to_code`, JSON); the positional ones first."""
        out: dict[str, Any] = {"method": self.method, "output": self.output, "inputs": dict(zip(self.models, self.inputs, strict=True))}
        if self.base is not None:
            out["base"] = self.base
        if self.params:
            out["params"] = {k: _thaw(v) for k, v in self.params}
        for name in ("dtype", "out_dtype", "seed", "draws"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def with_draws(self, draws: int | None) -> Merge:
        """This merge drawing from mergekit's stream after `draws` draws (None: its own stream per tensor)."""
        return Merge(self.method, self.output, dict(zip(self.models, self.inputs, strict=True)), base=self.base,
                     params={k: _thaw(v) for k, v in self.params}, dtype=self.dtype, out_dtype=self.out_dtype,
                     seed=self.seed, draws=draws)

    POSITIONAL = POSITIONAL

    # -- parameters --------------------------------------------------------------------------------------------
    def bound_parameters(self) -> dict[str, Any]:
        """Every parameter of the method for this tensor: given values (validated) or defaults; per-model ones as
        dicts model -> value over the models they apply to. Raises MapperError naming an unknown or missing key."""
        spec = self.spec
        where = f"{self.method} of {self.output!r}"
        given = {k: _thaw(v) for k, v in self.params}
        unknown = [key for key in given if spec.parameter(key) is None]
        if unknown:
            raise MapperError(f"Cannot merge {self.output!r} by {self.method}: parameter {unknown[0]!r} is unknown to this method "
                              f"(it takes {', '.join(spec.names) or 'no parameters'}). Remove it or fix its spelling.",
                              tensor=self.output)
        base = self.base if spec.base != "ignored" else None
        out: dict[str, Any] = {}
        for parameter in spec.parameters:
            value = given.get(parameter.name, MISSING)
            if parameter.scope == "shared":
                if isinstance(value, Mapping):
                    raise MapperError(f"Cannot merge {self.output!r} by {self.method}: {parameter.name!r} is one value for the "
                                      f"whole merge, not one per model (got {value!r}).", tensor=self.output)
                if value is MISSING:
                    if parameter.required:
                        raise _missing(self, parameter.name)
                    value = parameter.default
                out[parameter.name] = parameter.validate(value, where)
                continue
            models = [m for m in self.models if parameter.scope == "input" or m != base]
            per: dict[str, Any] = {}
            for model in models:
                item = value.get(model, MISSING) if isinstance(value, Mapping) else value
                if item is MISSING:
                    if parameter.required:
                        raise _missing(self, parameter.name, model)
                    item = parameter.default
                per[model] = parameter.validate(item, where)
            out[parameter.name] = per
        return out

    # -- semantics ---------------------------------------------------------------------------------------------
    def compute_dtype(self, dtypes: Sequence[str]) -> str:
        """The dtype the method computes in: `dtype`, else the inputs' promoted dtype (mergekit's rule)."""
        return self.dtype or promote(list(dtypes))

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        spec = self.spec
        problem = spec.check_inputs(self.models, self.base)
        if problem:
            raise MapperError(f"Cannot merge {self.output!r}: {problem}.", tensor=self.output)
        self.bound_parameters()
        first_dtype, shape = metas[0]
        for name, (_, other) in zip(self.inputs, metas, strict=False):
            if tuple(other) != tuple(shape):
                raise MapperError(f"Cannot merge {self.output!r}: {name!r} is {list(other)}, {self.inputs[0]!r} is {list(shape)}. "
                                  "Merge models of one architecture (the same shapes).", tensor=self.output)
        if not all(is_float(dtype) for dtype, _ in metas):
            if any(dtype != first_dtype for dtype, _ in metas):
                raise MapperError(f"Cannot merge {self.output!r}: non-floating inputs of different dtypes "
                                  f"({[d for d, _ in metas]}). Resolve the buffer first.", tensor=self.output)
            return [(first_dtype, tuple(shape))]
        return [(self.out_dtype or self.compute_dtype([d for d, _ in metas]), tuple(shape))]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        ((dtype, shape),) = self._infer([(s.dtype, s.shape) for s in syms])
        if self.method == "passthrough" and dict(self.params).get("scale") is None and dtype == syms[0].dtype:
            return [syms[0]]  # an unscaled passthrough copies bytes
        return [Sym(dtype, shape, None)]

    @property
    def gives_back_inputs(self) -> bool:
        """True when the kernel gives its inputs' pages back before its peak (the sorts of TIES and breadcrumbs,
        `mapped_inputs.give_back`): the engine then maps inputs that lie raw on disk instead of reading them, and
        the plan counts the sorts without them (`scratch_bytes(..., mapped=True)`)."""
        return self.spec.options.get("sparsify") in ("magnitude", "magnitude_outliers")

    def scratch_bytes(self, inputs: Sequence[Any], mapped: bool = False) -> int:
        """Bytes of work tensors the method holds besides `inputs` (this merge's input TensorInfos) and the output:
        what the plan adds to the group's memory (see `memory`); `mapped`: the inputs are mapped from their files, so
        a kernel that gives them back holds none of them at its sorts."""
        from math import prod

        from .memory import scratch_bytes

        dtypes = [info.dtype for info in inputs]
        if not dtypes or not all(is_float(d) for d in dtypes):
            return 0
        base = self.base if self.spec.base != "ignored" else None
        numel = prod(inputs[0].shape)
        compute = self.compute_dtype(dtypes)
        out_bytes = nbytes_of(self.out_dtype or compute, numel)
        uncast = all(d == compute for d in dtypes)  # a cast copy is what the kernel holds: the originals stay resident
        given_back = sum(info.nbytes for info in inputs) if mapped and uncast and self.gives_back_inputs else 0
        return scratch_bytes(self.method, dtypes, numel, compute, len(self.models) - (base is not None),
                             self.spec.options, unmade=out_bytes, given_back=given_back)

    def generator_seed(self) -> int:
        """The seed of this tensor's random stream: `seed` (0 when unset) with the output name, so every rank and every
        order of groups draws the same numbers for this tensor."""
        return ((self.seed or 0) * 1_000_003 + zlib.crc32(self.output.encode())) % (2**63)

    def _compute(self, tensors: list[Any]) -> list[Any]:
        import torch

        if not all(t.is_floating_point() for t in tensors):
            first = tensors[0]
            if any(t.dtype != first.dtype or not torch.equal(t, first) for t in tensors[1:]):
                raise MapperError(f"Cannot merge {self.output!r}: this non-floating tensor differs between models. Drop it or "
                                  "pick one model's copy.", tensor=self.output)
            return [first.clone()]
        if self.dtype is not None:
            target = to_torch(self.dtype)
            tensors = [t if t.dtype == target else t.to(dtype=target) for t in tensors]
        dtype = tensors[0].dtype
        for tensor in tensors[1:]:
            dtype = torch.promote_types(dtype, tensor.dtype)
        tensors = [t.to(dtype=dtype) for t in tensors]
        spec = self.spec
        kwargs: dict[str, Any] = dict(spec.options)
        if spec.random and self.draws is not None:
            from .stream import generator_at

            kwargs["generator"] = generator_at(self.seed or 0, self.draws)
        elif spec.random:
            generator = torch.Generator()
            generator.manual_seed(self.generator_seed())
            kwargs["generator"] = generator
        base = self.base if spec.base != "ignored" else None
        result = spec.kernel_function()(tensors, self.models, base, self.bound_parameters(), **kwargs)
        if self.out_dtype is not None:
            result = result.to(dtype=to_torch(self.out_dtype))
        return [result]


def _method(name: str) -> Method:
    return method(name)


def _missing(op: Merge, key: str, model: str | None = None) -> MapperError:
    whose = f" for model {model!r}" if model else ""
    return MapperError(f"Cannot merge {op.output!r} by {op.method}: parameter {key!r} is required{whose}. "
                       f"Give it in params, e.g. params={{{key!r}: ...}}.", tensor=op.output)
