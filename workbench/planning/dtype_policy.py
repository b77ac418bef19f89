"""The `dtype=` option of plan/convert: every floating-point output is stored in one floating-point dtype.

Only floats are cast (integer and bool buffers keep their dtype), only into a float dtype the engine produces
(`dtypes.CAST_TARGETS`), and only from floats it can read (F4/F6 are kept, with a warning in the plan).

Applied to a binding after the mapper, so it composes with any mapper. A whole-tensor copy becomes
a chunked cast (bounded memory); any other group keeps its op and casts its outputs after it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import CAST_SOURCES, is_float, policy_dtype
from ..mapper.groups import Binding, Group, Problem
from ..overflow import cast


class CastOutputs:
    """An op that runs another op, then casts the named outputs to one dtype."""

    def __init__(self, op: Any, dtype: str, names: frozenset[str]) -> None:
        self.op = op
        self.dtype = dtype
        self.names = names

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The inner op's outputs, with the named ones cast."""
        return {n: (cast(t, self.dtype, n) if n in self.names else t) for n, t in self.op.apply(tensors).items()}

    @property
    def cast_after(self) -> tuple[Any, str, frozenset[str]]:
        """(inner op, dtype, names cast): what `mapper.pieces` walks to cut the output into pieces, each cast."""
        return self.op, self.dtype, self.names

    def leaves(self) -> Any:
        """The inner op's leaf operations (the cast adds none a reader of the mapper would look for)."""
        leaves = getattr(self.op, "leaves", None)
        return leaves() if leaves is not None else iter(())

    def __repr__(self) -> str:
        return f"CastOutputs({self.op!r}, {self.dtype!r})"


def _whole_copy(group: Group) -> bool:
    if group.recipe is None or len(group.inputs) != 1 or len(group.outputs) != 1:
        return False
    src, out = group.inputs[0], group.outputs[0]
    if src.dtype != out.dtype or (src.shape != out.shape and src.numel != out.numel):  # same shape: same numel
        return False
    slices = group.recipe.get(out.name, ())
    if len(slices) != 1:
        return False
    piece = slices[0]  # compared field by field: no ByteSlice built per group
    return piece.source == src.name and piece.begin == 0 and piece.end == src.nbytes


def policy_casts(dtype: str, target: str) -> bool:
    """True when the policy casts an output of `dtype`: a float other than `target` the engine can read as values."""
    return dtype != target and dtype in CAST_SOURCES


def policy_keeps(dtype: str, target: str) -> bool:
    """True for a float dtype the policy cannot cast (F4, F6): such outputs keep it, with a warning (`kept_warnings`)."""
    return is_float(dtype) and dtype != target and dtype not in CAST_SOURCES


def cast_group(group: Group, dtype: str) -> Group:
    """`group` with its floating-point outputs stored as `dtype` (unchanged when none needs it).

    Integer, bool and complex outputs are never cast; F4/F6 outputs (which no converter reads) are kept as they are.
    """
    names = frozenset(o.name for o in group.outputs if policy_casts(o.dtype, dtype))
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


def kept_warnings(kept: dict[str, list[str]], code: str) -> list[Problem]:
    """A warning per float dtype the policy cannot cast (F4, F6; `kept`: dtype -> output names): those keep their dtype."""
    return [
        Problem("warning", f"Cannot cast {len(names)} {kind} tensor{'s' if len(names) != 1 else ''} to {code} (e.g. "
                           f"{names[0]!r}): the engine cannot read {kind} values. They are copied as {kind}, unchanged.",
                tensor=names[0], kind="dtype")
        for kind, names in sorted(kept.items()) if names
    ]


def apply_dtype(binding: Binding, dtype: Any) -> Binding:
    """A binding whose floating-point outputs are all `dtype` (a code, alias or torch dtype of a float the engine
    produces; anything else is a PlanError listing the accepted names)."""
    code = policy_dtype(dtype)
    groups: list[Group] = []
    cast_here: dict[str, bool] = {}  # output dtype -> cast by the policy
    kept: dict[str, list[str]] = {}  # float dtype the policy cannot cast -> output names
    suffix = f" -> {code}"
    for group in binding.groups:  # cast_group, spelled out for the common one-output group: 100k times on big checkpoints
        outputs = group.outputs
        for out in outputs:
            here = cast_here.get(out.dtype)
            if here is None:
                here = cast_here[out.dtype] = policy_casts(out.dtype, code)
                if policy_keeps(out.dtype, code):
                    kept[out.dtype] = []
            if not here and out.dtype in kept:
                kept[out.dtype].append(out.name)
        if len(outputs) != 1 or type(group) is not Group:
            groups.append(cast_group(group, code))
            continue
        out = outputs[0]
        if not cast_here[out.dtype]:
            groups.append(group)
            continue
        recipe = group.recipe
        whole = False
        if recipe is not None and len(group.inputs) == 1:
            src = group.inputs[0]
            if src.dtype == out.dtype and src.shape == out.shape:  # _whole_copy without counting elements twice
                slices = recipe.get(out.name, ())
                if len(slices) == 1:
                    piece = slices[0]
                    whole = piece.source == src.name and piece.begin == 0 and piece.end == src.nbytes
            else:
                whole = _whole_copy(group)
        groups.append(Group(group.inputs, (TensorInfo(out.name, code, out.shape),), CastOutputs(group.op, code, frozenset((out.name,))),
                            None, code if whole else None, (group.label or "group") + suffix))
    problems = list(binding.problems) + kept_warnings(kept, code)
    return Binding(groups, problems, list(binding.dropped))
