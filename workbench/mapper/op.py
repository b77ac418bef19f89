"""`Op`: the base of leaf operations (one step that reads named tensors and writes named tensors).

A leaf declares which dataclass fields hold tensor names; from that it gets template checks, fast
renaming of every name (template expansion, prefix scopes) and its input/output names. Subclasses
implement metadata inference (`_infer`), computation on torch tensors (`_compute`), byte recipes
(`_trace`) and inversion (`_invert`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from ..errors import MapperError
from ..names import check_name, check_placeholder_sets, is_template
from .base import Mapper, Meta
from .layout import Sym
from .patterns import check_globs
from .ranges import check_ranges, plain, without


class Op(Mapper):
    """A leaf operation. Subclasses are frozen dataclasses; names may be `{placeholder}` templates."""

    # Fields holding one name (None allowed for optional dst) and fields holding a tuple of names.
    NAME_FIELDS: ClassVar[tuple[str, ...]] = ()
    NAME_LIST_FIELDS: ClassVar[tuple[str, ...]] = ()

    # -- construction helpers ----------------------------------------------------------------------
    def _normalize(self) -> None:
        """Turn list fields into tuples and check names and placeholders (called from __post_init__)."""
        where = type(self).__name__
        for field in self.NAME_LIST_FIELDS:
            value = getattr(self, field)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise MapperError(f"Cannot build {where}: {field} must be a list of tensor names (got {value!r}).")
            names = tuple(value)
            for name in names:
                check_name(plain(name) if isinstance(name, str) else name, where)
            object.__setattr__(self, field, names)
        for field in self.NAME_FIELDS:
            value = getattr(self, field)
            if value is not None:
                check_name(plain(value) if isinstance(value, str) else value, where)
        inputs, outputs = self.inputs, self.outputs
        for label, names in (("input", inputs), ("output", outputs)):
            if len(set(names)) != len(names):
                dup = next(n for n in names if names.count(n) > 1)
                raise MapperError(f"Cannot build {where}: {label} {dup!r} is listed twice. List each tensor once.")
        check_placeholder_sets([without(n) for n in inputs], [without(n) for n in outputs], where)
        check_ranges(self, where)
        check_globs(self, where)

    def _set(self, field: str, value: Any) -> None:
        object.__setattr__(self, field, value)

    # -- names -------------------------------------------------------------------------------------
    # Every subclass provides `inputs` and `outputs`: the names it reads and writes, templates allowed.
    # (Plain attributes on Function, properties elsewhere; no base property, so a field can take the name.)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def is_template(self) -> bool:
        # A glob is not counted: a bound instance's real names may hold '[' or '*' (see patterns.has_globs).
        return any(is_template(name) for name in self.inputs) or any("*}" in name for name in self.outputs)

    def leaves(self) -> Iterator[Mapper]:
        yield self

    def rename_all(self, rename: Callable[[str], str]) -> Op:
        """The same operation with every tensor name passed through `rename` (no re-validation)."""
        clone = object.__new__(type(self))
        fields = clone.__dict__  # frozen dataclass without slots: writing the dict directly is the fast path
        fields.update(self.__dict__)
        for field in self.NAME_FIELDS:
            if fields[field] is not None:
                fields[field] = rename(fields[field])
        for field in self.NAME_LIST_FIELDS:
            fields[field] = tuple(rename(name) for name in fields[field])
        return clone

    def fill_names(self, values: dict[str, str]) -> Op:
        """`rename_all` with every template filled from `values` (the binder's hot path: no callback per name)."""
        clone = object.__new__(type(self))
        fields = clone.__dict__
        fields.update(self.__dict__)
        for field in self.NAME_FIELDS:
            text = fields[field]
            if text is not None and "{" in text:
                fields[field] = text.format_map(values)
        for field in self.NAME_LIST_FIELDS:
            fields[field] = tuple([text.format_map(values) if "{" in text else text for text in fields[field]])
        return clone

    # -- semantics (subclasses) --------------------------------------------------------------------
    def _infer(self, metas: list[Meta]) -> list[Meta]:
        """Output (dtype, shape) for input metadata; raise MapperError on a conflict."""
        raise NotImplementedError

    def _compute(self, tensors: list[Any]) -> list[Any]:
        """Output torch tensors for input torch tensors (already checked against `_infer`)."""
        raise NotImplementedError

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        """Symbolic outputs; by default no byte recipe (the op needs arithmetic)."""
        return [Sym(dtype, shape, None) for dtype, shape in self._infer([(s.dtype, s.shape) for s in syms])]

    def _invert(self, metas: list[Meta]) -> Mapper:
        """The operation that undoes this one, given this operation's input metadata."""
        raise MapperError(
            f"Cannot invert {self.short()}: {type(self).__name__} is not invertible. "
            "Write the reverse mapping by hand for this step."
        )

    def infer_outputs(self, inputs: Sequence[Any]) -> list[Any]:
        """Output TensorInfos (metadata only) for input TensorInfos, in `outputs` order."""
        from ..catalog import TensorInfo

        metas = [(info.dtype, tuple(info.shape)) for info in inputs]
        return [TensorInfo(name, dtype, shape) for name, (dtype, shape) in zip(self.outputs, self._infer(metas), strict=False)]


def build_unchecked(cls: type[Op], **fields: Any) -> Op:
    """Construct a leaf from already valid fields, skipping validation (hot paths: binding 100k names)."""
    op = object.__new__(cls)
    op.__dict__.update(fields)  # leaves are frozen dataclasses without slots (see `rename_all`): what object.__setattr__ does
    return op


def axis(dim: int, ndim: int, op: Op, what: str = "dim") -> int:
    """Normalize a possibly negative dim against `ndim`, or raise naming the operation."""
    if ndim == 0:
        raise MapperError(f"Cannot apply {op.short()}: it needs a tensor with dims, but the input is a scalar (0-D).")
    if not -ndim <= dim < ndim:
        raise MapperError(
            f"Cannot apply {op.short()}: {what}={dim} is out of range for a {ndim}-D tensor. "
            f"Use a dim between {-ndim} and {ndim - 1}."
        )
    return dim % ndim


def check_int(value: Any, field: str, where: str) -> int:
    """Validate an integer field at construction."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MapperError(f"Cannot build {where}: {field} must be an integer (got {value!r}).")
    return value
