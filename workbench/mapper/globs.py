"""Expanding a glob into the names it matches at one point, folded into `{i}` templates.

Operations take globs themselves (`M.Cast("*.weight", "BF16")`: see `workbench.mapper.patterns`), bound where
their step runs and exported as written; prefer that. These helpers list instead: for what no glob can say
(`glob_cast` with `keep` words: "every float but the norms"), and for fixes that name the tensors of one
binding (the builder's "drop the old tensors"). The filter syntax is that of `workbench.names` (`*` any text,
dots included; `{i}` one segment or part of one), matched against the *whole* name. Numbered names fold into
a template only when the template catches exactly the chosen names; the others are spelled out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from ..catalog import TensorInfo
from ..dtypes import is_float, normalize_dtype
from ..errors import MapperError, WorkbenchError
from ..names import Template, fill, pattern_regex, placeholders_of
from .base import Mapper
from .compose import Parallel, PrefixScope, Sequential
from .ops import Rename
from .patterns import GLOB_CHARACTERS, is_glob  # noqa: F401  (the one definition; kept importable here)
from .state import Node, State

FOLD_PLACEHOLDERS = ("i", "j", "k", "l", "m", "n", "p", "q")
_DIGITS = re.compile(r"^\d+$")


def glob_matcher(pattern: str) -> Callable[[str], bool]:
    """A test of whole tensor names for `pattern` (the filter syntax of `workbench.names`, anchored)."""
    try:
        regex = re.compile(pattern_regex(pattern), re.DOTALL)
    except WorkbenchError:
        # names are quoted as typed (a repr would double each backslash)
        raise MapperError(f"Cannot expand '{pattern}': it has a malformed placeholder. Write placeholders as {{name}} with a "
                          "Python identifier inside, e.g. 'model.layers.{i}.*'.") from None
    return lambda name: regex.fullmatch(name) is not None


def match_names(pattern: str, names: Iterable[str]) -> list[str]:
    """The names `pattern` matches as a whole, in their given order."""
    keep = glob_matcher(pattern)
    return [name for name in names if keep(name)]


def fold_name(name: str) -> tuple[str, tuple[str, ...]]:
    """'a.3.b.7.w' -> ('a.{i}.b.{j}.w', ('3', '7')): whole numeric segments become placeholders."""
    segments = name.split(".")
    values: list[str] = []
    for index, segment in enumerate(segments):
        if _DIGITS.match(segment) and len(values) < len(FOLD_PLACEHOLDERS):
            segments[index] = "{" + FOLD_PLACEHOLDERS[len(values)] + "}"
            values.append(segment)
    return ".".join(segments), tuple(values)


def fold_exactly(chosen: Sequence[str], names: Iterable[str]) -> list[str]:
    """Templates (and plain names) that together catch exactly `chosen` among `names`.

    A fold such as `layers.{i}.w` is used when every name of `names` it catches is chosen; otherwise its
    chosen members are listed one by one. Order: first appearance in `chosen`.
    """
    groups: dict[str, list[str]] = {}
    for name in chosen:
        groups.setdefault(fold_name(name)[0], []).append(name)
    if not any("{" in template for template in groups):
        return list(groups)
    index = State({name: Node(None) for name in names})
    out: list[str] = []
    for template, members in groups.items():
        if "{" not in template or len(members) == 1:
            out.extend(members)
            continue
        compiled = Template(template, placeholders_of(template))
        chosen_here = set(members)
        caught = [n for n in index.candidates(compiled) if n in index.nodes and compiled.match(n.split(".")) is not None]
        out.extend([template] if all(n in chosen_here for n in caught) else members)
    return out


def expand_each(pattern: str, names: Sequence[str], build: Callable[[str], Mapper], what: str) -> Mapper:
    """One operation per folded template of the names `pattern` matches (Drop, Identity, Cast, ...): the
    operation itself when there is one, else their Parallel. `what` names the operation in errors."""
    chosen = match_names(pattern, names)
    if not chosen:
        raise MapperError(_no_match(pattern, names, what))
    ops = [build(template) for template in fold_exactly(chosen, names)]
    return ops[0] if len(ops) == 1 else Parallel(*ops)


def _no_match(pattern: str, names: Sequence[str], what: str) -> str:
    return (f"Cannot {what} '{pattern}': it matches no tensor name ({len(names)} names at this step). A glob must match "
            "whole names: '*' is any text (dots included), '{i}' one segment; e.g. 'model.*' or '*.weight'.")


def prefix_rename(source_prefix: str, target_prefix: str) -> Mapper:
    """Names under `source_prefix` moved under `target_prefix` (either may be empty: add or strip a prefix)."""
    if source_prefix == target_prefix:
        raise MapperError(f"Cannot rename prefix {source_prefix!r} to itself: give a different new prefix (or none, to strip it).")
    return PrefixScope(Sequential(), source_prefix=source_prefix, target_prefix=target_prefix)


def glob_rename(pattern: str, dst: str, names: Sequence[str]) -> Mapper:
    """Rename every name `pattern` matches: each `*` of `dst` takes the text the same-numbered `*` of
    `pattern` matched, each `{placeholder}` its value. `'model.*' -> '*'` and `'*' -> 'model.*'` are
    prefix renames (`PrefixScope`, which also works on names added later); other globs expand into
    Renames over folded templates."""
    stars = pattern.count("*")
    if dst.count("*") != stars:
        raise MapperError(
            f"Cannot rename '{pattern}' to '{dst}': the new name needs as many '*' as the old one ({stars}), each standing "
            "for the text its '*' matched, e.g. 'model.*' -> '*' or 'layers.*.attn' -> 'blocks.*.attention'."
        )
    extra = set(placeholders_of(dst)) - set(placeholders_of(pattern))
    if extra:
        raise MapperError(f"Cannot rename '{pattern}' to '{dst}': {sorted(extra)} in the new name are not in the old one.")
    plain = not any(c in pattern for c in "?[{")
    if plain and stars == 1 and pattern.endswith("*") and dst.endswith("*") and "{" not in dst:
        return prefix_rename(pattern[:-1], dst[:-1])
    parts = pattern.split("*")
    seen: set[str] = set()
    for part in parts:
        here = set(placeholders_of(part))
        if here & seen:
            raise MapperError(f"Cannot rename '{pattern}': a placeholder appears on both sides of a '*'; use it once.")
        seen |= here
    regex = re.compile("(.*)".join(pattern_regex(part) for part in parts), re.DOTALL)
    pairs: list[tuple[str, str]] = []
    for name in names:
        found = regex.fullmatch(name)
        if found is None:
            continue
        values = {key[3:]: value for key, value in found.groupdict().items()}  # groups are 'ph_<placeholder>'
        out = fill(dst, values) if "{" in dst else dst
        for captured in _star_groups(found):
            out = out.replace("*", captured, 1)
        pairs.append((name, out))
    if not pairs:
        raise MapperError(_no_match(pattern, names, "rename"))
    ops = [Rename(src, out) for src, out in _fold_pairs(pairs, names)]
    return ops[0] if len(ops) == 1 else Parallel(*ops)


def _star_groups(found: re.Match[str]) -> list[str]:
    """The texts the '*'s matched: the unnamed groups, in order."""
    named = {index for index in found.re.groupindex.values()}
    return [found.group(index) for index in range(1, found.re.groups + 1) if index not in named]


def _fold_pairs(pairs: list[tuple[str, str]], names: Sequence[str]) -> list[tuple[str, str]]:
    """(old, new) renames folded into templates where the fold catches exactly the renamed names and fills
    back to each new name; the rest spelled out."""
    groups: dict[tuple[str, str], list[tuple[str, str, dict[str, str]]]] = {}
    for src, out in pairs:
        template, values = fold_name(src)
        mapping = dict(zip(FOLD_PLACEHOLDERS, values, strict=False))
        segments = out.split(".")
        unused = list(mapping.items())
        for index, segment in enumerate(segments):
            hit = next((key for key, value in unused if value == segment), None)
            if hit is not None:
                segments[index] = "{" + hit + "}"
                unused = [(key, value) for key, value in unused if key != hit]
        out_template = ".".join(segments)
        groups.setdefault((template, out_template), []).append((src, out, mapping))
    folded_sources = fold_exactly([src for src, _ in pairs], names)
    whole = {t for t in folded_sources if "{" in t}
    result: list[tuple[str, str]] = []
    for (template, out_template), members in groups.items():
        fits = (
            template in whole and len(members) > 1 and set(placeholders_of(out_template)) == set(placeholders_of(template))
            and all(fill(out_template, mapping) == out for _, out, mapping in members)
            and len(members) == sum(1 for src, _ in pairs if fold_name(src)[0] == template)
        )
        result.extend([(template, out_template)] if fits else [(src, out) for src, out, _ in members])
    return result


def keeps(name: str, words: Sequence[str]) -> bool:
    """True when a dotted segment of `name` contains one of `words` (how `presets.cast_policy` spots norms)."""
    return any(word in segment for word in words for segment in name.split("."))


def glob_cast(pattern: str, infos: Mapping[str, TensorInfo], dtype: str, *, keep: Sequence[str] = (),
              keep_dtype: str = "F32") -> Mapper:
    """Cast the floating tensors `pattern` matches to `dtype`, those with a `keep` word in a segment (norms,
    biases) to `keep_dtype`; tensors already in their dtype and non-float tensors are left alone.
    `infos`: name -> TensorInfo of the names that exist where the cast runs."""
    from .ops import Cast

    target, kept_target = normalize_dtype(dtype), normalize_dtype(keep_dtype)
    matched = match_names(pattern, infos)
    if not matched:
        raise MapperError(_no_match(pattern, list(infos), "cast"))
    wanted: dict[str, list[str]] = {}
    for name in matched:
        info = infos[name]
        want = kept_target if keeps(name, keep) else target
        if is_float(info.dtype) and info.dtype != want:
            wanted.setdefault(want, []).append(name)
    if not wanted:
        raise MapperError(f"Cannot cast '{pattern}': the {len(matched)} tensor(s) it matches are already in the dtypes asked "
                          "for (or are not floating point). Nothing to do.")
    ops = [Cast(template, want) for want, chosen in wanted.items() for template in fold_exactly(chosen, infos)]
    return ops[0] if len(ops) == 1 else Parallel(*ops)
