"""Merging (and unmerging) a PEFT LoRA adapter read from PEFT's own files into its base checkpoint.

The adapter folder holds `adapter_config.json` and `adapter_model.safetensors`; its keys look like
`base_model.model.<module>.lora_A.weight`. The mapper built here reads the adapter's tensors from the
source named `source` of a multi-source catalog (`adapter::base_model.model...`, see
workbench.formats.multi) and the base weights under their own names, and writes merged weights under
the base names, exactly as `PeftModel.merge_and_unload()` computes them:

- LoRA: `W + transpose(B @ A, fan_in_fan_out) * scaling`, scaling `alpha / r` (rsLoRA `alpha / sqrt(r)`),
  with `r` and `alpha` per module from `rank_pattern` / `alpha_pattern` (PEFT's matching rule);
- LoRA biases (`lora_bias=True`): `bias + lora_B.bias * scaling`;
- DoRA: `m / ‖W + ΔW‖ · (W + ΔW)`, the norm taken over each output row (PEFT's `get_weight_norm`:
  `linalg.norm(transpose(W + ΔW, fan_in_fan_out), dim=1)`), the factor broadcast along output rows;
- `modules_to_save` (and any other saved base parameter, e.g. with `bias="all"`): the adapter's copy
  replaces the base's.
Anything the adapter holds that this module does not understand (a key, a config setting) becomes a
problem of the plan, never silently ignored. `unmerge=True` builds the reverse (`W - ΔW`), defined for
plain LoRA and LoRA biases only: DoRA and replaced modules cannot be recovered from a merged weight.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..catalog import TensorInfo
from ..errors import MapperError
from .base import Mapper
from .compose import Parallel
from .function import Function
from .ops import Drop, Rename

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
_HERE = "workbench.mapper.lora"

# Config keys that only describe training or initialisation: they do not change how a saved adapter merges.
_NEUTRAL = {
    "alpha_pattern", "rank_pattern", "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "lora_bias",
    "modules_to_save", "target_modules", "peft_type", "task_type", "base_model_name_or_path", "revision",
    "peft_version", "inference_mode", "init_lora_weights", "lora_dropout", "layers_to_transform", "layers_pattern",
    "exclude_modules", "auto_mapping", "bias", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "megatron_core", "ensure_weight_tying",
}
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector)$")


def _is_default(value: Any) -> bool:
    return value in (None, False, {}, [], "none", "")


def pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The key of `patterns` that applies to `module`, by PEFT's rule: `(.*\\.)?(key)$` matches the module name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def read_adapter(adapter: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, TensorInfo], str]:
    """(config, adapter tensors by key, folder) of an adapter folder, its adapter_config.json, or
    a mapping {'config': {...}, 'tensors': {key: TensorInfo}} for adapters known from metadata only."""
    if isinstance(adapter, Mapping):
        if "config" in adapter and "tensors" in adapter:
            return dict(adapter["config"]), dict(adapter["tensors"]), ""
        raise MapperError(
            "Cannot read the PEFT adapter: a mapping must hold 'config' (adapter_config.json contents) and 'tensors' "
            "(key -> TensorInfo). Pass the adapter folder instead."
        )
    path = Path(adapter)
    folder = path.parent if path.name == CONFIG_FILE else path
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise MapperError(f"Cannot read the PEFT adapter in {folder}: {CONFIG_FILE} is missing. Point at the folder "
                          "PEFT's save_pretrained wrote.") from None
    except (OSError, ValueError) as exc:
        raise MapperError(f"Cannot read {config_path}: {exc}. Re-save the adapter with PEFT.") from None
    if not isinstance(config, dict):
        raise MapperError(f"Cannot read {config_path}: it is not a JSON object. Re-save the adapter with PEFT.")
    from ..formats import open_catalog

    catalog = open_catalog(folder)
    return config, dict(catalog.tensors), str(folder)


def _problem(key: str, source: str, reason: str) -> Mapper:
    """An op whose binding reports `reason` as a plan problem about adapter tensor `key`."""
    return Function(fn=f"{_HERE}:refuse", inputs=[f"{source}::{key}"], outputs=[f"{source}::{key}"],
                    infer=f"{_HERE}:infer_refuse", params={"reason": reason})


def _config_problems(config: Mapping[str, Any], anchor: str, source: str, where: str) -> list[Mapper]:
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"its peft_type is {config.get('peft_type')!r}, only 'LORA' adapters can be merged")
    for key, value in sorted(config.items()):
        if key not in _NEUTRAL and not _is_default(value):
            problems.append(f"its config sets {key}={value!r}, which lora_merge does not know how to merge")
    return [_problem(anchor, source, f"Cannot merge the PEFT adapter {where}: {p}. Merge it with PEFT instead.")
            for p in problems]


def peft_merge(
    adapter: str | os.PathLike | Mapping[str, Any],
    *,
    source: str = "adapter",
    unmerge: bool = False,
) -> Mapper:
    """A mapper that merges the PEFT adapter (folder, adapter_config.json path, or {'config','tensors'}) into
    the base weights of a multi-source catalog whose adapter source is named `source` (see the module docstring);
    `unmerge=True` subtracts it from already merged weights instead."""
    config, tensors, folder = read_adapter(adapter)
    where = folder or "(given config)"
    r0, alpha0 = config.get("r", 8), config.get("lora_alpha", 8)
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora, fifo = bool(config.get("use_rslora")), bool(config.get("fan_in_fan_out"))
    modules: dict[str, dict[str, str]] = {}
    ops: list[Mapper] = []
    for key in tensors:
        if not key.startswith(PEFT_PREFIX):
            ops.append(_problem(key, source, f"Cannot merge the PEFT adapter {where}: tensor {key!r} does not start with "
                                             f"{PEFT_PREFIX!r}, so its base module is unknown. Re-save the adapter with PEFT."))
            continue
        match = _LORA_KEY.match(key[len(PEFT_PREFIX):])
        if match:
            modules.setdefault(match["module"], {})[match["part"]] = key
        elif ".lora_" in key or "lora_embedding" in key:
            ops.append(_problem(key, source, f"Cannot merge the PEFT adapter {where}: tensor {key!r} is a LoRA part "
                                             "lora_merge does not know (e.g. an embedding or convolution adapter). Merge it with PEFT."))
        else:  # a saved base parameter (modules_to_save, bias='all'): the adapter's copy replaces the base's
            target = key[len(PEFT_PREFIX):]
            if unmerge:
                ops.append(_problem(key, source, f"Cannot unmerge the PEFT adapter {where}: {target!r} was replaced by the "
                                                 "adapter's copy (modules_to_save), the original is not in the merged weights."))
            else:
                ops += [Drop(target), Rename(f"{source}::{key}", target)]
    if tensors:
        ops += _config_problems(config, next(iter(tensors)), source, where)
    for module, parts in modules.items():
        if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
            some = next(iter(parts.values()))
            ops.append(_problem(some, source, f"Cannot merge the PEFT adapter {where}: module {module!r} lacks lora_A or "
                                              "lora_B. The adapter file is incomplete; re-save it with PEFT."))
            continue
        rank_key, alpha_key = pattern_key(ranks, module), pattern_key(alphas, module)
        r = ranks[rank_key] if rank_key is not None else r0
        alpha = alphas[alpha_key] if alpha_key is not None else alpha0
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        scoped = {part: f"{source}::{k}" for part, k in parts.items()}
        weight, params = f"{module}.weight", {"scale": scale, "fan_in_fan_out": fifo, "rank": int(r)}
        if "lora_magnitude_vector" in parts:
            if unmerge:
                ops.append(_problem(parts["lora_magnitude_vector"], source, f"Cannot unmerge the DoRA adapter {where}: "
                                    f"{module!r} was rescaled by the magnitude vector and the norm it divided by is not in the "
                                    "merged weight. Keep the base checkpoint instead."))
                continue
            ops.append(Function(fn=f"{_HERE}:merge_dora", infer=f"{_HERE}:infer_merge_dora", params=params, outputs=[weight],
                                inputs=[weight, scoped["lora_A.weight"], scoped["lora_B.weight"], scoped["lora_magnitude_vector"]]))
        else:
            ops.append(Function(fn=f"{_HERE}:merge_linear", infer=f"{_HERE}:infer_merge_linear", outputs=[weight],
                                inputs=[weight, scoped["lora_A.weight"], scoped["lora_B.weight"]],
                                params={**params, "sign": -1.0 if unmerge else 1.0}))
        if "lora_B.bias" in parts:
            ops.append(Function(fn=f"{_HERE}:merge_bias", infer=f"{_HERE}:infer_merge_bias", outputs=[f"{module}.bias"],
                                inputs=[f"{module}.bias", scoped["lora_B.bias"]],
                                params={"scale": scale, "sign": -1.0 if unmerge else 1.0}))
    return Parallel(*ops)


# -- the callables the Function ops name -----------------------------------------------------------------
def _delta(lora_a: Any, lora_b: Any, scale: float, fan_in_fan_out: bool) -> Any:
    """PEFT's `get_delta_weight`: `transpose(B @ A, fan_in_fan_out) * scaling`, in float32 for half inputs."""
    import torch

    a, b = lora_a, lora_b
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        a, b = a.to(torch.float32), b.to(torch.float32)
    delta = b @ a
    if fan_in_fan_out:
        delta = delta.T
    return delta * scale


def merge_linear(weight: Any, lora_a: Any, lora_b: Any, *, scale: float, fan_in_fan_out: bool, rank: int, sign: float = 1.0) -> Any:
    """`W ± ΔW` (see `_delta`), computed in float32 and returned in the weight's dtype."""
    import torch

    delta = _delta(lora_a, lora_b, scale, fan_in_fan_out)
    base = weight if weight.dtype == torch.float32 else weight.to(torch.float32)
    out = base + delta if sign > 0 else base - delta
    return out.to(weight.dtype)


def merge_dora(weight: Any, lora_a: Any, lora_b: Any, magnitude: Any, *, scale: float, fan_in_fan_out: bool, rank: int) -> Any:
    """PEFT's DoRA merge: `m / ‖W + ΔW‖_row · (W + ΔW)`, in float32, returned in the weight's dtype."""
    import torch

    delta = _delta(lora_a, lora_b, scale, fan_in_fan_out)
    base = weight if weight.dtype == torch.float32 else weight.to(torch.float32)
    merged = base + delta
    rows = merged.T if fan_in_fan_out else merged
    norm = torch.linalg.norm(rows, dim=1)
    factor = (magnitude.to(torch.float32) / norm).view(-1, 1)
    if fan_in_fan_out:
        factor = factor.T
    return (factor * merged).to(weight.dtype)


def merge_bias(bias: Any, lora_bias: Any, *, scale: float, sign: float = 1.0) -> Any:
    """`bias ± lora_B.bias * scaling` (PEFT's `lora_bias=True`), in float32, returned in the bias's dtype."""
    import torch

    extra = lora_bias.to(torch.float32) * scale
    base = bias.to(torch.float32)
    return (base + extra if sign > 0 else base - extra).to(bias.dtype)


def refuse(*tensors: Any, reason: str) -> Any:
    """Never computes: the op only exists to put `reason` in the plan."""
    raise MapperError(reason)


def infer_refuse(*infos: TensorInfo, reason: str) -> Any:
    """Report `reason` as a problem when the mapper is bound."""
    raise MapperError(reason, tensor=infos[0].name if infos else None)


def _fits(weight: TensorInfo, lora_a: TensorInfo, lora_b: TensorInfo, fan_in_fan_out: bool) -> bool:
    if len(weight.shape) != 2 or len(lora_a.shape) != 2 or len(lora_b.shape) != 2:
        return False
    rows, cols = weight.shape[::-1] if fan_in_fan_out else weight.shape
    return lora_b.shape[0] == rows and lora_a.shape[1] == cols and lora_b.shape[1] == lora_a.shape[0]


def infer_merge_linear(weight: TensorInfo, lora_a: TensorInfo, lora_b: TensorInfo, *, scale: float, fan_in_fan_out: bool,
                       rank: int, sign: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """The weight's metadata; checks that the adapter's shapes fit the weight and the configured rank."""
    if not _fits(weight, lora_a, lora_b, fan_in_fan_out):
        layout = " (fan_in_fan_out: the weight is stored [in, out])" if fan_in_fan_out else ""
        raise MapperError(
            f"Cannot merge LoRA into {weight.name!r} {list(weight.shape)}{layout}: lora_A is {list(lora_a.shape)} and lora_B "
            f"is {list(lora_b.shape)}. Check that the adapter belongs to this base model.", tensor=weight.name)
    if lora_a.shape[0] != rank:
        raise MapperError(
            f"Cannot merge LoRA into {weight.name!r}: its rank is {lora_a.shape[0]} ({lora_a.name}) but adapter_config.json "
            f"says r={rank} for this module (r / rank_pattern). The scaling would be wrong; fix the config.", tensor=weight.name)
    return [(weight.dtype, weight.shape)]


def infer_merge_dora(weight: TensorInfo, lora_a: TensorInfo, lora_b: TensorInfo, magnitude: TensorInfo, *, scale: float,
                     fan_in_fan_out: bool, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """As `infer_merge_linear`, and the magnitude vector has one entry per output row."""
    out = infer_merge_linear(weight, lora_a, lora_b, scale=scale, fan_in_fan_out=fan_in_fan_out, rank=rank)
    rows = weight.shape[1] if fan_in_fan_out else weight.shape[0]
    if tuple(magnitude.shape) != (rows,):
        raise MapperError(f"Cannot merge DoRA into {weight.name!r}: its magnitude vector is {list(magnitude.shape)}, expected "
                          f"[{rows}]. Check that the adapter belongs to this base model.", tensor=weight.name)
    return out


def infer_merge_bias(bias: TensorInfo, lora_bias: TensorInfo, *, scale: float, sign: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """The bias's metadata; the LoRA bias must have its shape."""
    if tuple(bias.shape) != tuple(lora_bias.shape):
        raise MapperError(f"Cannot merge the LoRA bias {lora_bias.name!r} {list(lora_bias.shape)} into {bias.name!r} "
                          f"{list(bias.shape)}. Check that the adapter belongs to this base model.", tensor=bias.name)
    return [(bias.dtype, bias.shape)]
