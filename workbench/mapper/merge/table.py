"""`parameter_table`: the value every merge parameter takes for every output tensor, before anything is read.

A merge config says `t: [0, 0.5, 1]` or `weight: [{filter: mlp, value: 0.3}, {value: 0.7}]`; what each tensor
gets depends on its layer, its name and the slice it is in. Binding the mapper to the checkpoint resolves them
(one `Merge` per output tensor); this table lists them, one row per output tensor: its layer, the method, the
base model, the models it reads and one column per parameter (a number, or `model=value` pairs for the
per-model ones). Shown by notebook 07 and usable as a check before a long merge.
"""

from __future__ import annotations

from typing import Any

from .op import Merge
from .parameters import layer_of


def _cell(value: Any) -> Any:
    if isinstance(value, dict):
        return ", ".join(f"{model}={_number(v)}" for model, v in value.items())
    return _number(value)


def _number(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


def parameter_table(mapper: Any, source: Any) -> Any:
    """A pandas DataFrame indexed by output tensor name: `layer`, `method`, `base`, `models`, and one column per
    parameter the merges resolve (see the module docstring). `source`: the (multi-source) checkpoint the mapper
    merges; raises the mapper's binding error when the mapper does not bind."""
    import pandas as pd

    binding = mapper.bind(source)
    rows = []
    for group in binding.groups:
        ops = group.op.leaves() if hasattr(group.op, "leaves") else [group.op]
        for op in ops:
            if not isinstance(op, Merge):
                continue
            row: dict[str, Any] = {"output": op.output, "layer": layer_of(op.output), "method": op.method, "base": op.base,
                                   "models": ", ".join(op.models)}
            for key, value in op.params:
                row[key] = _cell(dict(value) if isinstance(value, tuple) else value)
            rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame["layer"] = frame["layer"].astype("Int64")
    return frame.set_index("output").sort_values(["layer", "output"], na_position="first", kind="stable")
