"""Recipes for groups, computed once per group *shape* and shared.

Thousands of groups in a checkpoint differ only by names (layer 0's q/k/v concat, layer 1's ...).
A group's canonical key replaces every tensor name by its order of first appearance; groups with
equal keys and equal input metadata have the same recipe up to renaming. So each distinct shape is
traced once, and each group gets a `LazyRecipe` that builds its ByteSlices only when read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..catalog import TensorInfo
from ..errors import MapperError
from .base import Mapper
from .evaluate import apply_concrete
from .function import Function
from .groups import ByteSlice
from .layout import Sym, whole
from .op import Op

# slices of one output as (input token, begin, end)
TokenSlices = tuple[tuple[int, int, int], ...]


class SharedSlices(dict):
    """token -> slices (in tokens) of one traced group shape, shared by every group of that shape; with what the
    planner derives from them made once per shape and output order instead of once per group (22k fused q/k/v
    groups of a 100k-tensor checkpoint): the recipe's text as a format over the group's names, and the bytes
    copied from each input token."""

    __slots__ = ("_texts", "_reads")

    def __init__(self, slices: dict[int, TokenSlices]) -> None:
        super().__init__(slices)
        self._texts: dict[tuple[int, ...], str] = {}
        self._reads: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def text_format(self, outputs: tuple[int, ...]) -> str:
        """`out=src[begin:end],...;...` for the output tokens `outputs`, with `{token}` for every name (str.format)."""
        found = self._texts.get(outputs)
        if found is None:
            found = self._texts[outputs] = ";".join(
                f"{{{out}}}=" + ",".join(f"{{{token}}}[{begin}:{end}]" for token, begin, end in self[out]) for out in outputs
            )
        return found

    def reads(self, outputs: tuple[int, ...]) -> list[tuple[int, int]]:
        """(input token, bytes copied from it) for the output tokens `outputs`, tokens in order of first appearance."""
        found = self._reads.get(outputs)
        if found is None:
            totals: dict[int, int] = {}
            for out in outputs:
                for token, begin, end in self[out]:
                    totals[token] = totals.get(token, 0) + end - begin
            found = self._reads[outputs] = list(totals.items())
        return found


class LazyRecipe(Mapping[str, tuple[ByteSlice, ...]]):
    """Read-only mapping output name -> ByteSlices, materialized from a shared token recipe on access."""

    __slots__ = ("_outputs", "_shared", "_names")

    def __init__(self, outputs: dict[str, int], shared: SharedSlices, names: list[str]) -> None:
        self._outputs = outputs  # output name -> token
        self._shared = shared  # token -> slices in tokens
        self._names = names  # token -> tensor name of this group (an output's name is its token's: names[outputs[o]] == o)

    def __getitem__(self, name: str) -> tuple[ByteSlice, ...]:
        names = self._names
        return tuple(ByteSlice(names[token], begin, end) for token, begin, end in self._shared[self._outputs[name]])

    def spans(self, name: str) -> list[tuple[str, int, int]]:
        """Output `name`'s slices as (input name, begin, end), without making ByteSlices (planning reads each
        recipe a few times; the engine takes the ByteSlices)."""
        names = self._names
        return [(names[token], begin, end) for token, begin, end in self._shared[self._outputs[name]]]

    def text(self) -> str:
        """The recipe spelled `out=input[begin:end],input[begin:end];out2=...` (what the plan fingerprint hashes),
        from a format made once per shared recipe."""
        return self._shared.text_format(tuple(self._outputs.values())).format(*self._names)

    def input_bytes(self) -> list[tuple[str, int]]:
        """(input name, bytes the recipe copies from it), inputs in order of first appearance in the slices."""
        names = self._names
        return [(names[token], n) for token, n in self._shared.reads(tuple(self._outputs.values()))]

    def renamed(self, names: list[str]) -> LazyRecipe:
        """The same shared recipe for another group whose tensor names follow this one's token pattern
        (`names`: its tensor name per token); what the tracer's cache would give that group."""
        return LazyRecipe({names[token]: token for token in self._outputs.values()}, self._shared, names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    def __repr__(self) -> str:
        return f"LazyRecipe({dict(self)!r})"


class Tracer:
    """Computes group recipes and chunked-cast flags, caching them by canonical key."""

    def __init__(self) -> None:
        self._function_metas: dict[Any, list[Any]] = {}
        self._shared: dict[Any, tuple[SharedSlices | None, bool]] = {}

    def leaf(self, op: Op, syms: list[Sym]) -> list[Sym]:
        if isinstance(op, Function):
            metas = tuple((s.dtype, s.shape) for s in syms)
            key = (op.fn, op.infer, op.params, metas)
            out = self._function_metas.get(key)
            if out is None:
                out = self._function_metas[key] = op._infer(list(metas))
            return [Sym(dtype, shape, None) for dtype, shape in out]
        return op._trace(syms)

    def trace(self, op: Mapper, inputs: tuple[TensorInfo, ...], outputs: list[TensorInfo]) -> list[Sym]:
        state = {info.name: whole(info.name, info.dtype, tuple(info.shape)) for info in inputs}
        result = apply_concrete(op, state, self.leaf)
        syms = [result[info.name] for info in outputs]
        for sym, info in zip(syms, outputs, strict=True):
            if (sym.dtype, sym.shape) != (info.dtype, info.shape):  # pragma: no cover - binder and tracer share _infer
                raise MapperError(f"Cannot build the group for {info.name!r}: traced metadata disagrees with inference (internal error).")
        return syms

    def shared_recipe(
        self, signature: tuple[Any, ...], instances: dict[Any, list[Op]], op: Mapper,
        inputs: tuple[TensorInfo, ...], outputs: list[TensorInfo],
    ) -> tuple[Mapping[str, tuple[ByteSlice, ...]] | None, str | None]:
        """(recipe or None, chunk_cast dtype or None), traced once per group shape and shared.

        Groups over the same leaf paths whose names repeat in the same pattern (token of first
        appearance) and whose inputs have the same metadata have the same recipe up to renaming.
        """
        first = instances[signature[0]]
        if len(signature) == 1 and len(first) == 1:
            # The common case, one operation instance: tokens follow its inputs then outputs.
            names = first[0].inputs + first[0].outputs
            tokens = {name: index for index, name in enumerate(names)}
            if len(tokens) == len(names):
                pattern: Any = len(names)
            else:  # an in-place operation: an output reuses an input's name
                tokens = {}
                pattern = tuple(tokens.setdefault(name, len(tokens)) for name in names)
        else:
            tokens = {}
            pattern = []
            for path in signature:
                for instance in instances[path]:
                    for name in instance.inputs:
                        pattern.append(tokens.setdefault(name, len(tokens)))
                    pattern.append(-1)
                    for name in instance.outputs:
                        pattern.append(tokens.setdefault(name, len(tokens)))
                    pattern.append(-2)
            pattern = tuple(pattern)
        if len(inputs) == 1:
            info = inputs[0]
            key = (signature, pattern, ((tokens[info.name], info.dtype, info.shape),))
        else:
            metas = sorted([(tokens[i.name], i.dtype, i.shape) for i in inputs])
            key = (signature, pattern, tuple(metas))
        cached = self._shared.get(key)
        if cached is None:
            syms = self.trace(op, inputs, outputs)
            shared: SharedSlices | None = None
            if all(sym.slices is not None for sym in syms):
                shared = SharedSlices({
                    tokens[info.name]: tuple((tokens[s.source], s.begin, s.end) for s in sym.slices)  # type: ignore[union-attr]
                    for info, sym in zip(outputs, syms, strict=True)
                })
            cached = self._shared[key] = (shared, _is_chunk_cast(syms, inputs, outputs))
        shared, chunk = cached
        if shared is not None:
            if len(outputs) == 1:
                name = outputs[0].name
                return LazyRecipe({name: tokens[name]}, shared, list(tokens)), None
            return LazyRecipe({info.name: tokens[info.name] for info in outputs}, shared, list(tokens)), None
        return None, outputs[0].dtype if chunk else None

    def direct_recipe(self, op: Mapper, inputs: tuple[TensorInfo, ...], outputs: list[TensorInfo], *, leafless: bool = False,
                      ) -> tuple[dict[str, tuple[ByteSlice, ...]] | None, str | None]:
        """The recipe of one group traced on its own; `leafless=True` says the op has no operation leaves (known to the caller)."""
        if len(inputs) == 1 and len(outputs) == 1 and (leafless or not any(True for _ in op.leaves())):
            # A pure prefix rename: the output is the input's bytes.
            info = inputs[0]
            nbytes = info.nbytes
            return {outputs[0].name: (ByteSlice(info.name, 0, nbytes),) if nbytes else ()}, None
        syms = self.trace(op, inputs, outputs)
        if all(sym.slices is not None for sym in syms):
            return {info.name: sym.slices for info, sym in zip(outputs, syms, strict=True)}, None  # type: ignore[misc]
        return None, outputs[0].dtype if _is_chunk_cast(syms, inputs, outputs) else None


def _is_chunk_cast(syms: list[Sym], inputs: tuple[TensorInfo, ...], outputs: list[TensorInfo]) -> bool:
    """One input, one output holding its elements in order, converted exactly once."""
    return len(inputs) == 1 and len(outputs) == 1 and syms[0].elems_of == inputs[0].name and syms[0].casts == 1 and syms[0].slices is None

