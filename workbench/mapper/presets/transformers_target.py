"""A target from a transformers config: what a model of that type holds, built on the meta device.

The target check (`workbench.mapper.target`) compares a mapper's outputs with any target; this preset knows
transformers' registry, so that a config.json (or a bare model type such as 'llama') can stand for the
model it describes. The MapperBuilder's Target box uses it.
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import MapperError
from ..target import Target, resolve_target
from .model_shape import read_config


def config_target(config: Any = None, model_type: str | None = None) -> Target:
    """What a transformers model built from `config` (a config.json path or folder, a dict or a config
    object) holds, built on the meta device (no memory, no weights). `model_type` (e.g. 'llama') builds
    that type instead, with the config's sizes when a config is given and transformers' defaults otherwise.
    Raises MapperError when transformers (or torch) is missing or does not know the model type."""
    data = dict(read_config(config))
    if model_type:
        data["model_type"] = model_type
        data.pop("architectures", None)  # the given config's classes are of another type
    kind = data.pop("model_type", None)
    where = f"model type {kind!r}" if model_type or config is None else f"config {config if isinstance(config, (str, os.PathLike)) else kind!s}"
    if not kind:
        raise MapperError(f"Cannot build a target from {where}: it has no model_type. Pass a config.json of a transformers model.")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise MapperError(f"Cannot build a target from {where}: {exc.name} is not installed. Install transformers and torch, "
                          "or pass a target checkpoint.") from None
    from transformers import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(kind, list(CONFIG_MAPPING.keys()), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else " Check the spelling (e.g. 'llama', 'qwen2')."
        raise MapperError(f"Cannot build a target from {where}: transformers {transformers.__version__} knows no model type {kind!r}.{hint}")
    try:
        built = transformers.AutoConfig.for_model(kind, **data)
    except (ValueError, KeyError, TypeError) as exc:
        raise MapperError(f"Cannot build a target from {where}: {exc}. Pass a config.json of that model type.") from None
    architectures = getattr(built, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    try:
        with torch.device("meta"):
            model = model_class(built) if model_class is not None else transformers.AutoModelForCausalLM.from_config(built)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MapperError(f"Cannot build a target model from {where}: {exc}. Pass a target checkpoint instead.") from None
    resolved = resolve_target(model)
    return Target(f"{type(model).__name__} from {where}", resolved.noun, resolved.tensors)
