"""`Refused`: a setting of a merge config the workbench does not carry out, kept in the mapper so the plan says so.

mergekit ignores keys it does not know; the workbench refuses them. A config reader that meets such a key
(`modules:`, `chat_template`, a misspelt top-level key) emits `Refused(key, reason)`: binding reads and writes
no tensor and reports one plan problem naming the key, so the plan is not OK until the config is fixed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import MapperError
from ..base import Meta
from ..op import Op


@dataclass(frozen=True, repr=False)
class Refused(Op):
    """The config key `key` that cannot be carried out, and why (one plan problem when bound)."""

    key: str
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or not isinstance(self.reason, str) or not self.reason:
            raise MapperError("Cannot build Refused: give the key and the reason as non-empty strings.")

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("*",)

    @property
    def outputs(self) -> tuple[str, ...]:
        return ()

    def message(self) -> str:
        """The problem's text."""
        return f"Cannot merge: config key {self.key!r} is not supported: {self.reason}"

    def bind_instances(self, nodes: Mapping[str, Meta | None]) -> tuple[list[Op], list[tuple[str, str | None, str]]]:
        """No instance; one problem naming the key."""
        return [], [(self.message(), None, "unsupported")]

    def _infer(self, metas: list[Meta]) -> list[Meta]:  # pragma: no cover - binding reports it first
        raise MapperError(self.message())
