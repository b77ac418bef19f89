"""What transformers declares a checkpoint of a config must hold: the statement an HF output is verified against.

A conversion's output check proves the files hold what the plan's ops make; a mapper that drops or misnames a tensor
plans, writes and re-reads "all match". transformers itself says what a model folder must hold: the model of the
output's config.json, built on the meta device (no memory), declares every parameter and persistent buffer with its
shape. Two layouts are stated, as transformers 5 has them: the names it writes on save (its reverse conversion of the
model's state dict: per-expert tensors of a MoE) and the names it holds in memory (`presets.from_transformers`'
output); the output is compared with the nearer one. A head tied to the embedding (`tie_word_embeddings`) and
buffers the model rebuilds may be absent; float tensors may have any float dtype (the dtype policy's), other tensors
must have the model's. Nothing here touches the files: `declared_layouts` reads the config only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import MapperError

Declared = dict[str, tuple[str | None, tuple[int, ...]]]


def declared_layouts(config: Mapping[str, Any]) -> tuple[str, list[tuple[str, Declared]], frozenset[str]]:
    """(family, [(layout name, {tensor: (dtype code or None for any float, shape)})], names that may be absent) for
    the model transformers builds from `config` (config.json's contents). MapperError says why it cannot: transformers
    is not installed, the config names no model_type or one transformers does not know, no model class builds."""
    try:
        import transformers  # noqa: F401
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError as exc:
        raise MapperError(f"transformers 5 is not installed ({exc.name or exc})") from None
    from ...dtypes import from_torch, is_float
    from .transformers_layout import load_config, meta_model

    model_type = config.get("model_type") if isinstance(config, Mapping) else None
    if not isinstance(model_type, str) or not model_type:
        raise MapperError("config.json names no model_type")
    if config.get("auto_map"):
        raise MapperError(f"config.json maps {model_type!r} to its own code (auto_map), which is never run")
    model = meta_model(load_config(dict(config)))
    memory = model.state_dict()
    try:
        saved = revert_weight_conversion(model, dict(memory))
    except Exception as exc:  # noqa: BLE001 - transformers' own conversion code, on meta tensors
        raise MapperError(f"transformers could not state its saved layout for {model_type!r} ({exc})") from None

    def declared(tensors: Mapping[str, Any]) -> Declared:
        out: Declared = {}
        for name, tensor in tensors.items():
            code = from_torch(tensor.dtype)
            out[name] = (None if is_float(code) else code, tuple(tensor.shape))
        return out

    layouts = [("checkpoint layout", declared(saved))]
    if set(saved) != set(memory):
        layouts.append(("in-memory layout", declared(memory)))
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    optional = frozenset(tied) | frozenset(name for name, _ in model.named_buffers())
    return f"transformers {type(model).__name__} ({model_type})", layouts, optional


__all__ = ["Declared", "declared_layouts"]
