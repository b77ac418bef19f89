"""Keeping a copied `config.json` truthful about the dtype of the weights it travels with.

transformers' `from_pretrained(dtype="auto")` loads in the dtype the config names (`dtype` since
transformers 5, `torch_dtype` before; multimodal configs repeat it in `text_config`, `vision_config`
...). A conversion that casts the weights rewrites those values, and only those: every other key and
its order stay as they were. Values that are not a floating-point dtype name (null, "auto") are left.
"""

from __future__ import annotations

import json
import os
from typing import Any

CONFIG_NAME = "config.json"
DTYPE_KEYS = ("dtype", "torch_dtype")
MAX_CONFIG_BYTES = 16 << 20  # configs are kilobytes; a bigger one is not parsed, only copied
MAX_DEPTH = 8
# The dtypes transformers computes in: what a dtype policy to these codes writes into the config.
CONFIG_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_FLOAT_NAMES = {"float16", "half", "bfloat16", "float32", "float", "float64", "double"}


def _is_float_name(value: Any) -> bool:
    return isinstance(value, str) and value.lower().removeprefix("torch.") in _FLOAT_NAMES


def _rewrite(node: dict, name: str, where: str, depth: int, changes: list[str]) -> None:
    for key, value in node.items():
        if key in DTYPE_KEYS and _is_float_name(value) and value != name:
            node[key] = name
            changes.append(f"{where}{key}: {value} -> {name}")
        elif isinstance(value, dict) and depth < MAX_DEPTH:
            _rewrite(value, name, f"{where}{key}.", depth + 1, changes)


KEEP = object()  # `quantization` argument: leave quantization_config as it is


def config_dtype_update(raw: bytes, name: str | None, quantization: Any = KEEP) -> tuple[bytes | None, list[str]]:
    """The config bytes with every float `dtype`/`torch_dtype` set to `name` (None: unchanged), and the changes made.

    `quantization`: a dict becomes the top-level `quantization_config` (weights quantised by the mapper),
    None removes it (weights dequantised), KEEP leaves it. Returns (None, []) when nothing changes or the
    bytes are not a JSON object (the config is then copied as it is).
    """
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None, []
    if not isinstance(data, dict):
        return None, []
    changes: list[str] = []
    if name is not None:
        _rewrite(data, name, "", 0, changes)
    if quantization is None and "quantization_config" in data:
        del data["quantization_config"]
        changes.append("quantization_config removed")
    elif isinstance(quantization, dict) and data.get("quantization_config") != quantization:
        data["quantization_config"] = quantization
        changes.append(f"quantization_config: {quantization.get('quant_method')} {quantization.get('weight_block_size')}")
    if not changes:
        return None, []
    # transformers writes configs with two-space indents and a final newline.
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8"), changes


def read_config(path: str | os.PathLike) -> bytes | None:
    """The bytes of a config file, or None when it cannot be read or is implausibly large."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None
    return raw if len(raw) <= MAX_CONFIG_BYTES else None


def config_dtypes(raw: bytes) -> list[str]:
    """The float dtype names a config states (top level and nested), for plan notes."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    found: list[str] = []

    def walk(node: Any, depth: int) -> None:
        if not isinstance(node, dict) or depth > MAX_DEPTH:
            return
        for key, value in node.items():
            if key in DTYPE_KEYS and _is_float_name(value):
                found.append(value)
            walk(value, depth + 1)

    walk(data, 0)
    return found
