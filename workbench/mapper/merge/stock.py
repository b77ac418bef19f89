"""Kernels that weigh the models by their geometry: `model_stock` (interpolate toward the models' mean by the
angle between their task vectors) and `sce` (select by variance, elect signs, weigh by energy).

Same arguments as the other kernel modules; mergekit 0.1.5's operations in its order, in the inputs' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .task_arithmetic import sign_mask


def model_stock(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """`t·mean(models) + (1-t)·base` with `t = k·cos / (1 + (k-1)·cos)`, cos the mean cosine between the task vectors
    (per row when filter_wise); the base where the denominator vanishes."""
    import torch

    w0 = tensors[models.index(base)]  # type: ignore[arg-type]
    ws = [t for m, t in zip(models, tensors, strict=True) if m != base]
    shape = w0.shape
    if params["filter_wise"]:
        if w0.dim() == 1:
            w0, ws = w0.unsqueeze(0), [w.unsqueeze(0) for w in ws]
    else:
        w0, ws = w0.reshape(-1), [w.reshape(-1) for w in ws]
    offsets = [w - w0 for w in ws]
    cosines = []
    for k, a in enumerate(offsets):
        for b in offsets[k + 1:]:
            norms = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cosines.append(((a * b).sum(dim=-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    count = len(ws)
    denominator = 1 + (count - 1) * cos
    singular = denominator.abs() < 1e-6
    safe = torch.where(singular, torch.ones_like(denominator), denominator)
    t = torch.where(singular, torch.zeros_like(cos), (count * cos) / safe)
    return (t * (sum(ws) / count) + (1 - t) * w0).reshape(shape)


def _energy(vectors: Any) -> Any:
    import torch

    energy = vectors.square().reshape(vectors.shape[0], -1).mean(dim=1)
    total = torch.sum(energy).item()
    if abs(total) < 1e-6:
        return torch.ones_like(energy) / energy.shape[0]
    return energy / total


def _variance_mask(vectors: Any, fraction: float, mask_dtype: Any) -> Any:
    import torch

    if fraction <= 0:
        return torch.zeros_like(vectors[0], dtype=mask_dtype)
    if fraction >= 1:
        return torch.ones_like(vectors[0], dtype=mask_dtype)
    var = torch.var(vectors, dim=0, unbiased=False)
    keep = int(torch.count_nonzero(var) * fraction)
    if keep == 0:
        return torch.zeros_like(var, dtype=mask_dtype)
    _, chosen = torch.topk(var.abs().view(-1), k=keep, largest=True)
    mask = torch.zeros_like(var, dtype=mask_dtype)
    mask.view(-1)[chosen] = 1
    return mask


def sce(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """Task vectors kept where their variance across models is in the top `select_topk`, sign-elected, and averaged
    with weights proportional to their mean square; added to the base."""
    import torch

    base_tensor = tensors[models.index(base)]  # type: ignore[arg-type]
    others = [t for m, t in zip(models, tensors, strict=True) if m != base]
    if not others:
        return base_tensor
    mask_dtype = torch.int8 if params["int8_mask"] else base_tensor.dtype
    vectors = torch.stack([t - base_tensor for t in others], dim=0)
    if params["select_topk"] < 1:
        vectors = vectors * _variance_mask(vectors, params["select_topk"], mask_dtype).unsqueeze(0)
    erase = sign_mask(vectors, mask_dtype)
    weights = _energy(vectors)
    while weights.dim() < vectors.dim():
        weights = weights.unsqueeze(-1)
    erased = weights * erase
    merged = (vectors * erased).sum(dim=0)
    return base_tensor + merged / torch.sum(erased, dim=0).clamp(min=1e-6)
