"""Steps of a mapper in words: "strip prefix `model.`", "fuse q/k/v → qkv_proj (×4)", "cast 24 tensors → BF16,
norms kept F32". For lists of steps (the MapperBuilder); the code (`short()`, `to_code()`) stays the exact form.

`describe_step` reads what the step saw (`before`: name -> TensorInfo) and its concrete operations
(templates filled), as `bind.bind_steps` records them, so counts are of real tensors, not of templates.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence

from ..catalog import TensorInfo
from ..dtypes import is_float
from .base import Mapper
from .claim import Claim
from .compose import Parallel, PrefixScope, Sequential
from .config_update import ConfigUpdate
from .op import Op
from .ops import Cast, Concat, Drop, Identity, Rename, Split
from .output_file import OutputFile
from .patterns import has_globs

LABEL_WIDTH = 110
# words that name kinds of tensors people keep in another dtype, as "norms kept F32" says it
_KINDS = (("norm", "norms"), ("bias", "biases"))


def describe_step(step: Mapper, before: Mapping[str, TensorInfo] | None = None, instances: Sequence[Op] | None = None) -> str:
    """A short sentence for `step` (at most LABEL_WIDTH characters); `step.short()` when no rule fits."""
    text = _describe(step, before or {}, list(instances or ()))
    return text if len(text) <= LABEL_WIDTH else text[: LABEL_WIDTH - 1] + "…"


def _describe(step: Mapper, before: Mapping[str, TensorInfo], instances: list[Op]) -> str:
    if isinstance(step, PrefixScope) and isinstance(step.mapper, Sequential) and not step.mapper.mappers:
        moved = sum(1 for name in before if name.startswith(step.source_prefix))
        count = f" ({moved} names)" if before else ""
        if not step.target_prefix:
            return f"strip prefix `{step.source_prefix}`{count}"
        if not step.source_prefix:
            return f"add prefix `{step.target_prefix}`{count}"
        return f"replace prefix `{step.source_prefix}` → `{step.target_prefix}`{count}"
    if isinstance(step, Claim):
        return f"check: nothing of {_family(step)} left unconverted"
    if isinstance(step, ConfigUpdate):
        return f"config.json: {step.key} -> {json.dumps(step.value)}"
    if isinstance(step, OutputFile):
        return f"{step.path}: {'written' if step.written else 'left out'}" + (f" ({step.why})" if step.why else "")
    leaves = [leaf for leaf in step.leaves() if not isinstance(leaf, (Claim, ConfigUpdate, OutputFile))]
    checked = " + check" if any(isinstance(leaf, Claim) for leaf in step.leaves()) and leaves else ""
    if not leaves:
        return step.short()
    kinds = {type(leaf) for leaf in leaves}
    done = [op for op in instances if not isinstance(op, (Claim, ConfigUpdate, OutputFile))]
    if kinds == {Cast}:
        if len(leaves) == 1 and not leaves[0].is_template and not has_globs(leaves[0]):
            return f"cast {leaves[0].name} → {leaves[0].dtype}"  # type: ignore[attr-defined]
        return _casts(done, before) + checked
    if kinds == {Concat}:
        return "fuse " + ", ".join(_fusion(leaf.srcs, leaf.dst) for leaf in leaves) + _times(done, leaves) + checked
    if kinds == {Split}:
        return "split " + ", ".join(_fusion(leaf.dsts, leaf.src, reverse=True) for leaf in leaves) + _times(done, leaves) + checked
    if kinds <= {Rename, Drop, Identity} and len(kinds) == 1:
        verb = {Rename: "rename", Drop: "drop", Identity: "keep"}[next(iter(kinds))]
        first = leaves[0]
        example = f"{first.src} → {first.dst}" if isinstance(first, Rename) else first.name  # type: ignore[attr-defined]
        more = f" and {len(leaves) - 1} more" if len(leaves) > 1 else ""
        if not done and any(has_globs(leaf) for leaf in leaves):
            return f"{verb} {example}{more} (matches no name here)" + checked
        return f"{verb} {_tensors(len(done) or len(leaves))}: {example}{more}" + checked
    if isinstance(step, Op):
        return step.short()
    counts = Counter(type(leaf).__name__ for leaf in leaves)
    parts = ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
    shape = "in order" if isinstance(step, Sequential) else "side by side" if isinstance(step, Parallel) else "scoped"
    return f"{len(leaves)} operations {shape}: {parts}" + (f" ({_tensors(len(done))})" if done else "") + checked


def _tensors(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def _family(claim: Claim) -> str:
    return claim.family.split(" (")[0]


def _times(done: list[Op], leaves: list[Mapper]) -> str:
    """' (×4)' when the instances are the templates' expansion over 4 values each."""
    if not done or len(done) == len(leaves):
        return ""
    return f" (×{len(done) // len(leaves)})" if len(done) % len(leaves) == 0 else f" ({len(done)} times)"


def _fusion(parts: Sequence[str], whole: str, *, reverse: bool = False) -> str:
    """'q/k/v → qkv_proj': the part of each name that differs, and the fused name's segment there."""
    split = [name.split(".") for name in parts]
    if len({len(s) for s in split}) != 1:
        return f"{len(parts)} → {whole}"
    differ = [k for k in range(len(split[0])) if len({s[k] for s in split}) > 1]
    if not differ:
        return f"{len(parts)} → {whole}"
    words = [".".join(s[k] for k in differ) for s in split]
    tail = os.path.commonprefix([w[::-1] for w in words])[::-1]
    short = [w[: len(w) - len(tail)] or w for w in words] if tail and all(len(w) > len(tail) for w in words) else words
    target = whole.split(".")
    name = ".".join(target[k] for k in differ) if len(target) == len(split[0]) else whole
    return f"{name} → {'/'.join(short)}" if reverse else f"{'/'.join(short)} → {name}"


def _casts(done: list[Op], before: Mapping[str, TensorInfo]) -> str:
    """'cast 24 tensors → BF16, norms kept F32': instances by dtype; the floats left alone, when they are one kind."""
    by_dtype: dict[str, list[str]] = {}
    for op in done:
        if isinstance(op, Cast):  # a glob Cast passes the non-float (and already cast) tensors it matches as they are
            by_dtype.setdefault(op.dtype, []).append(op.name)
    if not by_dtype:
        return "cast (no tensor matched yet)"
    order = sorted(by_dtype, key=lambda d: -len(by_dtype[d]))
    parts = [f"cast {_tensors(len(by_dtype[order[0]]))} → {order[0]}"]
    for dtype in order[1:]:
        parts.append(f"{_kind_of(by_dtype[dtype]) or len(by_dtype[dtype])} → {dtype}")
    cast = {name for names in by_dtype.values() for name in names}
    left = [info for name, info in before.items() if name not in cast and is_float(info.dtype)]
    if left:
        kind, dtypes = _kind_of([info.name for info in left]), {info.dtype for info in left}
        kept = f"kept {next(iter(dtypes))}" if len(dtypes) == 1 else "kept"
        parts.append(f"{kind} {kept}" if kind else f"{len(left)} others {kept}")
    return ", ".join(parts)


def _kind_of(names: list[str]) -> str:
    """'norms' when every name has a segment containing 'norm' (or 'biases', 'norms and biases'), else ''."""
    found = []
    rest = list(names)
    for word, plural in _KINDS:
        hit = [n for n in rest if any(word in segment for segment in n.split("."))]
        if hit:
            found.append(plural)
            rest = [n for n in rest if n not in set(hit)]
    return " and ".join(found) if found and not rest else ""
