"""A format's own statement of what its output must hold, for `--verify` to check the file against.

The output check (`engine.output_check`) re-reads every planned output and compares it with the source: it proves the
file holds what the plan says. A plan can be wrong too: a preset that forgets a tensor (llama.cpp's GGUF layout once
lost a Llama's biases) plans without it, writes without it, and re-reads "all match". A `Statement` is what a format
can say independently of the plan's ops: every tensor the file must hold (name, dtype and shape as the written catalog
gives them), and the source tensors those are made from or that are left out on purpose (`accounted`). Verification
then fails on a stated tensor that is missing, an unstated one that is there, one of another dtype or shape, and a
source tensor no step read and the statement does not account for (dropped without a word).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Statement:
    """What an output must hold, stated apart from the plan's ops: `tensors` (output name -> (dtype, shape) as the
    written catalog gives them; dtype None: any, as the dtype policy chose), `accounted` (source tensors they are made
    from, or left out on purpose; None: not stated), and the `family` messages name ("llama.cpp GGUF (llama)")."""

    family: str
    tensors: Mapping[str, tuple[str | None, tuple[int, ...]]]
    accounted: frozenset[str] | None
    why_unchecked: str = ""  # set: nothing was stated, and why (the verify report says so instead of passing silently)
    optional: frozenset[str] = frozenset()  # stated names the output may leave out (a tied head, a rebuilt buffer)


def meta_statement(layout: Mapping[str, tuple[int, ...]]) -> Statement:
    """The statement of a Meta `.pth` output: the names and shapes Meta's model declares (`mapper.presets.output_presets.
    meta_layout`), any dtype (the policy's), source tensors not stated (an HF tensor the preset does not know is its
    Claim's plan problem)."""
    return Statement("Meta Llama (llama/model.py)", {name: (None, tuple(shape)) for name, shape in layout.items()}, None)


def statement_rows(statement: Statement, written: Mapping[str, tuple[str, tuple[int, ...]]], source: list[str],
                   read: set[str]) -> list[tuple[str, str, str, float | None, int, str]]:
    """Output-check rows (see `engine.output_check.COLUMNS`) for what the written file (`written`: name -> (dtype,
    shape)) and the conversion (`read`: source tensors its steps read, of the `source` names) do not share with
    `statement`; no row when they agree."""
    rows: list[tuple[str, str, str, float | None, int, str]] = []
    family = statement.family
    for name, meta in statement.tensors.items():
        found = written.get(name)
        if found is None and name in statement.optional:
            continue
        if found is None:
            rows.append((name, "statement", "missing", None, 0, f"the {family} statement has it; the output does not"))
        elif (meta[0] is not None and found[0] != meta[0]) or tuple(found[1]) != tuple(meta[1]):
            said = f"{meta[0]} {list(meta[1])}" if meta[0] is not None else f"shape {list(meta[1])}"
            rows.append((name, "statement", "mismatch", None, 0,
                         f"is {found[0]} {list(found[1])} in the output; the {family} statement says {said}"))
    for name in written:
        if name not in statement.tensors:
            rows.append((name, "statement", "mismatch", None, 0, f"in the output, but the {family} statement has no such tensor"))
    for name in source if statement.accounted is not None else ():
        if name not in statement.accounted and name not in read:
            rows.append((name, "statement", "missing", None, 0,
                         f"source tensor dropped: no output tensor is made from it and the {family} statement does not "
                         "leave it out on purpose"))
    return rows


def unchecked(family: str, why: str) -> Statement:
    """A statement that states nothing, and why (a config the statement needs is missing or unknown): the output check
    reports "not checked against <family>: <why>" rather than passing as if it had been checked."""
    return Statement(family, {}, None, why)


def meta_statement_of(layout: Any, config: Any, nproc_mp: int) -> Statement:
    """`meta_statement` of `layout(config, nproc_mp)` (`mapper.presets.output_presets.meta_layout`), or `unchecked` naming why
    config.json cannot state Meta's layout (not a Llama-like config: a size missing or not a number)."""
    from ..errors import WorkbenchError

    try:
        return meta_statement(layout(config, nproc_mp))
    except (WorkbenchError, TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        return unchecked("Meta Llama (llama/model.py)", f"config.json does not state its layout ({getattr(exc, 'message', exc)})")


def nearest_statement(family: str, layouts: list[tuple[str, Mapping[str, tuple[str | None, tuple[int, ...]]]]],
                      optional: frozenset[str], written: Mapping[str, tuple[str, tuple[int, ...]]]) -> Statement:
    """Of a model's stated layouts (`mapper.presets.transformers_declared.declared_layouts`: the names transformers saves, the
    names it holds in memory), the statement the `written` tensors disagree with least: the output may be either."""
    best: tuple[int, Statement] | None = None
    for name, tensors in layouts:
        statement = Statement(f"{family} {name}" if len(layouts) > 1 else family, tensors, None, optional=optional)
        rows = len(statement_rows(statement, written, [], set()))
        if best is None or rows < best[0]:
            best = (rows, statement)
    assert best is not None, "a model states at least one layout"
    return best[1]


__all__ = ["Statement", "meta_statement", "meta_statement_of", "nearest_statement", "statement_rows",
           "unchecked"]
