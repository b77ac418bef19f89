"""`Claim`: a check that a conversion left no source tensor of a layout it claims untouched.

A preset converts a family of tensors (say, every tensor of an HF Llama decoder). A source tensor
that looks like it belongs to that family but that the preset does not know (a q/k norm, a bias the
config did not announce, an extra buffer) would otherwise pass through under its old name, next to
converted ones: a half-converted checkpoint with an OK plan. A `Claim` placed after the conversion
steps turns every such leftover into a plan problem naming it. It reads the state and changes
nothing, so it has no effect on groups, recipes or execution.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import MapperError
from .base import NoTensorLeaf

_SHOWN = 5


@dataclass(frozen=True, repr=False)
class Claim(NoTensorLeaf):
    """Source tensors whose whole name matches the regular expression `pattern` must not be left untouched.

    `family` names the layout in messages ("HF Llama (hf_to_meta)"); `hint` says how to fix a leftover; `effect`
    what a leftover would do to the output (a format that drops what it cannot name says so).
    A source tensor counts as left when it is still there under its source name, unread by any step.
    """

    family: str
    pattern: str
    hint: str = "Convert or drop them in a step before this one (e.g. M.Drop(name)), or write the mapper by hand."
    effect: str = "so the output would mix both layouts"

    def __post_init__(self) -> None:
        for field in ("family", "pattern", "hint", "effect"):
            if not isinstance(getattr(self, field), str):
                raise MapperError(f"Cannot build Claim: {field} must be a string (got {getattr(self, field)!r}).")
        try:
            re.compile(self.pattern)
        except re.error as exc:
            # quoted as typed: a repr would double every backslash of the regular expression
            raise MapperError(f"Cannot build Claim: pattern '{self.pattern}' is not a regular expression ({exc}).") from None

    def leftovers(self, names: Iterator[str] | list[str]) -> list[str]:
        """The names among `names` (untouched source tensors) that this claim covers."""
        compiled = re.compile(self.pattern)
        return [name for name in names if compiled.fullmatch(name)]

    def message(self, left: list[str]) -> str:
        """The problem text for `left` (at least one name)."""
        shown = ", ".join(repr(name) for name in left[:_SHOWN])
        more = f" and {len(left) - _SHOWN} more" if len(left) > _SHOWN else ""
        return (
            f"Cannot convert the {self.family} layout completely: {len(left)} source tensor(s) of that layout are left "
            f"unconverted under their old names ({shown}{more}), {self.effect}. {self.hint}"
        )


def template_regex(template: str) -> str:
    """A regular expression for a workbench name template: each `{placeholder}` is one dotted segment."""
    parts = re.split(r"(\{[^{}]*\})", template)
    return "".join("[^.]+" if part.startswith("{") else re.escape(part) for part in parts)
