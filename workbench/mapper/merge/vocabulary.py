"""`AlignVocabulary`: every model's embedding (or lm_head) rows moved to one output vocabulary, before a merge.

mergekit's `tokenizer_source: base` merges models whose tokenizers differ: each model's vocabulary-indexed
tensor is rebuilt with one row per token of the output vocabulary (the base model's), found by token string.
A token the model lacks gets a default row, by mergekit's rule: the only model that has it gives its row; else
the base model's row when the base is among the inputs and has it; else the average of the rows of the models
that have it (summed in order onto zeros, then divided by their count); a token no model has gets zeros.

`rows[k][j]` says where output model `k`'s row `j` comes from: `((i, r),)` row `r` of input `i`; several pairs
the average of those rows; `()` zeros. `pad` more rows follow (mergekit's `pad_to_multiple_of`), each the mean of
that output's rows above them. mergekit's per-token settings (`tokenizer.tokens`: a model's row, a model's token by
string or id, zeros, `force` for every model) are row tables too (`token_rows`). Inputs and outputs are the models' tensors in the same order (an output
may keep its input's name). The op computes in the inputs' promoted dtype (after `dtype`, when given), as
mergekit does, and holds one group of N inputs and N outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...dtypes import to_torch
from ...errors import MapperError
from ..base import Meta
from ..op import Op
from .op import _dtype_or_none, promote

Rows = tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True, init=False, repr=False)
class AlignVocabulary(Op):
    """Rebuild each model's vocabulary rows in the output vocabulary's order (see the module docstring)."""

    inputs_: tuple[str, ...]
    outputs_: tuple[str, ...]
    rows: tuple[Rows, ...]
    dtype: str | None = None
    pad: int = 0

    NAME_LIST_FIELDS = ("inputs_", "outputs_")
    POSITIONAL = ("inputs", "outputs", "rows")

    def __init__(self, inputs: Sequence[str], outputs: Sequence[str], rows: Sequence[Sequence[Sequence[Sequence[int]]]], *,
                 dtype: str | None = None, pad: int = 0) -> None:
        frozen = tuple(tuple(tuple((int(i), int(r)) for i, r in row) for row in table) for table in rows)
        if len(inputs) != len(outputs) or len(frozen) != len(outputs) or not inputs:
            raise MapperError(f"Cannot build AlignVocabulary: give one output name and one row table per input "
                              f"({len(inputs)} inputs, {len(outputs)} outputs, {len(frozen)} tables).")
        if any(i < 0 or i >= len(inputs) or r < 0 for table in frozen for row in table for i, r in row):
            raise MapperError("Cannot build AlignVocabulary: a row names an input or a row index out of range.")
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0 or (pad and not all(frozen)):
            raise MapperError(f"Cannot build AlignVocabulary: pad is a count of rows (got {pad!r}) after at least one row.")
        for name, value in (("inputs_", tuple(inputs)), ("outputs_", tuple(outputs)), ("rows", frozen),
                            ("dtype", _dtype_or_none(dtype, "dtype", "AlignVocabulary")), ("pad", pad)):
            object.__setattr__(self, name, value)
        self._normalize()

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.inputs_

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.outputs_

    def arguments(self) -> dict[str, Any]:
        """Constructor arguments worth writing (export)."""
        out: dict[str, Any] = {"inputs": list(self.inputs_), "outputs": list(self.outputs_),
                               "rows": [[[list(pair) for pair in row] for row in table] for table in self.rows]}
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.pad:
            out["pad"] = self.pad
        return out

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        tails = {tuple(shape[1:]) for _, shape in metas}
        if len(tails) != 1 or any(len(shape) < 1 for _, shape in metas):
            raise MapperError(f"Cannot align the vocabulary of {self.inputs_[0]!r}: the tensors' shapes "
                              f"{[list(s) for _, s in metas]} differ outside the vocabulary axis (dim 0).", tensor=self.inputs_[0])
        for table in self.rows:
            for row in table:
                for i, r in row:
                    if r >= metas[i][1][0]:
                        raise MapperError(f"Cannot align the vocabulary of {self.inputs_[i]!r}: row {r} is beyond its "
                                          f"{metas[i][1][0]} rows. Check the tokenizer against config.json's vocab_size.",
                                          tensor=self.inputs_[i])
        dtype = self.dtype or promote([d for d, _ in metas])
        tail = next(iter(tails))
        return [(dtype, (len(table) + self.pad, *tail)) for table in self.rows]

    def scratch_bytes(self, inputs: Sequence[Any]) -> int:
        """Work bytes besides the group's inputs and outputs, for the plan's memory: a copy of each input the `dtype`
        cast changes, one row for an average, and the rebuilt tensors themselves — bound in one group with the merge
        that follows, they are intermediates the group's outputs do not count (alone, they are counted twice: the
        prediction errs high)."""
        from math import prod

        from ...dtypes import dtype_bits

        if not inputs:
            return 0
        dtype = self.dtype or promote([info.dtype for info in inputs])
        width = max(1, dtype_bits(dtype) // 8)
        casts = sum(prod(info.shape) * width for info in inputs if self.dtype is not None and info.dtype != self.dtype)
        row = prod(inputs[0].shape[1:]) * width
        return casts + row + sum(len(table) + self.pad for table in self.rows) * row

    def _compute(self, tensors: list[Any]) -> list[Any]:
        import torch

        if self.dtype is not None:
            tensors = [t.to(dtype=to_torch(self.dtype)) for t in tensors]
        dtype = tensors[0].dtype
        for tensor in tensors[1:]:
            dtype = torch.promote_types(dtype, tensor.dtype)
        tail = tensors[0].shape[1:]
        outputs = []
        for table in self.rows:
            out = torch.zeros((len(table) + self.pad, *tail), dtype=dtype)
            for j, row in enumerate(table):
                if len(row) == 1:
                    i, r = row[0]
                    out[j] = tensors[i][r]
                elif row:
                    embed = torch.zeros(tail, dtype=dtype)
                    for i, r in row:
                        embed = embed + tensors[i][r]
                    embed /= len(row)
                    out[j] = embed
            if self.pad:
                out[len(table):] = torch.mean(out[:len(table)], dim=0)
            outputs.append(out)
        return outputs


def align_rows(out_vocab: dict[str, int], vocabularies: Sequence[dict[str, int]], sizes: Sequence[int],
               base: int | None) -> tuple[Rows, ...]:
    """Each model's row table for `out_vocab` (token -> output id), by mergekit's rule (module docstring);
    `vocabularies[k]` is model k's token -> id, `sizes[k]` its rows (ids beyond them count as absent), `base` the
    index of the base model among them (None when it is not an input)."""
    order = sorted(out_vocab.items(), key=lambda item: item[1])
    where = [[(v.get(tok, -1) if v.get(tok, -1) < size else -1) for tok, _ in order] for v, size in zip(vocabularies, sizes, strict=True)]
    tables = []
    for k in range(len(vocabularies)):
        table = []
        for j in range(len(order)):
            if where[k][j] >= 0:
                table.append(((k, where[k][j]),))
                continue
            present = [m for m in range(len(vocabularies)) if where[m][j] >= 0]
            if len(present) == 1:
                table.append(((present[0], where[present[0]][j]),))
            elif not present:
                table.append(())
            elif base is not None and where[base][j] >= 0:
                table.append(((base, where[base][j]),))
            else:
                table.append(tuple((m, where[m][j]) for m in present))
        tables.append(tuple(table))
    return tuple(tables)


Row = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TokenSource:
    """One entry of mergekit's `tokenizer.tokens`: the row a token gets — `row` (a row table entry: `((i, r),)` or
    `()` for zeros) — given to the models that lack the token, or to every model when `force`."""

    row: Row
    force: bool = False


def token_rows(tables: Sequence[Rows], out_vocab: dict[str, int], vocabularies: Sequence[dict[str, int]],
               sizes: Sequence[int], tokens: dict[str, TokenSource]) -> tuple[Rows, ...]:
    """`tables` (from `align_rows`) with the per-token settings applied: a token with a setting takes its row in
    every model that lacks the token (in every model when forced) instead of mergekit's default."""
    out = [list(table) for table in tables]
    for token, source in tokens.items():
        j = out_vocab[token]
        for k, (vocab, size) in enumerate(zip(vocabularies, sizes, strict=True)):
            has = 0 <= vocab.get(token, -1) < size
            if source.force or not has:
                out[k][j] = source.row
    return tuple(tuple(table) for table in out)
