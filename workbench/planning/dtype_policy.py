"""The `dtype=` option of plan/convert: every floating-point output is stored in one dtype.

Applied to a binding after the mapper, so it composes with any mapper. A whole-tensor copy becomes
a chunked cast (bounded memory); any other group keeps its op and casts its outputs after it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import is_float, normalize_dtype, to_torch
from ..mapper.groups import Binding, ByteSlice, Group


class CastOutputs:
    """An op that runs another op, then casts the named outputs to one dtype."""

    def __init__(self, op: Any, dtype: str, names: frozenset[str]) -> None:
        self.op = op
        self.dtype = dtype
        self.names = names

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The inner op's outputs, with the named ones cast."""
        target = to_torch(self.dtype)
        return {n: (t.to(target) if n in self.names else t) for n, t in self.op.apply(tensors).items()}

    def __repr__(self) -> str:
        return f"CastOutputs({self.op!r}, {self.dtype!r})"


def _whole_copy(group: Group) -> bool:
    if group.recipe is None or len(group.inputs) != 1 or len(group.outputs) != 1:
        return False
    src, out = group.inputs[0], group.outputs[0]
    if src.dtype != out.dtype or (src.shape != out.shape and src.numel != out.numel):  # same shape: same numel
        return False
    slices = group.recipe.get(out.name, ())
    return len(slices) == 1 and slices[0] == ByteSlice(src.name, 0, src.nbytes)


def cast_group(group: Group, dtype: str) -> Group:
    """`group` with its floating-point outputs stored as `dtype` (unchanged when none needs it)."""
    names = frozenset(o.name for o in group.outputs if o.dtype != dtype and is_float(o.dtype))
    if not names:
        return group
    outputs = tuple(TensorInfo(o.name, dtype, o.shape) if o.name in names else o for o in group.outputs)
    op = CastOutputs(group.op, dtype, names)
    label = f"{group.label or 'group'} -> {dtype}"
    chunk_cast = dtype if _whole_copy(group) else None
    if type(group) is not Group:  # a subclass may carry more fields: let dataclasses copy them
        return replace(group, outputs=outputs, op=op, recipe=None, chunk_cast=chunk_cast, label=label)
    # The constructor directly: `replace` inspects the fields again for every one of 100k groups.
    return Group(group.inputs, outputs, op, None, chunk_cast, label)


def apply_dtype(binding: Binding, dtype: Any) -> Binding:
    """A binding whose floating-point outputs are all `dtype` (a code, alias or torch dtype)."""
    code = normalize_dtype(dtype)
    return Binding([cast_group(g, code) for g in binding.groups], list(binding.problems), list(binding.dropped))
