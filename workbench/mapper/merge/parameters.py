"""Merge parameters as mergekit writes them, resolved to one number per output tensor.

A parameter value is one of:

- a scalar (`0.5`, `true`);
- a gradient: a list of numbers interpolated over the layer index (`t: [0, 0.5, 1]`). Layer `i` of `n` sits at
  `t = i / (n - 1)` (`t = 1` when there is one layer); tensors outside the layers (embeddings, final norm,
  lm_head) sit at `t = 0`. The value at `t` is `(1 - f)·v[k] + f·v[k+1]` with `k = int(t·(len - 1))`,
  `f = t·(len - 1) - k` (mergekit's rule, same float operations); a list of booleans or strings picks
  `v[int(t·(len - 1))]`;
- a list of `{"filter": "self_attn", "value": v}` entries: the first entry whose filter is a substring of the
  tensor name (or has no filter, or filter `*`) gives the value, itself a scalar or a gradient. When no entry
  matches, the value is unset and the next place it can come from (the model's own parameters come before
  the global ones, then the method's default) is asked.

`resolve` evaluates one value for one tensor; `layer_of` finds a tensor's layer index from its name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import MapperError

# A decoder layer in a tensor name: `model.layers.3.`, `transformer.h.3.`, `blocks.3.`, `layer.3.`.
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def layer_of(tensor_name: str) -> int | None:
    """The decoder-layer index in `tensor_name` (`model.layers.3.mlp.up_proj.weight` -> 3), None outside layers."""
    found = LAYER.search(tensor_name.rpartition("::")[2])
    return int(found.group(1)) if found else None


def position(layer_index: int | None, num_layers: int | None) -> float:
    """mergekit's `t` of a layer: `i / (n - 1)`, 1 for a single layer, 0 outside the layers."""
    if layer_index is None or not num_layers:
        return 0.0
    return layer_index / (num_layers - 1) if num_layers > 1 else 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _entry(item: Any) -> tuple[str | None, Any] | None:
    """(filter, value) of a `{"filter": ..., "value": ...}` entry, None when `item` is no such entry."""
    if isinstance(item, Mapping) and "value" in item and set(item) <= {"filter", "value"}:
        return item.get("filter"), item["value"]
    return None


def check(value: Any, key: str) -> None:
    """Raise MapperError naming `key` when `value` is none of the forms above."""
    if _is_scalar(value) or value is None:
        return
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, Sequence) and not isinstance(value, str):
        if all(_is_scalar(item) for item in value):
            return
        for item in value:
            found = _entry(item)
            if found is None:
                break
            flt, inner = found
            if flt is not None and not isinstance(flt, str):
                break
            check(inner, key)
        else:
            return
    raise MapperError(
        f"Cannot use merge parameter {key!r} = {value!r}: give a number, a list of numbers (a gradient over the layers), "
        "or a list of {'filter': 'self_attn', 'value': ...} entries (an entry without filter is the default)."
    )


def _gradient(values: Sequence[Any], t: float) -> Any:
    if not all(_is_number(v) for v in values):
        return values[int(t * (len(values) - 1))]
    scaled = t * (len(values) - 1)
    low = int(scaled)
    high = min(len(values) - 1, low + 1)
    frac = scaled - low
    return (1 - frac) * values[low] + frac * values[high]


def evaluate(value: Any, tensor_name: str, t: float) -> Any:
    """The value of one parameter setting for `tensor_name` at layer position `t`; None when no filter matches."""
    if isinstance(value, Mapping):
        value = [value]
    if _is_scalar(value) or value is None:
        return value
    if not value:
        return None
    if all(_is_scalar(item) for item in value):
        return _gradient(value, t)
    for item in value:
        found = _entry(item)
        if found is None:
            raise MapperError(f"Cannot resolve merge parameter {value!r}: {item!r} is not a {{'filter', 'value'}} entry.")
        flt, inner = found
        if flt is None or flt == "*" or (tensor_name and flt in tensor_name):
            return evaluate(inner, tensor_name, t)
    return None


def resolve(value: Any, tensor_name: str, layer_index: int | None = None, num_layers: int | None = None) -> Any:
    """One parameter setting (scalar, gradient or filtered list) evaluated for one tensor.

    `layer_index` is the tensor's layer in the output (None outside the layers: embeddings, final norm, lm_head,
    which mergekit evaluates at t=0), `num_layers` the number of layers the gradient spans. Returns None when a
    filtered list has no entry for this tensor (then the next source of the value applies)."""
    return evaluate(value, tensor_name, position(layer_index, num_layers))


def first_set(settings: Sequence[Mapping[str, Any] | None], key: str, tensor_name: str, t: float) -> Any:
    """The value of `key` from the first of `settings` (highest precedence first) that sets it for this tensor."""
    for scope in settings:
        if scope and key in scope:
            found = evaluate(scope[key], tensor_name, t)
            if found is not None:
                return found
    return None
