"""The few model facts presets need (head counts, head size, biases), read from any kind of config.

Accepts a path to `config.json` (or to the folder holding it), a transformers config object, or a
plain dict; reading a path never imports transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import MapperError
from ...formats.json_errors import json_problem

# Model families whose attention projections carry a bias although their config does not say so.
_QKV_BIAS_FAMILIES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl"})
# Model families that normalise each query and key head (RMSNorm over head_dim) before the rotary embedding.
_QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe"})


@dataclass(frozen=True)
class AttentionShape:
    """Attention geometry of a decoder: query heads, key/value heads, size of one head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    o_bias: bool = False  # the output projection has a bias (`attention_bias` models; not Qwen2)
    mlp_bias: bool = False  # gate/up/down projections have biases (`mlp_bias`)
    qk_norm: bool = False  # per-head q_norm / k_norm weights (Qwen3)

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _as_mapping(config: Any) -> Mapping[str, Any]:
    """The config's fields; also any plain object with attributes (a SimpleNamespace, say)."""
    if isinstance(config, (Mapping, str, os.PathLike)) or callable(getattr(config, "to_dict", None)):
        return read_config(config)
    return vars(config)


def attention_shape(config: Any) -> AttentionShape:
    """Read head counts and sizes from a config.json path, a transformers config, or a dict."""
    if isinstance(config, AttentionShape):
        return config
    data = _as_mapping(config)
    # Multimodal configs keep the decoder's facts in a text sub-config.
    if "num_attention_heads" not in data and isinstance(data.get("text_config"), Mapping):
        data = data["text_config"]

    def need(key: str) -> int:
        value = data.get(key)
        if not isinstance(value, int) or value <= 0:
            raise MapperError(
                f"Cannot read the attention shape from the config: {key!r} is missing or not a positive integer ({value!r}). "
                "Pass a config.json, a transformers config, or a dict with num_attention_heads, num_key_value_heads, "
                "head_dim (or hidden_size)."
            )
        return value

    heads = need("num_attention_heads")
    kv_heads = data.get("num_key_value_heads") or heads
    head_dim = data.get("head_dim") or need("hidden_size") // heads
    if heads % kv_heads:
        raise MapperError(
            f"Cannot use the config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}. Check the config."
        )
    attention_bias = bool(data.get("attention_bias", False))
    family = data.get("model_type")
    return AttentionShape(
        heads, kv_heads, head_dim,
        qkv_bias=attention_bias or family in _QKV_BIAS_FAMILIES,
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        o_bias=attention_bias,
        mlp_bias=bool(data.get("mlp_bias", False)),
        qk_norm=family in _QK_NORM_FAMILIES,
    )


def read_config(config: Any) -> dict[str, Any]:
    """config.json as a dict: a path (file or its folder), a mapping, or a transformers config; {} for None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return config if isinstance(config, dict) else dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise MapperError(f"Cannot read model config {str(path)!r}: the file does not exist. Pass the path of config.json.",
                              file=str(path)) from None
        except OSError as exc:
            raise MapperError(f"Cannot read model config {str(path)!r}: {exc}. Pass a valid config.json.", file=str(path)) from None
        except (ValueError, RecursionError) as exc:
            raise MapperError(f"Cannot read model config {str(path)!r}: it is not valid JSON ({json_problem(exc)}). "
                              "Pass a valid config.json.", file=str(path)) from None
        return data if isinstance(data, dict) else {}
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise MapperError(f"Cannot read a model config from {type(config).__name__}: pass a config.json path, a dict or a transformers config.")
