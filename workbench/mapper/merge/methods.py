"""The merge methods: what each one takes (parameters, base model, number of inputs) and which kernel runs it.

Each method matches mergekit 0.1.5's of the same name: its parameters and defaults, which inputs a parameter
is given for (`shared`: one value; `input`: one per model; `non_base`: one per model but the base), whether
it needs a base model, and how many models it merges. The kernels live beside this module, one module per
family (`linear`, `spherical`, `task_arithmetic`, `stock`); each receives the group's tensors already in the
compute dtype (mergekit's: the inputs' promoted dtype, or `dtype` when given) and returns the merged tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from ...errors import MapperError

MISSING: Any = object()


@dataclass(frozen=True)
class Parameter:
    """One parameter of a method: `kind` 'float' | 'bool' | 'int' | 'float?' (None allowed), `scope`
    'shared' | 'input' | 'non_base', and its default (MISSING: required)."""

    name: str
    kind: str
    scope: str = "shared"
    default: Any = MISSING

    @property
    def required(self) -> bool:
        """True when the method cannot run without a value."""
        return self.default is MISSING

    def validate(self, value: Any, where: str) -> Any:
        """`value` as this parameter's type (mergekit's pydantic coercions for numbers and booleans)."""
        if value is None and self.kind == "float?":
            return None
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if value in (0, 1) and not isinstance(value, float):
                return bool(value)
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
                return value.lower() in ("true", "yes", "1", "on")
        elif self.kind == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
        elif not isinstance(value, bool):
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        raise MapperError(f"Cannot use merge parameter {self.name!r} = {value!r} for {where}: it must be a {self.kind.rstrip('?')}.")


@dataclass(frozen=True)
class Method:
    """A merge method: kernel reference ('module:function' under workbench.mapper.merge), parameters, inputs."""

    name: str
    kernel: str
    parameters: tuple[Parameter, ...] = ()
    base: str = "ignored"  # 'required' | 'optional' | 'forbidden' | 'ignored'
    min_inputs: int = 1
    max_inputs: int | None = None
    min_non_base: int | None = None
    max_non_base: int | None = None
    random: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)  # fixed keyword arguments of the kernel (a family's variant)

    def parameter(self, name: str) -> Parameter | None:
        """The parameter called `name`, or None."""
        return next((p for p in self.parameters if p.name == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names this method knows."""
        return tuple(p.name for p in self.parameters)

    def kernel_function(self) -> Any:
        """The kernel callable (imported on first use: torch stays out of binding)."""
        module, _, name = self.kernel.partition(":")
        return getattr(import_module(f".{module}", __package__), name)

    def check_inputs(self, models: Sequence[str], base: str | None) -> str | None:
        """Why `models` (with `base`) cannot be merged by this method, in mergekit's terms; None when they can."""
        if self.base == "ignored":
            base = None
        has_base = base is not None and base in models
        if base is not None and not has_base:
            return f"base model {base!r} is not among the inputs {list(models)}"
        if self.base == "required" and not has_base:
            return f"{self.name} needs a base model (base=...)"
        if self.base == "forbidden" and has_base:
            return f"{self.name} takes no base model"
        count, non_base = len(models), len(models) - int(has_base)
        for what, number, low, high in (("inputs", count, self.min_inputs, self.max_inputs),
                                        ("models besides the base", non_base, self.min_non_base, self.max_non_base)):
            if low is None and high is None:
                continue
            low = low or 0
            if number < low or (high is not None and number > high):
                need = f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
                return f"{self.name} merges {need} {what}, got {number}"
        return None


def _gta(name: str, *, consensus: str | None, sparsify: str | None, normalize: bool, rescale: bool) -> Method:
    params = [
        Parameter("int8_mask", "bool", default=False), Parameter("normalize", "bool", default=normalize),
        Parameter("rescale", "bool", default=rescale), Parameter("lambda", "float", default=1.0),
        Parameter("weight", "float", "non_base"), Parameter("density", "float", "non_base", 1.0),
    ]
    if sparsify == "magnitude_outliers":
        params.append(Parameter("gamma", "float", "non_base", 0.01))
    if sparsify == "della_magprune":
        params.append(Parameter("epsilon", "float", "non_base", 0.15))
    return Method(name, "task_arithmetic:merge_task_vectors", tuple(params), base="required",
                  random=sparsify in ("random", "della_magprune"), options={"consensus": consensus, "sparsify": sparsify})


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("linear", "linear:linear", (Parameter("weight", "float", "input"), Parameter("normalize", "bool", default=True))),
    Method("passthrough", "linear:passthrough", (Parameter("scale", "float?", "input", None),), max_inputs=1),
    Method("nearswap", "linear:nearswap", (Parameter("t", "float"),), base="required", min_inputs=2, max_inputs=2),
    Method("slerp", "spherical:slerp", (Parameter("t", "float"),), base="required", min_inputs=2, max_inputs=2),
    Method("nuslerp", "spherical:nuslerp", (Parameter("weight", "float", "non_base"),
                                            Parameter("nuslerp_row_wise", "bool", default=False),
                                            Parameter("nuslerp_flatten", "bool", default=True)),
           base="optional", min_non_base=2, max_non_base=2),
    Method("multislerp", "spherical:multislerp", (Parameter("weight", "float", "non_base"),
                                                  Parameter("normalize_weights", "bool", default=True),
                                                  Parameter("eps", "float", default=1e-8)),
           base="optional", min_non_base=1),
    Method("karcher", "spherical:karcher", (Parameter("max_iter", "int", default=10), Parameter("tol", "float", default=1e-5))),
    _gta("task_arithmetic", consensus=None, sparsify=None, normalize=False, rescale=False),
    _gta("ties", consensus="sum", sparsify="magnitude", normalize=True, rescale=False),
    _gta("dare_ties", consensus="sum", sparsify="random", normalize=False, rescale=True),
    _gta("dare_linear", consensus=None, sparsify="random", normalize=False, rescale=True),
    _gta("breadcrumbs", consensus=None, sparsify="magnitude_outliers", normalize=False, rescale=False),
    _gta("breadcrumbs_ties", consensus="sum", sparsify="magnitude_outliers", normalize=False, rescale=False),
    _gta("della", consensus="sum", sparsify="della_magprune", normalize=True, rescale=True),
    _gta("della_linear", consensus=None, sparsify="della_magprune", normalize=False, rescale=True),
    Method("sce", "stock:sce", (Parameter("int8_mask", "bool", default=False), Parameter("select_topk", "float", default=1.0)),
           base="required"),
    Method("model_stock", "stock:model_stock", (Parameter("filter_wise", "bool", default=False),), base="required", min_inputs=3),
)}


def method(name: str) -> Method:
    """The method called `name`; MapperError listing the known ones otherwise."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise MapperError(f"Cannot merge with method {name!r}: unknown. Known methods: {', '.join(METHODS)}.") from None
