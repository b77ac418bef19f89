"""Globs in operation names: `M.Cast("*.weight", "BF16")`, `M.Drop("*.rotary_emb.*")`, `M.Rename("model.*", "*")`.

A name in an operation is a tensor name, a `{placeholder}` template, or a glob. The glob syntax is the one
of `workbench.names` filters, matched against the *whole* name:

- `*` any text, dots included (`*.weight` reaches into every layer, as people type it in a shell);
- `?` one character; `[abc]` / `[!abc]` one character of (not of) a set; `{i}` one segment, as in templates.

A glob binds where its step runs: against the names that exist at that point (after the earlier steps of
a Sequential; inside a `PrefixScope`, the scope's local names). The operation keeps the glob (`to_code`
writes it as typed), so moving the step re-binds it to the names at its new place.

Outputs. An operation with a glob reads one input; each output name is either the input itself (Cast,
Transpose and Reshape without `dst`, Identity: every match keeps its name) or holds as many `*` as the
input, each standing for the text the same-numbered `*` of the input matched (an output holds no other
pattern: `?` and `[` there are plain characters, and a literal `*` cannot be written)
(`Rename("model.*", "*")` strips `model.`, `Split("*.qkv", ["*.q", "*.k", "*.v"])` splits every qkv).
When a name can be split several ways, each `*` takes the shortest text, left to right (the rule of
placeholders). Operations with several inputs (Concat, Stack, a Function of several tensors) refuse
globs: which matched names go together would be undefined; use `{i}` templates or `{e*}` ranges.

A Cast through a glob converts the floating-point tensors it matches; the others it matches (integer
ids, masks, quantised codes, and tensors already in the dtype) pass unchanged, as an Identity (or a
Rename to `dst`): a glob did not name them, and casting an index or a packed int4 weight to bf16
destroys it. A Cast of a plain name or template casts whatever dtype it names.

Literal characters. Tensor names are free text in safetensors, so a real name may hold `*`, `?` or `[`
(PyTorch module paths never do, but a hand-made dict key can). Two rules keep such names reachable:
escape a character as a one-element set (`[*]`, `[?]`, `[[]`; `escape(name)` does it), and a glob that
is exactly the name of a tensor present at its step names that tensor (so mappers written before globs
existed bind as they did). A name without `*`, `?` or `[` is no glob and binds exactly as before.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..dtypes import is_float
from ..errors import MapperError
from ..names import fill, pattern_regex
from .base import Meta
from .ranges import RANGE

if TYPE_CHECKING:  # pragma: no cover
    from .op import Op

GLOB_CHARACTERS = "*?["


def is_glob(name: str) -> bool:
    """True when `name` holds a glob character (`*`, `?`, `[`) outside a `{x*}` range."""
    if "*}" in name:
        name = RANGE.sub("", name)
    return any(c in name for c in GLOB_CHARACTERS)


def has_globs(op: Any) -> bool:
    """True when some input name of the leaf `op` is a glob: the operation binds through `instances`. (Not part of
    `Op.is_template`: the concrete instances binding makes carry real names, which may hold '[' or '*'.)"""
    return any(is_glob(name) for name in getattr(op, "inputs", ()))


def escape(name: str) -> str:
    """`name` with `*`, `?` and `[` written as one-element sets, so a glob-aware operation reads it literally."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def check_globs(op: Op, where: str) -> None:
    """Construction checks: a glob only in the one input of an operation, each output the input itself or
    carrying its `*`s; raises MapperError saying what to write instead."""
    inputs, outputs = op.inputs, op.outputs
    globbed = [name for name in inputs if is_glob(name)]
    if not globbed:
        bad = next((name for name in outputs if "*" in name and "*}" not in name), None)
        if bad is not None:
            raise MapperError(
                f"Cannot build {where}: output '{bad}' holds '*', but no input is a glob. A '*' in an output stands for "
                "the text a '*' of the input matched; name the input with a glob too (e.g. 'model.*' -> '*')."
            )
        return
    if len(inputs) > 1:
        raise MapperError(
            f"Cannot build {where}: input '{globbed[0]}' is a glob, and the operation reads {len(inputs)} tensors, so which "
            "matched names go together would be undefined. Use {i} templates (one segment) or an {e*} range "
            "(every value, in natural order) for the inputs, or list them."
        )
    source = inputs[0]
    if any("*}" in name for name in (*inputs, *outputs)):
        raise MapperError(f"Cannot build {where}: '{source}' is a glob and the operation also holds an {{x*}} range. Use one of them.")
    stars = _star_count(source)
    for name in outputs:
        if name == source:
            continue
        if name.count("*") != stars:
            raise MapperError(
                f"Cannot build {where}: output '{name}' holds {name.count('*')} '*' but the glob '{source}' holds {stars}; "
                "every match would otherwise get the same output name. Give the output one '*' per '*' of the input, "
                "each taking the text it matched, e.g. 'model.*' -> '*' or 'layers.*.attn' -> 'blocks.*.attention'."
            )


def _star_count(pattern: str) -> int:
    """How many `*` of `pattern` are wildcards (not inside a `[...]` set)."""
    return sum(1 for group in re.compile(pattern_regex(pattern, stars=True)).groupindex if group.startswith("star"))


def matcher(pattern: str) -> Callable[[str], tuple[dict[str, str], list[str]] | None]:
    """A test of whole names for a glob: (placeholder values, texts the `*`s matched) for a match, else None."""
    try:
        regex = re.compile(pattern_regex(pattern, stars=True), re.DOTALL)
    except Exception:  # pragma: no cover - check_name refused malformed braces already
        raise MapperError(f"Cannot bind '{pattern}': it is not a valid glob. Write '*', '?', '[abc]' and {{i}} placeholders.") from None
    stars = sorted((index, group) for group, index in regex.groupindex.items() if group.startswith("star"))

    def match(name: str) -> tuple[dict[str, str], list[str]] | None:
        found = regex.fullmatch(name)
        if found is None:
            return None
        values = {key[3:]: value for key, value in found.groupdict().items() if key.startswith("ph_")}
        return values, [found.group(group) for _, group in stars]

    return match


def _filler(text: str, values: dict[str, str], texts: list[str]) -> str:
    """An output name: placeholders filled, each `*` replaced by the text its input `*` matched."""
    if "*" not in text:
        return fill(text, values) if "{" in text else text
    parts = text.split("*")
    out = [fill(part, values) if "{" in part else part for part in parts]
    return "".join(piece + (texts[k] if k < len(texts) else "") for k, piece in enumerate(out))


def instances(op: Op, nodes: Mapping[str, Meta | None]) -> list[Op]:
    """The concrete operations `op` (holding a glob input) stands for over `nodes` (name -> metadata at its step),
    in the order of `nodes`. Empty when the glob matches nothing."""
    from .op import build_unchecked
    from .ops import Cast, Identity, Rename

    source = op.inputs[0]
    if "{" not in source and source in nodes:  # a glob that is exactly a present name names that tensor
        matches: list[tuple[str, dict[str, str], list[str]]] = [(source, {}, [])]
    else:
        match = matcher(source)
        matches = [(name, *found) for name in nodes if (found := match(name)) is not None]
    out: list[Op] = []
    for name, values, texts in matches:
        def rename(text: str, name: str = name, values: dict[str, str] = values, texts: list[str] = texts) -> str:
            return name if text == source else _filler(text, values, texts)

        concrete = op.rename_all(rename)
        if isinstance(op, Cast):
            meta = nodes[name]
            if meta is not None and (not is_float(meta[0]) or meta[0] == op.dtype):
                target = concrete.outputs[0]
                # real names, maybe holding '[' or '*': built without the construction checks of typed names
                concrete = build_unchecked(Identity, name=name) if target == name else build_unchecked(Rename, src=name, dst=target)
        out.append(concrete)
    return out


def no_match_message(op: Op, count: int) -> str:
    """The problem of a glob that matches nothing at its step (the glob quoted as typed: a repr doubles backslashes)."""
    return (f"Cannot bind {type(op).__name__}: glob '{op.inputs[0]}' matches no tensor name ({count} names at this step). A glob "
            "matches whole names: '*' is any text (dots included), '?' one character, '{i}' one segment; e.g. '*.weight' "
            "or 'model.*'. Check the names the steps before this one leave.")


def inverse_keeps_glob(leaf: Op, candidate: Any, records: list[tuple[Op, tuple[Meta, ...]]],
                       after: Mapping[str, Meta | None] | None) -> bool:
    """True when `candidate` (the glob inverse of `leaf`), bound to the names present after `leaf` ran (`after`),
    stands for exactly the inverses of `leaf`'s recorded instances: then the inverse may keep the glob."""
    from .op import Op as OpType

    if after is None or not isinstance(candidate, OpType) or not has_globs(candidate):
        return False
    try:
        expected = [instance._invert(list(metas)) for instance, metas in records]
    except MapperError:
        return False
    return Counter(instances(candidate, after)) == Counter(expected)

