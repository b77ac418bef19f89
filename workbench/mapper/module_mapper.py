"""Mappers from a live module: the identity over its state keys, and checking any mapper against it.

`from_module(model)` names exactly the tensors a save of `model` writes (tied duplicates once), so
binding it to a checkpoint with rest='error' flags every missing or extra tensor; `check_module`
goes further and compares shapes and dtypes of any mapper's outputs with the module's keys (it is
`check_target` with the module as the target).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..module_state import module_state
from .base import Mapper
from .compose import Parallel
from .ops import Identity

if TYPE_CHECKING:  # pragma: no cover
    from .target import TargetReport


def from_module(model: Any) -> Mapper:
    """An identity mapper over `model`'s state keys, in state_dict order (tied duplicates left out)."""
    return Parallel(*[Identity(entry.key) for entry in module_state(model).values() if not entry.tied])


def check_module(model: Any, source: Any, mapper: Any = None, *, rest: str = "keep") -> TargetReport:
    """Check `mapper` (None: names as they are) on `source` against `model`'s state keys, from metadata only.

    Returns a TargetReport (see `check_target`): `ok`, `missing`, `unexpected`, `mismatched` (shape),
    `dtype_differs`, `matched`, `tied` and `frame`.
    """
    from .target import check_target

    return check_target(mapper, source, model, rest=rest)
