"""`Mapper.apply`: run a mapper on in-memory tensors, binding it to their metadata first when it holds
templates. Kept apart from `evaluate` (which bound groups call) so that evaluation never depends on
binding: the binder traces recipes through `evaluate`, and only this front door needs both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Mapper
from .bind import bind
from .claim import Claim
from .evaluate import apply_concrete, checked_compute
from .patterns import has_globs


def apply_mapper(mapper: Mapper, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """`Mapper.apply`: run directly when concrete; otherwise bind to the tensors' metadata first."""
    bound_first = any(isinstance(leaf, Claim) or has_globs(leaf) for leaf in mapper.leaves())  # a Claim checks at bind time
    if not mapper.is_template and not bound_first:
        return apply_concrete(mapper, tensors, checked_compute)
    binding = bind(mapper, tensors, rest="keep").raise_for_problems()
    out: dict[str, Any] = {}
    for group in binding.groups:
        out.update(group.apply({info.name: tensors[info.name] for info in group.inputs}))
    return out
