"""Kernels of the weighted-sum family: `linear` (weighted mean), `passthrough` (one model, optionally scaled) and
`nearswap` (take the other model's value where it is close to the base).

Each kernel receives the group's tensors in the merge's order and compute dtype, the model names, the base
model (or None) and the bound parameters (`methods.Method`), and returns one tensor. The float operations
and their order are mergekit 0.1.5's, so results are bit-identical: `linear` accumulates `w_i * x_i` in
float32 (float64 for float64 inputs) in model order with fused multiply-adds, divides by the sum of the
weights, then rounds once to the inputs' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def linear(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """`Σ w_i·x_i / Σ w_i` (without the division when normalize is false), accumulated in float32."""
    import torch

    first = tensors[0]
    acc_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    # mergekit runs its kernel on a batch of groups (a leading axis of 1 here); the same shapes give the same kernels.
    rows = [tensor.unsqueeze(0) for tensor in tensors]
    weights = torch.tensor([[params["weight"][model] for model in models]], dtype=acc_dtype)
    broadcast = (1,) * (first.dim() + 1)
    total = weights.sum(dim=1).reshape(broadcast) if params["normalize"] else None
    acc = torch.zeros_like(rows[0], dtype=acc_dtype)
    for row, weight in zip(rows, weights.unbind(1), strict=True):
        acc.addcmul_(row, weight.reshape(broadcast))
    if total is not None:
        acc.div_(total)
    return acc.to(first.dtype).squeeze(0)


def passthrough(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """The one input, times `scale` when given (in the input's dtype)."""
    scale = params["scale"][models[0]]
    return tensors[0] if scale is None else tensors[0] * scale


def nearswap(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """Per element, `w·other + (1-w)·base` with `w = clamp(t / max(|base - other|, 1e-6), 0, 1)`, in the inputs' dtype."""
    import torch

    at = models.index(base)  # type: ignore[arg-type]
    a, b = tensors[at], tensors[1 - at]
    weight = (params["t"] / torch.abs(a - b).clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a
