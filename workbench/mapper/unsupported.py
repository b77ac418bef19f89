"""`Unsupported`: a step a preset cannot express, kept in the mapper so the plan reports it.

A preset that meets tensors it does not understand (an operation of transformers' registry with no
workbench equivalent, a tensor the target model has no parameter for) must never skip them silently:
it emits `Unsupported(names, reason)`, and binding turns every instance into a problem that names the
tensor and the reason. The plan is then not OK until the user drops, maps or fixes those tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MapperError
from .base import Mapper, Meta
from .op import Op


@dataclass(frozen=True, repr=False)
class Unsupported(Op):
    """Tensors `names` that a preset could not convert, and why (each bound instance is a plan problem)."""

    names: tuple[str, ...]
    reason: str

    NAME_LIST_FIELDS = ("names",)

    def __post_init__(self) -> None:
        self._normalize()
        if not isinstance(self.reason, str) or not self.reason:
            raise MapperError("Cannot build Unsupported: give the reason as a non-empty string.")

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.names

    @property
    def outputs(self) -> tuple[str, ...]:
        return ()

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        more = f" (and {len(self.names) - 1} more)" if len(self.names) > 1 else ""
        raise MapperError(f"Cannot convert {self.names[0]!r}{more}: {self.reason}")

    def _invert(self, metas: list[Meta]) -> Mapper:
        raise MapperError(f"Cannot invert {self.short()}: the step was not converted in the first place. {self.reason}")
