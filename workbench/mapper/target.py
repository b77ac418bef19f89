"""Does a mapper produce what a target expects? Names, shapes and dtypes compared from metadata alone.

The target is whatever says what the result should look like: a model (built on the meta device costs
no memory), a checkpoint (path, Checkpoint or Catalog), a bound mapper, or a mapping name -> TensorInfo,
tensor or shape. `check_target` answers with a `TargetReport`: one row per difference, `ok`, and a text
and HTML rendering. The MapperBuilder widget and `check_module` both call it. The comparison itself
(`compare_tensors`: which name is missing, unexpected, of another shape or dtype, or filled through a
tie) is also what `load_into` checks a module's keys with, before it reads anything.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..api_types import Rest
from ..catalog import Catalog, TensorInfo
from ..dtypes import normalize_dtype
from ..errors import MapperError, WorkbenchError
from ..module_state import StateEntry, module_state
from .groups import Binding, Problem

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

TARGET_STATUSES = ("missing", "unexpected", "shape mismatch", "dtype differs")
BLOCKING_STATUSES = ("missing", "unexpected", "shape mismatch")
TARGET_COLUMNS = ["status", "dtype", "shape", "target_dtype", "target_shape", "message"]
MAX_LISTED = 20
# every name compared gets one status: the four above, or 'matched' (same name and shape, dtype too
# when the target gives one) or 'tied' (expected, not produced, but a key it is tied to is)
Status = Literal["missing", "unexpected", "shape mismatch", "dtype differs", "matched", "tied"]


@dataclass(frozen=True)
class Expected:
    """What the target expects under one name. `dtype` None: any dtype (the target gave a shape only);
    `tied_to`: an earlier key of a module that shares this tensor (filling either one fills both)."""

    name: str
    dtype: str | None
    shape: tuple[int, ...]
    tied_to: str | None = None


@dataclass(frozen=True)
class Target:
    """A target resolved to its expected tensors, with how to name it in messages."""

    description: str  # 'LlamaForCausalLM model', a path, 'dict of 3 tensors'
    noun: str  # 'the module', 'the target checkpoint', 'the target'
    tensors: dict[str, Expected]


def _shape_of(value: Any) -> tuple[int, ...] | None:
    """A shape given as a tuple/list/torch.Size of ints, else None."""
    if isinstance(value, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        return tuple(value)
    return None


def _expected_entry(name: str, value: Any) -> Expected:
    if isinstance(value, Expected):
        return value if value.name == name else Expected(name, value.dtype, value.shape, value.tied_to)
    if isinstance(value, TensorInfo):
        return Expected(name, value.dtype, tuple(value.shape))
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        try:
            dtype = normalize_dtype(value.dtype)
        except WorkbenchError as exc:
            raise MapperError(f"Cannot check against target tensor {name!r}: {exc.message}", tensor=name) from None
        return Expected(name, dtype, tuple(int(d) for d in value.shape))
    shape = _shape_of(value)
    if shape is not None:
        return Expected(name, None, shape)
    raise MapperError(
        f"Cannot check against target entry {name!r}: it is a {type(value).__name__}; give a TensorInfo, a tensor "
        "or a shape (tuple of ints).",
        tensor=name,
    )


def expected_keys(state: Mapping[str, StateEntry]) -> dict[str, Expected]:
    """A module's state as a target to compare with (`compare_tensors`): each key's dtype and global
    shape, and the earlier key it is tied to."""
    return {key: Expected(key, e.info.dtype, e.info.shape, e.leader if e.tied else None) for key, e in state.items()}


def _module_target(model: Any) -> Target:
    return Target(f"{type(model).__name__} model", "the module", expected_keys(module_state(model)))


def _catalog_of(checkpoint: Any) -> Catalog:
    """The catalog of a path, a Checkpoint (anything with `.catalog`) or a Catalog, from headers only."""
    if isinstance(checkpoint, Catalog):
        return checkpoint
    if isinstance(getattr(checkpoint, "catalog", None), Catalog):
        return checkpoint.catalog
    from ..formats import open_catalog

    return open_catalog(checkpoint)


def resolve_target(target: Any) -> Target:
    """What `target` expects: from a model (its state keys, ties recognised), a checkpoint path /
    Checkpoint / Catalog, a Binding (its outputs), a resolved Target, or a mapping name -> TensorInfo,
    tensor or shape. Raises MapperError for anything else."""
    if isinstance(target, Target):
        return target
    if isinstance(target, Binding):
        outputs = target.outputs
        return Target(f"bound mapper of {len(outputs)} outputs", "the target", {n: _expected_entry(n, t) for n, t in outputs.items()})
    if callable(getattr(target, "state_dict", None)):
        return _module_target(target)
    if isinstance(target, (str, os.PathLike, Catalog)) or isinstance(getattr(target, "catalog", None), Catalog):
        catalog = _catalog_of(target)
        infos = catalog.tensors
        return Target(str(catalog.root), "the target checkpoint", {n: _expected_entry(n, t) for n, t in infos.items()})
    if isinstance(target, Mapping):
        tensors = {str(n): _expected_entry(str(n), v) for n, v in target.items()}
        return Target(f"{type(target).__name__} of {len(tensors)} tensors", "the target", tensors)
    raise MapperError(
        f"Cannot check against a {type(target).__name__}: pass a model (e.g. built on the meta device), a checkpoint path, "
        "a Checkpoint, or a mapping name -> tensor."
    )


def _produced(mapper_or_binding: Any, source: Any, rest: str) -> tuple[dict[str, TensorInfo], list[Problem]]:
    """The outputs to check (name -> TensorInfo) and the problems of binding the mapper to `source`."""
    from .bind import source_infos

    if isinstance(mapper_or_binding, Binding):
        return dict(mapper_or_binding.outputs), list(mapper_or_binding.problems)
    if mapper_or_binding is not None and not callable(getattr(mapper_or_binding, "bind", None)):
        if isinstance(mapper_or_binding, Mapping):
            return {info.name: info for info in source_infos(mapper_or_binding)}, []
        raise MapperError(
            f"Cannot check a {type(mapper_or_binding).__name__} against a target: pass a mapper from workbench.mapper, "
            "a Binding, a mapping name -> TensorInfo, or None with a source (its names as they are)."
        )
    if source is None:
        raise MapperError("Cannot check a mapper against a target without its source: pass the checkpoint the mapper reads.")
    if isinstance(source, (str, os.PathLike)):
        source = _catalog_of(source)
    if mapper_or_binding is None:
        return {info.name: info for info in source_infos(source)}, []
    binding = mapper_or_binding.bind(source, rest=rest)
    return dict(binding.outputs), list(binding.problems)


def describe(dtype: str | None, shape: Any) -> str:
    """'F32 [64, 64]': how metadata reads in messages ('any dtype' when the target gives a shape only)."""
    return f"{dtype or 'any dtype'} {list(shape)}"


def compare_tensors(produced: Mapping[str, TensorInfo], expected: Mapping[str, Expected]) -> dict[str, Status]:
    """The status of every name on either side, from metadata alone: the expected names in target order
    ('matched', 'dtype differs', 'shape mismatch', 'missing' or 'tied'), then the other produced names in
    produced order ('unexpected'). A tied key counts as filled when any key of its tie is produced."""
    produced_ties = {want.tied_to or name for name, want in expected.items() if name in produced}
    status: dict[str, Status] = {}
    for name, want in expected.items():
        have = produced.get(name)
        if have is None:
            status[name] = "tied" if (want.tied_to or name) in produced_ties else "missing"
        elif tuple(have.shape) != tuple(want.shape):
            status[name] = "shape mismatch"
        elif want.dtype is not None and have.dtype != want.dtype:
            status[name] = "dtype differs"
        else:
            status[name] = "matched"
    for name in produced:
        if name not in expected:
            status[name] = "unexpected"
    return status


def _message(name: str, status: Status, have: TensorInfo | None, want: Expected | None, noun: str) -> str:
    if status == "missing":
        return (f"Missing {name!r}: {noun} expects {describe(want.dtype, want.shape)} but the source (after the mapper) "
                "has no such tensor. Map it from a source tensor.")
    if status == "shape mismatch":
        return (f"Shape mismatch for {name!r}: {noun} expects {list(want.shape)} but the source (after the mapper) "
                f"gives {list(have.shape)}. Fix the mapper (Reshape, Split, Concat) or build the target with the "
                "checkpoint's config.")
    if status == "dtype differs":
        return (f"{name!r} is {have.dtype} after the mapper but {noun} holds {want.dtype}. Add a Cast if it must "
                "match exactly (loading into a module casts it).")
    return (f"Unexpected {name!r}: the source (after the mapper) has it ({describe(have.dtype, have.shape)}) but "
            f"{noun} has no tensor of that name. Drop or rename it in the mapper.")


def _rows(produced: dict[str, TensorInfo], target: Target) -> tuple[list[tuple], list[str], list[str]]:
    """Difference rows, the produced names the target accepts, and the tied keys filled through another."""
    status = compare_tensors(produced, target.tensors)
    rows = []
    for name, state in status.items():
        if state in TARGET_STATUSES:
            have, want = produced.get(name), target.tensors.get(name)
            found = (have.dtype, have.shape) if have is not None else (None, None)
            wanted = (want.dtype, want.shape) if want is not None else (None, None)
            rows.append((name, state, *found, *wanted, _message(name, state, have, want, target.noun)))
    matched = [name for name, state in status.items() if state in ("matched", "dtype differs")]
    tied = [name for name, state in status.items() if state == "tied"]
    return rows, matched, tied


def _frame(rows: list[tuple]) -> pd.DataFrame:
    import pandas as pd

    frame = pd.DataFrame.from_records(rows, columns=["name", *TARGET_COLUMNS]).set_index("name")
    frame["status"] = pd.Categorical(frame["status"], categories=TARGET_STATUSES)
    return frame.sort_values("status", kind="stable")


@dataclass
class TargetReport:
    """The outcome of `check_target`: every difference between a mapper's outputs and a target.

    `frame` has one row per 'missing', 'unexpected', 'shape mismatch' or 'dtype differs' tensor
    (columns status, dtype, shape, target_dtype, target_shape, message); `ok` is True when nothing
    but dtypes differs and the mapper binds to its source.
    """

    target: str
    frame: pd.DataFrame
    expected: int  # tensors the target expects
    produced: int  # tensors the mapper produces
    matched: list[str] = field(default_factory=list)  # produced names the target accepts (same name and shape)
    tied: list[str] = field(default_factory=list)  # target keys filled through the key they are tied to
    mapper_problems: list[Problem] = field(default_factory=list)

    def names(self, status: str) -> list[str]:
        """Names with this status ('missing', 'unexpected', 'shape mismatch', 'dtype differs')."""
        if status not in TARGET_STATUSES:
            raise MapperError(f"Cannot list target differences of status {status!r}: choose one of {', '.join(TARGET_STATUSES)}.")
        return list(self.frame.index[self.frame["status"] == status])

    @property
    def missing(self) -> list[str]:
        """Target names that the mapper does not produce."""
        return self.names("missing")

    @property
    def unexpected(self) -> list[str]:
        """Produced names that the target has no place for."""
        return self.names("unexpected")

    @property
    def mismatched(self) -> list[str]:
        """Names whose produced shape differs from the target's."""
        return self.names("shape mismatch")

    @property
    def dtype_differs(self) -> list[str]:
        """Names whose produced dtype differs from the target's (not blocking: a load casts)."""
        return self.names("dtype differs")

    @property
    def mapper_errors(self) -> list[Problem]:
        """Errors of binding the mapper to its source (the outputs are then incomplete)."""
        return [p for p in self.mapper_problems if p.severity == "error"]

    @property
    def counts(self) -> dict[str, int]:
        """How many rows of each status (statuses with none left out), in status order."""
        counts = self.frame["status"].value_counts()
        return {s: int(counts[s]) for s in TARGET_STATUSES if counts.get(s, 0)}

    @property
    def ok(self) -> bool:
        """True when names and shapes match the target and the mapper binds (dtype differences allowed)."""
        counts = self.counts
        return not any(counts.get(s) for s in BLOCKING_STATUSES) and not self.mapper_errors

    @property
    def level(self) -> str:
        """'ok' (everything agrees), 'warning' (only dtypes differ) or 'error'."""
        if not self.ok:
            return "error"
        return "warning" if len(self.frame) else "ok"

    def headline(self) -> str:
        """One sentence: whether the outputs match the target, and what differs."""
        counts = self.counts
        if not self.ok and any(counts.get(s) for s in BLOCKING_STATUSES):
            parts = ", ".join(f"{n} {s}" for s, n in counts.items())
            line = f"Does not match the target: {parts}."
        elif counts:
            line = f"Names and shapes match the target ({self.expected:,} tensors); {counts['dtype differs']} dtype(s) differ."
        else:
            line = f"Matches the target ({self.expected:,} tensors): names, shapes and dtypes agree."
        if self.mapper_errors:
            line += f" The mapper has {len(self.mapper_errors)} problem(s) binding to its source."
        return line

    def summary(self) -> str:
        """The headline, then one line per difference and per mapper error."""
        lines = [f"Target check against {self.target}: {self.headline()}"]
        lines += [f"  error: {p.message}" for p in self.mapper_errors]
        lines += [f"  {status}: {message}" for status, message in zip(self.frame["status"].astype(str), self.frame["message"], strict=True)]
        if self.tied:
            lines.append(f"  tied (filled through another key): {', '.join(self.tied)}")
        return "\n".join(lines)

    def raise_for_problems(self) -> TargetReport:
        """Raise MapperError listing what blocks (up to MAX_LISTED) unless `ok`; else return self."""
        if self.ok:
            return self
        blocking = [p.message for p in self.mapper_errors] + [
            m for s, m in zip(self.frame["status"].astype(str), self.frame["message"], strict=True) if s in BLOCKING_STATUSES
        ]
        listed = " ".join(f"({k}) {m}" for k, m in enumerate(blocking[:MAX_LISTED], 1))
        more = f" ... and {len(blocking) - MAX_LISTED} more." if len(blocking) > MAX_LISTED else ""
        raise MapperError(f"Cannot match {self.target}: {len(blocking)} problem(s). {listed}{more} See the report's frame for all of them.")

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<TargetReport vs {self.target}: {self.headline()}>"

    def _repr_html_(self) -> str:
        color = {"ok": "#2e7d32", "warning": "#b26a00", "error": "#c62828"}[self.level]
        errors = "".join(f"<li>{html.escape(p.message)}</li>" for p in self.mapper_errors)
        table = self.frame.assign(status=self.frame["status"].astype(str)).drop(columns="message").to_html() if len(self.frame) else ""
        return (
            f"<div><b>Target</b> <code>{html.escape(self.target)}</code>: "
            f'<span style="color:{color}">{html.escape(self.headline())}</span>'
            f"{f'<ul>{errors}</ul>' if errors else ''}{table}</div>"
        )


def check_target(mapper_or_binding: Any, source: Any = None, target: Any = None, *, rest: Rest = "keep") -> TargetReport:
    """Compare what `mapper_or_binding` produces from `source` with what `target` expects, from metadata only.

    `mapper_or_binding`: a mapper (bound to `source` with `rest`), a Binding (`source` unused), None
    (the source's names as they are), or a mapping name -> TensorInfo. `source`: a checkpoint path,
    Checkpoint, Catalog or mapping name -> TensorInfo/tensor. `target`: a model (its state keys; tied
    keys are filled through each other), a checkpoint path / Checkpoint / Catalog, a Binding, or a
    mapping name -> TensorInfo, tensor or shape (a shape alone accepts any dtype).
    """
    if target is None:
        raise MapperError("Cannot check against a target: none was given. Pass a model, a checkpoint, or a mapping name -> tensor.")
    resolved = resolve_target(target)
    produced, problems = _produced(mapper_or_binding, source, rest)
    rows, matched, tied = _rows(produced, resolved)
    return TargetReport(
        target=resolved.description,
        frame=_frame(rows),
        expected=len(resolved.tensors),
        produced=len(produced),
        matched=matched,
        tied=tied,
        mapper_problems=problems,
    )
