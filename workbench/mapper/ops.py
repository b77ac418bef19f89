"""The leaf vocabulary: rename, identity, drop, concat, stack, split, unstack, transpose, reshape, cast.

Each operation is a frozen dataclass (equal by value, hashable) that infers output dtype and shape
from input metadata, computes on torch tensors, describes its byte recipe when it only moves bytes,
and knows its inverse given the metadata it was applied to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..dtypes import UNPRODUCIBLE, dtype_bits, normalize_dtype, to_torch
from ..errors import MapperError, WorkbenchError
from .base import Mapper, Meta
from .layout import Sym, concat_slices, split_slices, transpose_slices
from .op import Op, axis, check_int


def _same_dtype(metas: list[Meta], op: Op, names: Sequence[str]) -> str:
    dtype = metas[0][0]
    for name, (other, _) in zip(names, metas, strict=False):
        if other != dtype:
            raise MapperError(
                f"Cannot apply {op.short()}: inputs have different dtypes ({names[0]!r} is {dtype}, {name!r} is {other}). "
                "Cast them to one dtype first (M.Cast)."
            )
    return dtype


def _packed(part: Any) -> Any:
    """A part of a tensor as its own row-major tensor (no odd strides, no storage shared with the whole)."""
    import torch

    return part.clone(memory_format=torch.contiguous_format)


def _lineage(sym: Sym) -> tuple[str | None, int]:
    return sym.elems_of, sym.casts


# Bases holding what ops that work alike share (semantics, name fields, construction checks). They are not
# dataclasses: each op still declares its own fields, so positional order and exported arguments stay its own.
class _PassThrough(Op):
    """Base of Rename and Identity: the one output is the one input, unchanged (metadata, values and bytes)."""

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        return [metas[0]]

    def _compute(self, tensors: list[Any]) -> list[Any]:
        return [tensors[0]]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        return [syms[0]]


class _Join(Op):
    """Base of Concat and Stack: the tensors `srcs`, joined along `dim`, become the one tensor `dst`."""

    srcs: tuple[str, ...]
    dst: str
    dim: int

    NAME_FIELDS = ("dst",)
    NAME_LIST_FIELDS = ("srcs",)
    EMPTY_FIX = ""  # what to do when srcs is empty, in the op's words

    def __post_init__(self) -> None:
        self._normalize()
        check_int(self.dim, "dim", type(self).__name__)
        if not self.srcs:
            raise MapperError(f"Cannot build {type(self).__name__}: srcs is empty. {self.EMPTY_FIX}")

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.srcs

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.dst,)


class _Cut(Op):
    """Base of Split and Unstack: the one tensor `src`, cut along `dim`, becomes the tensors `dsts`."""

    src: str
    dsts: tuple[str, ...]
    dim: int

    NAME_FIELDS = ("src",)
    NAME_LIST_FIELDS = ("dsts",)
    EMPTY_FIX = ""  # what to do when dsts is empty, in the op's words

    def __post_init__(self) -> None:
        self._normalize()
        check_int(self.dim, "dim", type(self).__name__)
        if not self.dsts:
            raise MapperError(f"Cannot build {type(self).__name__}: dsts is empty. {self.EMPTY_FIX}")

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.src,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.dsts


class _Rewrite(Op):
    """Base of Transpose, Reshape and Cast: one tensor `name` in, the result written to `dst` (over `name` if None)."""

    name: str
    dst: str | None

    NAME_FIELDS = ("name", "dst")

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.dst or self.name,)


@dataclass(frozen=True, repr=False)
class Rename(_PassThrough):
    """Give tensor `src` the name `dst` (bytes unchanged)."""

    src: str
    dst: str

    NAME_FIELDS = ("src", "dst")

    def __post_init__(self) -> None:
        self._normalize()

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.src,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.dst,)

    def _invert(self, metas: list[Meta]) -> Mapper:
        return Rename(self.dst, self.src)


@dataclass(frozen=True, repr=False)
class Identity(_PassThrough):
    """Keep tensor `name` as it is (mentioning it explicitly, e.g. so rest='error' accepts it)."""

    name: str

    NAME_FIELDS = ("name",)

    def __post_init__(self) -> None:
        self._normalize()

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.name,)

    def _invert(self, metas: list[Meta]) -> Mapper:
        return self


@dataclass(frozen=True, repr=False)
class Drop(Op):
    """Leave tensor `name` out of the result."""

    name: str

    NAME_FIELDS = ("name",)

    def __post_init__(self) -> None:
        self._normalize()

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.name,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return ()

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        return []

    def _compute(self, tensors: list[Any]) -> list[Any]:
        return []

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        return []

    def _invert(self, metas: list[Meta]) -> Mapper:
        raise MapperError(
            f"Cannot invert {self.short()}: the dropped tensor's data is gone. "
            "Keep the tensor (remove the Drop) if the conversion must be reversible."
        )


@dataclass(frozen=True, repr=False)
class Concat(_Join):
    """Join `srcs` along `dim` into `dst` (shapes must match outside `dim`)."""

    srcs: tuple[str, ...]
    dst: str
    dim: int = 0

    EMPTY_FIX = "List the tensors to concatenate."

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        dtype = _same_dtype(metas, self, self.srcs)
        first = metas[0][1]
        dim = axis(self.dim, max(len(first), 1), self)
        for name, (_, shape) in zip(self.srcs, metas, strict=False):
            if len(shape) != len(first) or shape[:dim] != first[:dim] or shape[dim + 1:] != first[dim + 1:]:
                raise MapperError(
                    f"Cannot apply {self.short()}: shapes differ outside dim {self.dim} "
                    f"({self.srcs[0]!r} is {list(first)}, {name!r} is {list(shape)}). "
                    "Concatenate tensors whose other dims match, or concatenate along another dim."
                )
        total = sum(shape[dim] for _, shape in metas)
        return [(dtype, first[:dim] + (total,) + first[dim + 1:])]

    def _compute(self, tensors: list[Any]) -> list[Any]:
        import torch

        return [torch.cat(tensors, dim=self.dim)]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        ((dtype, shape),) = self._infer([(s.dtype, s.shape) for s in syms])
        dim = self.dim % len(shape)
        return [Sym(dtype, shape, concat_slices(syms, dim, dtype_bits(dtype)))]

    def _invert(self, metas: list[Meta]) -> Mapper:
        dim = axis(self.dim, len(metas[0][1]), self)
        return Split(self.dst, self.srcs, sizes=tuple(shape[dim] for _, shape in metas), dim=self.dim)


@dataclass(frozen=True, repr=False)
class Stack(_Join):
    """Stack equally shaped `srcs` along a new `dim` into `dst`."""

    srcs: tuple[str, ...]
    dst: str
    dim: int = 0

    EMPTY_FIX = "List the tensors to stack."

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        dtype = _same_dtype(metas, self, self.srcs)
        first = metas[0][1]
        for name, (_, shape) in zip(self.srcs, metas, strict=False):
            if shape != first:
                raise MapperError(
                    f"Cannot apply {self.short()}: inputs must have equal shapes "
                    f"({self.srcs[0]!r} is {list(first)}, {name!r} is {list(shape)}). Stack tensors of one shape, or use Concat."
                )
        dim = axis(self.dim, len(first) + 1, self)
        return [(dtype, first[:dim] + (len(metas),) + first[dim:])]

    def _compute(self, tensors: list[Any]) -> list[Any]:
        import torch

        return [torch.stack(tensors, dim=self.dim)]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        ((dtype, shape),) = self._infer([(s.dtype, s.shape) for s in syms])
        dim = self.dim % len(shape)
        unsqueezed = [Sym(s.dtype, s.shape[:dim] + (1,) + s.shape[dim:], s.slices) for s in syms]
        return [Sym(dtype, shape, concat_slices(unsqueezed, dim, dtype_bits(dtype)))]

    def _invert(self, metas: list[Meta]) -> Mapper:
        return Unstack(self.dst, self.srcs, dim=self.dim)


@dataclass(frozen=True, repr=False)
class Split(_Cut):
    """Cut `src` along `dim` into `dsts`: by `sizes`, or into equal parts when sizes is None."""

    src: str
    dsts: tuple[str, ...]
    sizes: tuple[int, ...] | None = None
    dim: int = 0

    EMPTY_FIX = "List the names of the parts."

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sizes is not None:
            sizes = tuple(check_int(size, "sizes", "Split") for size in self.sizes)
            ranged = any("*}" in name for name in self.dsts)  # ranged outputs: check_ranges checked the count
            if (len(sizes) != len(self.dsts) and not ranged) or any(size < 0 for size in sizes):
                raise MapperError(
                    f"Cannot build Split of {self.src!r}: {len(sizes)} sizes {list(sizes)} for {len(self.dsts)} parts. "
                    "Give one non-negative size per part, or sizes=None for equal parts."
                )
            self._set("sizes", sizes)

    def _part_sizes(self, shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
        length = shape[dim]
        if self.sizes is None:
            parts = len(self.dsts)
            if length % parts:
                raise MapperError(
                    f"Cannot apply {self.short()}: dim {self.dim} has {length} entries, which do not split into "
                    f"{parts} equal parts. Give explicit sizes that sum to {length}."
                )
            return (length // parts,) * parts
        if sum(self.sizes) != length:
            raise MapperError(
                f"Cannot apply {self.short()}: sizes {list(self.sizes)} sum to {sum(self.sizes)}, but dim {self.dim} of "
                f"{self.src!r} has {length} entries {list(shape)}. Give sizes that sum to {length}."
            )
        return self.sizes

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        dtype, shape = metas[0]
        dim = axis(self.dim, len(shape), self)
        return [(dtype, shape[:dim] + (size,) + shape[dim + 1:]) for size in self._part_sizes(shape, dim)]

    def _compute(self, tensors: list[Any]) -> list[Any]:
        dim = self.dim % tensors[0].dim()
        sizes = self._part_sizes(tuple(tensors[0].shape), dim)
        return [_packed(part) for part in tensors[0].split(list(sizes), dim=dim)]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        source = syms[0]
        dim = axis(self.dim, len(source.shape), self)
        sizes = self._part_sizes(source.shape, dim)
        parts = split_slices(source, dim, sizes, dtype_bits(source.dtype))
        return [Sym(dtype, shape, slices) for (dtype, shape), slices in zip(self._infer([(source.dtype, source.shape)]), parts, strict=False)]

    def _invert(self, metas: list[Meta]) -> Mapper:
        return Concat(self.dsts, self.src, dim=self.dim)


@dataclass(frozen=True, repr=False)
class Unstack(_Cut):
    """Take `src` apart along `dim` into `dsts`, one per index (the dim disappears)."""

    src: str
    dsts: tuple[str, ...]
    dim: int = 0

    EMPTY_FIX = "List one name per index."

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        dtype, shape = metas[0]
        dim = axis(self.dim, len(shape), self)
        if shape[dim] != len(self.dsts):
            raise MapperError(
                f"Cannot apply {self.short()}: dim {self.dim} of {self.src!r} has {shape[dim]} entries {list(shape)} "
                f"but {len(self.dsts)} names were given. Give one name per entry."
            )
        return [(dtype, shape[:dim] + shape[dim + 1:])] * len(self.dsts)

    def _compute(self, tensors: list[Any]) -> list[Any]:
        return [_packed(part) for part in tensors[0].unbind(self.dim)]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        source = syms[0]
        metas = self._infer([(source.dtype, source.shape)])
        dim = self.dim % len(source.shape)
        parts = split_slices(source, dim, (1,) * len(self.dsts), dtype_bits(source.dtype))
        return [Sym(dtype, shape, slices) for (dtype, shape), slices in zip(metas, parts, strict=False)]

    def _invert(self, metas: list[Meta]) -> Mapper:
        return Stack(self.dsts, self.src, dim=self.dim)


@dataclass(frozen=True, repr=False)
class Transpose(_Rewrite):
    """Swap dims `dim0` and `dim1` of `name` (written to `dst` when given)."""

    name: str
    dim0: int = 0
    dim1: int = 1
    dst: str | None = None

    def __post_init__(self) -> None:
        self._normalize()
        check_int(self.dim0, "dim0", "Transpose")
        check_int(self.dim1, "dim1", "Transpose")

    def _dims(self, ndim: int) -> tuple[int, int]:
        return axis(self.dim0, ndim, self, "dim0"), axis(self.dim1, ndim, self, "dim1")

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        dtype, shape = metas[0]
        a, b = self._dims(len(shape))
        out = list(shape)
        out[a], out[b] = out[b], out[a]
        return [(dtype, tuple(out))]

    def _compute(self, tensors: list[Any]) -> list[Any]:
        return [tensors[0].transpose(self.dim0, self.dim1).contiguous()]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        source = syms[0]
        ((dtype, shape),) = self._infer([(source.dtype, source.shape)])
        a, b = self._dims(len(source.shape))
        return [Sym(dtype, shape, transpose_slices(source, a, b, dtype_bits(dtype)))]

    def _invert(self, metas: list[Meta]) -> Mapper:
        return Transpose(self.dst or self.name, self.dim0, self.dim1, dst=self.name if self.dst else None)


@dataclass(frozen=True, repr=False)
class Reshape(_Rewrite):
    """View `name` with another `shape` of the same size (one entry may be -1), written to `dst` if given."""

    name: str
    shape: tuple[int, ...]
    dst: str | None = None

    def __post_init__(self) -> None:
        self._normalize()
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Sequence):
            raise MapperError(f"Cannot build Reshape of {self.name!r}: shape must be a list of integers (got {self.shape!r}).")
        shape = tuple(check_int(size, "shape", "Reshape") for size in self.shape)
        if shape.count(-1) > 1 or any(size < -1 for size in shape):
            raise MapperError(
                f"Cannot build Reshape of {self.name!r}: shape {list(shape)} may hold at most one -1 and no other negative size."
            )
        self._set("shape", shape)

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        dtype, shape = metas[0]
        numel = math.prod(shape)
        known = math.prod(size for size in self.shape if size != -1)
        if -1 in self.shape:
            if known == 0 or numel % known:
                raise MapperError(
                    f"Cannot apply {self.short()}: {self.name!r} has shape {list(shape)} ({numel} elements), "
                    f"which does not fit {list(self.shape)}. Give a shape with {numel} elements."
                )
            out = tuple(numel // known if size == -1 else size for size in self.shape)
        elif known != numel:
            raise MapperError(
                f"Cannot apply {self.short()}: {self.name!r} has shape {list(shape)} ({numel} elements), but "
                f"{list(self.shape)} holds {known}. Give a shape with {numel} elements."
            )
        else:
            out = self.shape
        return [(dtype, out)]

    def _compute(self, tensors: list[Any]) -> list[Any]:
        return [tensors[0].reshape(self.shape)]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        source = syms[0]
        ((dtype, shape),) = self._infer([(source.dtype, source.shape)])
        return [Sym(dtype, shape, source.slices, *_lineage(source))]

    def _invert(self, metas: list[Meta]) -> Mapper:
        return Reshape(self.dst or self.name, metas[0][1], dst=self.name if self.dst else None)


# Conversions that represent every value of the source dtype exactly, so casting back restores it.
_WIDER: dict[str, tuple[str, ...]] = {
    "BOOL": ("U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64"),
    "U8": ("I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64"),
    "I8": ("I16", "I32", "I64", "F16", "BF16", "F32", "F64"),
    "U16": ("I32", "U32", "I64", "U64", "F32", "F64"),
    "I16": ("I32", "I64", "F32", "F64"),
    "U32": ("I64", "U64", "F64"),
    "I32": ("I64", "F64"),
    "F8_E4M3": ("F16", "BF16", "F32", "F64"),
    "F8_E5M2": ("F16", "BF16", "F32", "F64"),
    "F16": ("F32", "F64"),
    "BF16": ("F32", "F64"),
    "F32": ("F64",),
}


def is_lossless_cast(source: str, target: str) -> bool:
    """True when every `source` value survives a cast to `target` and back."""
    return source == target or target in _WIDER.get(source, ())


@dataclass(frozen=True, repr=False)
class Cast(_Rewrite):
    """Convert `name` to `dtype` (a safetensors code or alias such as 'bf16'), written to `dst` if given.

    Unlike a dtype policy, an explicit cast may target integers or bool (masks, indices): the user named the
    tensor. Values the target cannot hold are counted as overflow (`workbench.overflow`); F4/F6 are refused.
    """

    name: str
    dtype: str
    dst: str | None = None

    def __post_init__(self) -> None:
        self._normalize()
        try:
            self._set("dtype", normalize_dtype(self.dtype))
        except WorkbenchError as exc:
            raise MapperError(f"Cannot build Cast of {self.name!r}: {exc.message}") from None
        if self.dtype in UNPRODUCIBLE:
            raise MapperError(
                f"Cannot build Cast of {self.name!r}: the engine cannot produce {self.dtype} (it has no converter into it). "
                "Cast to another dtype; F4/F6 tensors can only be copied as they are."
            )

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        source = metas[0][0]
        if source in UNPRODUCIBLE and source != self.dtype:
            raise MapperError(
                f"Cannot apply {self.short()}: {self.name!r} is {source}, whose values the engine cannot read (it has no "
                f"converter from {source}). Copy the tensor as it is (drop the Cast)."
            )
        return [(self.dtype, metas[0][1])]

    def _compute(self, tensors: list[Any]) -> list[Any]:
        from ..overflow import cast

        try:
            to_torch(self.dtype)
        except WorkbenchError as exc:
            raise MapperError(f"Cannot apply {self.short()}: {exc.message}") from None
        return [cast(tensors[0], self.dtype)]

    def _trace(self, syms: list[Sym]) -> list[Sym]:
        source = syms[0]
        if source.dtype == self.dtype:
            return [Sym(self.dtype, source.shape, source.slices, *_lineage(source))]
        return [Sym(self.dtype, source.shape, None, source.elems_of, source.casts + 1)]

    def _invert(self, metas: list[Meta]) -> Mapper:
        source = metas[0][0]
        if not is_lossless_cast(source, self.dtype):
            raise MapperError(
                f"Cannot invert {self.short()}: casting {source} to {self.dtype} loses information, so the original "
                "values cannot be restored. Keep a copy of the source, or cast to a wider dtype."
            )
        return Cast(self.dst or self.name, source, dst=self.name if self.dst else None)
