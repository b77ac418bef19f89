"""Kernels of the spherical family: `slerp`, `nuslerp`, `multislerp` and `karcher` (interpolation on the sphere).

Same arguments as the other kernel modules (tensors in merge order and compute dtype, models, base, bound
parameters). The float operations follow mergekit 0.1.5 step for step, chunk sizes included, so results are
bit-identical: `slerp` works in float32 (float64 for float64 inputs) over chunks of 2^20 elements and writes
into a tensor of the inputs' dtype; `nuslerp` and `multislerp` compute in the inputs' dtype; `karcher` takes its
norms in float32 and iterates in the inputs' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHUNK = 1024 * 1024  # elements per slice of slerp's passes (mergekit's)


def _split(base: str | None, models: Sequence[str], tensors: Sequence[Any]) -> tuple[Any, list[Any]]:
    """(the base tensor or None, the other tensors in order)."""
    if base is None:
        return None, list(tensors)
    return tensors[models.index(base)], [t for m, t in zip(models, tensors, strict=True) if m != base]


def slerp(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """Spherical interpolation from the base (t=0) to the other model (t=1); linear where they are (anti)parallel."""
    import torch

    v0, (v1,) = _split(base, models, tensors)
    work = torch.float64 if v0.dtype == torch.float64 else torch.float32
    a = v0.reshape(1, -1)
    b = v1.reshape(1, -1)
    t = torch.tensor([params["t"]], dtype=work).reshape(-1, 1)
    if not a.shape[1]:
        return ((1 - t) * a + t * b).reshape(v0.shape).to(v0.dtype)
    width = a.shape[1]
    starts = range(0, width, CHUNK)
    norms_a = [torch.linalg.vector_norm(a[:, s:s + CHUNK].to(work), dim=1, keepdim=True) for s in starts]
    norms_b = [torch.linalg.vector_norm(b[:, s:s + CHUNK].to(work), dim=1, keepdim=True) for s in starts]
    norm_a = torch.linalg.vector_norm(torch.stack(norms_a), dim=0)
    norm_b = torch.linalg.vector_norm(torch.stack(norms_b), dim=0)
    norm_a = torch.where(norm_a > 1e-8, norm_a, 1)
    norm_b = torch.where(norm_b > 1e-8, norm_b, 1)
    dots = [((a[:, s:s + CHUNK].to(work) / norm_a) * (b[:, s:s + CHUNK].to(work) / norm_b)).sum(dim=1, keepdim=True)
            for s in starts]
    dot = torch.stack(dots).sum(dim=0).clamp(-1, 1)
    straight = dot.abs() > 0.9995
    theta = torch.acos(torch.where(straight, 0, dot))
    sin_theta = torch.sin(theta)
    coef_a = torch.where(straight, 1 - t, torch.sin((1 - t) * theta) / sin_theta)
    coef_b = torch.where(straight, t, torch.sin(t * theta) / sin_theta)
    out = torch.empty_like(a)
    for s in starts:
        out[:, s:s + CHUNK] = coef_a * a[:, s:s + CHUNK].to(work) + coef_b * b[:, s:s + CHUNK].to(work)
    return out.reshape(v0.shape)


def _nuslerp_pair(t: float, v0: Any, v1: Any, dim: int, flatten: bool) -> Any:
    import torch

    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif dim != -1:
        v0, v1 = v0.transpose(dim, -1), v1.transpose(dim, -1)
    u0 = v0 / torch.norm(v0, dim=-1, keepdim=True).clamp(min=1e-7)
    u1 = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=1e-7)
    cos = torch.sum(u0 * u1, dim=-1, keepdim=True).clamp(-1, 1)
    parallel = (1 - cos.square()) <= 1e-8**2
    theta = torch.acos(torch.where(parallel, 0, cos))
    out = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / torch.sin(theta)
    out = torch.where(parallel, (1 - t) * v0 + t * v1, out)
    if dim != -1 and not flatten:
        out = out.transpose(dim, -1)
    return out.reshape(shape)


def nuslerp(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """SLERP between two models at `t = w_2 / (w_1 + w_2)` (0.5 when the weights cancel), of their differences to the
    base when there is one; row-wise or over the flattened tensor as the options say."""
    base_tensor, (first, second) = _split(base, models, tensors)
    weights = [params["weight"][m] for m in models if m != base]
    total = sum(weights)
    t = 0.5 if abs(total) < 1e-6 else weights[1] / total
    dim = 0 if params["nuslerp_row_wise"] else -1
    flatten = params["nuslerp_flatten"]
    if base_tensor is None:
        return _nuslerp_pair(t, first, second, dim, flatten)
    return base_tensor + _nuslerp_pair(t, first - base_tensor, second - base_tensor, dim, flatten)


def multislerp(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """Barycentric interpolation of several models on the sphere (tangent space at their weighted mean direction),
    rescaled to their weighted mean norm; of the differences to the base when there is one."""
    import torch

    base_tensor, others = _split(base, models, tensors)
    if len(others) == 1:
        return others[0]
    eps = params["eps"]
    stacked = torch.stack(others, dim=0)
    if base_tensor is not None:
        stacked -= base_tensor
    flat = stacked.view(stacked.shape[0], -1)
    weights = torch.tensor([params["weight"][m] for m in models if m != base], dtype=stacked.dtype)
    if params["normalize_weights"]:
        weights = weights / weights.sum()
    norms = torch.norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * weights.view(-1, 1)).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps:
        if stacked.shape[0] == 2:
            out = (stacked[0] * weights[0] + stacked[1] * weights[1]).view(stacked.shape[1:])
            return out + base_tensor if base_tensor is not None else out
        from ...errors import MapperError

        raise MapperError("Cannot multislerp: the weighted sum of the directions is zero (antipodal models with balancing "
                          "weights). Use other weights.")
    mean = mean / mean_norm
    dots = (units * mean).sum(-1, keepdim=True)
    tangents = units - dots * mean
    tangent = (tangents * weights.view(-1, 1)).sum(0)
    tangent_norm = torch.norm(tangent) + eps
    out = mean * torch.cos(tangent_norm) + tangent * (torch.sin(tangent_norm) / tangent_norm)
    out = (out * (norms.squeeze(-1) * weights).sum()).view(stacked.shape[1:])
    return out + base_tensor if base_tensor is not None else out


def karcher(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any]) -> Any:
    """The weighted Karcher (Fréchet) mean of the models' directions on the unit sphere (uniform weights, at most
    `max_iter` steps, stopping below `tol`), scaled by the mean of their norms."""
    import torch

    if len(tensors) == 1:
        return tensors[0]
    max_iter, tol = params["max_iter"], params["tol"]
    alphas = [1.0 / len(tensors)] * len(tensors)
    work = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms, units = [], []
    for tensor in tensors:
        norm = torch.linalg.vector_norm(tensor.to(work))
        norms.append(norm)
        units.append(torch.zeros_like(tensor) if norm.item() == 0.0 else (tensor / norm).to(tensor.dtype))
    kept = [k for k, norm in enumerate(norms) if norm.item() > tol]
    if not kept:
        return sum(tensor * 0 for tensor in tensors)
    kept_alphas = [alphas[k] for k in kept]
    alpha_sum = sum(kept_alphas)
    weights = [alpha / alpha_sum for alpha in kept_alphas]
    kept_units = [units[k] for k in kept]
    mean = torch.zeros_like(kept_units[0])
    for weight, unit in zip(weights, kept_units, strict=True):
        mean += weight * unit
    mean_norm = torch.linalg.vector_norm(mean.to(work))
    mean = kept_units[0].clone() if mean_norm.item() < tol else (mean / mean_norm).to(mean.dtype)
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for weight, unit in zip(weights, kept_units, strict=True):
            dot = torch.clamp(torch.dot(mean.flatten(), unit.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < tol:
                continue
            tangent += weight * (theta / torch.sin(theta)) * (unit - dot * mean)
        tangent_norm = torch.linalg.vector_norm(tangent.to(work))
        if tangent_norm.item() < tol:
            break
        mean = (torch.cos(tangent_norm) * mean + torch.sin(tangent_norm) * (tangent / tangent_norm)).to(mean.dtype)
        unit_norm = torch.linalg.vector_norm(mean.to(work))
        if unit_norm.item() > tol:
            mean = (mean / unit_norm).to(mean.dtype)
    scale = sum(alpha * norm for alpha, norm in zip(alphas, norms, strict=True))
    return scale * mean
