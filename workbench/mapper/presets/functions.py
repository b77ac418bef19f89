"""Built-in callables for `Function` operations (referenced by name, e.g. 'workbench.mapper.presets.functions:merge_lora')."""

from __future__ import annotations

from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError


def merge_lora(weight: Any, lora_a: Any, lora_b: Any, *, scale: float) -> Any:
    """`weight + scale * lora_b @ lora_a`, computed in float32 and returned in the weight's dtype."""
    import torch

    delta = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    return (weight.to(torch.float32) + scale * delta).to(weight.dtype)


def infer_merge_lora(weight: TensorInfo, lora_a: TensorInfo, lora_b: TensorInfo, *, scale: float) -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `merge_lora`: the weight's; checks that the adapter shapes fit it."""
    shapes_fit = (
        len(weight.shape) == 2 and len(lora_a.shape) == 2 and len(lora_b.shape) == 2
        and lora_b.shape[0] == weight.shape[0] and lora_a.shape[1] == weight.shape[1] and lora_b.shape[1] == lora_a.shape[0]
    )
    if not shapes_fit:
        raise MapperError(
            f"Cannot merge LoRA into {weight.name!r} {list(weight.shape)}: lora_A is {list(lora_a.shape)} and lora_B is "
            f"{list(lora_b.shape)}, expected [r, {weight.shape[-1]}] and [{weight.shape[0]}, r]. "
            "Check that the adapter belongs to this base model.",
            tensor=weight.name,
        )
    return [(weight.dtype, weight.shape)]
