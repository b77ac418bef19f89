"""The `Mapper` base class: what every operation and composition can do.

Operations are values (frozen dataclasses, equal by value); the heavy machinery (binding, applying,
inverting, exporting) lives in sibling modules and is reached through these methods, imported lazily
so that `import workbench.mapper` stays cheap and torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..api_types import Rest

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .groups import Binding


# (dtype code, shape): the metadata inference works on, without names or locations.
Meta = tuple[str, tuple[int, ...]]


class Mapper:
    """A description of a layout conversion: source tensors in, target tensors out.

    Source tensors that the mapper does not mention pass through unchanged (at bind time `rest`
    decides what happens to them at the top level).
    """

    __slots__ = ()

    # -- structure -------------------------------------------------------------------------------
    def leaves(self) -> Iterator[Mapper]:
        """Every leaf operation, depth first, in execution order."""
        yield self

    @property
    def is_template(self) -> bool:
        """True when some name holds a `{placeholder}` (the mapper must be bound to be applied)."""
        return any(leaf.is_template for leaf in self.leaves())

    def short(self) -> str:
        """A one-line description for messages and tables."""
        from .export import short_repr

        return short_repr(self)

    # -- binding and applying ----------------------------------------------------------------------
    def bind(self, source: Any, rest: Rest = "keep") -> Binding:
        """Expand templates against `source` and return the concrete dependency groups and problems.

        `source` is a Catalog, a Mapping name -> TensorInfo (or tensor), or an object with `.catalog`.
        Never raises for user mistakes: problems are collected in the Binding.
        """
        from .bind import bind

        return bind(self, source, rest=rest)

    def preview(self, source: Any, rest: Rest = "keep") -> pd.DataFrame:
        """Output names, dtypes and shapes this mapper would produce from `source` (no data read)."""
        return self.bind(source, rest=rest).raise_for_problems().outputs_frame()

    def infer_outputs(self, inputs: Sequence[Any]) -> list[Any]:
        """Output TensorInfos (metadata only) that this mapper makes from input TensorInfos.

        Raises MapperError when the mapper does not fit the inputs (`bind` collects problems instead).
        """
        source = {info.name: info for info in inputs}
        return list(self.bind(source, rest="drop").raise_for_problems().outputs.values())

    def apply(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Convert a name -> torch.Tensor mapping; unmentioned tensors pass through.

        Each operation's results are checked against its inferred dtype and shape.
        """
        from .apply import apply_mapper

        return apply_mapper(self, tensors)

    def inverse(self, source: Any) -> Mapper:
        """A mapper that undoes this one; `source` is what this mapper reads (it supplies split sizes)."""
        from .inverse import inverse

        return inverse(self, source)

    # -- export ------------------------------------------------------------------------------------
    def to_code(self) -> str:
        """A Python module defining `mapper`; executing it rebuilds a mapper equal to this one."""
        from .export import to_code

        return to_code(self)

    def to_json(self, indent: int | None = None) -> str:
        """A JSON document that `workbench.mapper.from_json` turns back into an equal mapper."""
        from .export import to_json

        return to_json(self, indent=indent)

    def __repr__(self) -> str:
        from .export import code_expr

        return code_expr(self, prefix="M.")


class NoTensorLeaf(Mapper):
    """A leaf that reads and writes no tensor: it states something about the conversion (`Claim`: nothing of a layout
    is left unconverted; `ConfigUpdate`: config.json must change), checked or carried by the planner."""

    __slots__ = ()

    @property
    def is_template(self) -> bool:
        return False

    def leaves(self) -> Iterator[Mapper]:
        yield self

    @property
    def inputs(self) -> tuple[str, ...]:
        return ()

    @property
    def outputs(self) -> tuple[str, ...]:
        return ()
