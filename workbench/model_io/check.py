"""The dry-run of a load: do the mapper's outputs fit the module's state keys, by name, shape and dtype?

Computed from metadata alone (the bound mapper's outputs and the module's state), before any tensor
byte is read or any storage materialised, so a strict load can refuse without side effects. Names,
shapes and dtypes are compared by `workbench.mapper.target.compare_tensors` (the comparison behind
`check_target`); what only a load decides is added here: which output fills each tie (the others are
not read), that a dtype difference is a cast (a warning), keys other pipeline stages hold, and that a
non-persistent buffer is filled when the source holds it and otherwise kept (recomputed when on meta).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..catalog import TensorInfo
from ..errors import MapperError
from ..mapper.groups import Problem
from ..mapper.target import compare_tensors, describe, expected_keys
from ..module_state import StateEntry

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

Kind = Literal["missing", "unexpected", "shape", "dtype", "tied", "mapper"]
MAX_LISTED = 20


@dataclass(frozen=True)
class KeyProblem:
    """One finding about one key: `expected` is the module's side, `found` the source's (after the mapper)."""

    kind: Kind
    severity: Literal["error", "warning", "info"]
    key: str | None
    expected: str | None
    found: str | None
    message: str


class ModuleMismatchError(MapperError):
    """A strict load refused: the source's keys do not fit the module (`check` holds every finding)."""

    def __init__(self, message: str, check: LoadCheck) -> None:
        super().__init__(message)
        self.check = check


@dataclass
class LoadCheck:
    """What a load would do: which output fills which state key, and every problem found.

    `fill` maps source output names (after the mapper) to the state key they are copied into, in
    source order; tied keys are filled once, through their first key. `recompute` lists the
    non-persistent buffers on the meta device that the source does not hold: a load recomputes them
    with the module's own initialisation (see `workbench.model_io.buffers`).
    """

    module_name: str
    source_name: str
    problems: list[KeyProblem] = field(default_factory=list)
    fill: dict[str, str] = field(default_factory=dict)
    recompute: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is an error (dtype casts and ties are fine)."""
        return not any(p.severity == "error" for p in self.problems)

    @property
    def errors(self) -> list[KeyProblem]:
        """The findings that make a strict load refuse."""
        return [p for p in self.problems if p.severity == "error"]

    def keys_of(self, kind: Kind) -> list[str]:
        """Keys with a finding of this kind."""
        return [p.key for p in self.problems if p.kind == kind and p.key is not None]

    @property
    def missing(self) -> list[str]:
        """Module keys that no source tensor fills."""
        return self.keys_of("missing")

    @property
    def unexpected(self) -> list[str]:
        """Source tensors (after the mapper) that the module has no key for."""
        return self.keys_of("unexpected")

    @property
    def mismatched(self) -> list[str]:
        """Keys whose source shape differs from the module's."""
        return self.keys_of("shape")

    @property
    def frame(self) -> pd.DataFrame:
        """One row per finding: kind, severity, key, expected (module), found (source), message."""
        import pandas as pd

        rows = [(p.kind, p.severity, p.key, p.expected, p.found, p.message) for p in self.problems]
        return pd.DataFrame(rows, columns=["kind", "severity", "key", "expected", "found", "message"])

    def error(self) -> ModuleMismatchError:
        """The MapperError a strict load raises, listing every error (up to MAX_LISTED)."""
        errors = self.errors
        listed = " ".join(f"({k}) {p.message}" for k, p in enumerate(errors[:MAX_LISTED], 1))
        more = f" ... and {len(errors) - MAX_LISTED} more." if len(errors) > MAX_LISTED else ""
        return ModuleMismatchError(
            f"Cannot load {self.source_name} into {self.module_name}: {len(errors)} problem(s) with its keys. {listed}{more} "
            "Fix the mapper or the model, or pass strict=False to load only the keys that fit (report.frame lists them).",
            self,
        )

    def summary(self) -> str:
        """One line per finding."""
        head = f"Load {self.source_name} -> {self.module_name}: {len(self.fill)} keys to fill, {len(self.errors)} error(s)"
        lines = [head, *(f"  {p.severity}: {p.message}" for p in self.problems)]
        if self.recompute:
            lines.append(f"  to recompute (non-persistent buffers the source does not hold): {', '.join(self.recompute)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<LoadCheck {self.source_name} -> {self.module_name}: {len(self.fill)} to fill, {len(self.errors)} error(s)>"

    def _repr_html_(self) -> str:
        head = html.escape(self.summary().splitlines()[0])
        return f"<div><b>{head}</b></div>" + (self.frame.to_html(index=False) if self.problems else "")


def check_load(
    state: Mapping[str, StateEntry],
    outputs: Mapping[str, TensorInfo],
    *,
    mapper_problems: Iterable[Problem] = (),
    elsewhere: Iterable[str] = (),
    module_name: str = "the module",
    source_name: str = "the source",
) -> LoadCheck:
    """Compare the source's outputs (after the mapper, in source order) with the module's state keys.

    `elsewhere`: output names another rank's module holds (pipeline stages); they are not unexpected.
    """
    check = LoadCheck(module_name, source_name)
    add = check.problems.append
    for p in mapper_problems:
        add(KeyProblem("mapper", p.severity, p.tensor, None, None, p.message))
    status = compare_tensors(outputs, expected_keys(state))
    others = set(elsewhere)
    filled: dict[str, str] = {}  # tie leader -> the output that fills it (the first of its tie that fits)
    for name, out in outputs.items():
        found = describe(out.dtype, out.shape)
        if status[name] == "unexpected":
            if name not in others:
                add(KeyProblem(
                    "unexpected", "error", name, None, found,
                    f"Unexpected {name!r}: the source (after the mapper) has it ({found}) but the module has no "
                    "parameter or buffer of that name. Drop or rename it in the mapper, or pass strict=False to skip it.",
                ))
            continue
        entry = state[name]
        want = entry.info
        wanted = describe(want.dtype, want.shape)
        if status[name] == "shape mismatch":
            add(KeyProblem(
                "shape", "error", name, wanted, found,
                f"Shape mismatch for {name!r}: the module expects {list(want.shape)} but the source gives {list(out.shape)}. "
                "Fix the mapper (Reshape, Split, Concat) or build the module with the checkpoint's config.",
            ))
            continue
        if entry.leader in filled:
            add(KeyProblem(
                "tied", "info", name, wanted, found,
                f"{name!r} is tied to {entry.leader!r}, already filled from {filled[entry.leader]!r}: this copy is not read.",
            ))
            continue
        if status[name] == "dtype differs":
            add(KeyProblem(
                "dtype", "warning", name, wanted, found,
                f"{name!r} is stored as {out.dtype} and is cast to the module's {want.dtype} while loading.",
            ))
        filled[entry.leader] = name
        check.fill[name] = entry.leader
    for key, entry in state.items():
        if not entry.persistent:  # optional: kept as it is, or recomputed if it has no storage yet (even if mismatched)
            if entry.leader not in filled and getattr(entry.tensor, "is_meta", False):
                check.recompute.append(key)
            continue
        if key in outputs:
            continue
        wanted = describe(entry.info.dtype, entry.info.shape)
        # 'tied' only says some key of the tie is produced; it fills this one only if its shape fits
        if status[key] == "tied" and entry.leader in filled:
            add(KeyProblem(
                "tied", "info", key, wanted, None,
                f"{key!r} is tied to {entry.leader!r}: it is filled through that tensor (from {filled[entry.leader]!r}).",
            ))
            continue
        add(KeyProblem(
            "missing", "error", key, wanted, None,
            f"Missing {key!r}: the module expects {wanted} but the source (after the mapper) has no such "
            "tensor. Map it from a source tensor, or pass strict=False to leave it unloaded.",
        ))
    return check
