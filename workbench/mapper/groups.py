"""What binding a mapper to a source produces: concrete dependency groups, problems, outputs.

This is the contract between the mapper (which decides what each output is made of) and the planner
and engine (which decide when and where to compute it). A `Group` is the smallest unit of work whose
inputs can be read, transformed and written independently of every other group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..catalog import TensorInfo

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


@dataclass(frozen=True, slots=True)
class ByteSlice:
    """Bytes [begin, end) of input tensor `source`, offsets relative to the start of its data."""

    source: str
    begin: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.begin


def _byte_slice_init():  # noqa: ANN202 - returns ByteSlice's __init__
    set_source, set_begin, set_end = (ByteSlice.__dict__[name].__set__ for name in ("source", "begin", "end"))

    def __init__(self: ByteSlice, source: str, begin: int, end: int) -> None:
        set_source(self, source)
        set_begin(self, begin)
        set_end(self, end)

    __init__.__qualname__ = "ByteSlice.__init__"
    return __init__


ByteSlice.__init__ = _byte_slice_init()  # type: ignore[method-assign]  # one per copied tensor: see catalog.TensorInfo


@dataclass(frozen=True)
class Group:
    """A connected unit of work: these source tensors in, these tensors out.

    `inputs` carry their source locations; `outputs` are metadata only (the planner lays them out).
    `op` is a concrete (template-free) mapper over exactly these names. When `recipe` is set, every
    output is the concatenation of the listed input byte slices, so the engine can move bytes without
    building tensors. When `chunk_cast` is set, the single output is the single input's elements
    converted to that dtype in order, so the engine can convert it in bounded chunks.
    """

    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    op: Any  # workbench.mapper.Mapper; Any to avoid an import cycle
    recipe: Mapping[str, tuple[ByteSlice, ...]] | None = None
    chunk_cast: str | None = None
    label: str = ""

    def __init__(self, inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...], op: Any,
                 recipe: Mapping[str, tuple[ByteSlice, ...]] | None = None, chunk_cast: str | None = None, label: str = "") -> None:
        # Filled through __dict__: the generated frozen __init__ (object.__setattr__ per field) made binding
        # 100k-tensor checkpoints measurably slower. Instances stay frozen.
        self.__dict__.update(inputs=inputs, outputs=outputs, op=op, recipe=recipe, chunk_cast=chunk_cast, label=label)

    @property
    def bytes_in(self) -> int:
        return sum(t.nbytes for t in self.inputs)

    @property
    def bytes_out(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def byte_level(self) -> bool:
        return self.recipe is not None

    @property
    def needs_torch(self) -> bool:
        return self.recipe is None

    def apply(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Compute this group's outputs from its input tensors (torch), checking declared metadata."""
        return self.op.apply(dict(tensors))


Severity = Literal["error", "warning"]


# What a problem is about, set where it is raised (front ends group and offer fixes by it, never by wording):
PROBLEM_KINDS: dict[str, str] = {
    "missing": "an input or template names no tensor of the source (or of the steps before)",
    "clash": "two operations (or an output and a non-tensor entry) read or write one name",
    "overwrite": "an output lands on a tensor left in place that nothing consumes",
    "unconverted": "tensors a preset claims are left under their source names",
    "unmapped": "source tensors no operation maps, where the rest policy or a scoped source forbids that",
    "invalid": "an operation cannot apply to its inputs (shapes, dtypes, sizes)",
    "unsupported": "a step a preset could not express (`M.Unsupported`)",
    "empty": "the mapper produces no tensors",
    "layout": "the output layout: shard sizes, what the output format can hold",
    "dtype": "the dtype policy: tensors it cannot cast",
    "metadata": "source header metadata the output does not keep",
    "objects": "non-tensor entries of the source",
    "ranks": "how the work spreads over ranks, or what cannot run on other processes",
    "destination": "the destination folder: not empty, locked, the source's own, too little disk",
    "preset": "outputs right as tensors that other tools read wrongly (partial FP8 tiles, padded vocabulary)",
}
ProblemKind = Literal["missing", "clash", "overwrite", "unconverted", "unmapped", "invalid", "unsupported", "empty", "layout",
                      "dtype", "metadata", "objects", "ranks", "destination", "preset"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong (error) or worth knowing (warning), phrased so a user can act on it.

    `kind` (one of `PROBLEM_KINDS`) says what it is about, so that code can group or fix problems without
    reading the message; every problem the workbench raises sets it."""

    severity: Severity
    message: str
    op: str | None = None
    tensor: str | None = None
    kind: ProblemKind | Literal[""] = field(default="", kw_only=True)


@dataclass
class Binding:
    """A mapper bound to a source catalog: the groups to run and what is wrong, if anything."""

    groups: list[Group]
    problems: list[Problem] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # source tensors deliberately not carried over

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def outputs(self) -> dict[str, TensorInfo]:
        return {t.name: t for g in self.groups for t in g.outputs}

    def raise_for_problems(self) -> Binding:
        """Raise MapperError listing the errors, if any; otherwise return self (for chaining)."""
        errors = self.errors
        if errors:
            from ..errors import MapperError

            more = f" (and {len(errors) - 1} more problem(s); see binding.problems)" if len(errors) > 1 else ""
            raise MapperError(errors[0].message + more, tensor=errors[0].tensor)
        return self

    def problems_frame(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(
            [(p.severity, p.op, p.tensor, p.message) for p in self.problems],
            columns=["severity", "op", "tensor", "message"],
        )

    def outputs_frame(self) -> pd.DataFrame:
        import pandas as pd

        rows = [
            (t.name, t.dtype, t.shape, t.numel, t.nbytes, g.label, len(g.inputs))
            for g in self.groups
            for t in g.outputs
        ]
        return pd.DataFrame(rows, columns=["name", "dtype", "shape", "numel", "nbytes", "op", "n_inputs"]).set_index("name")
