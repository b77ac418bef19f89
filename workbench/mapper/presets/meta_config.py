"""An HF Llama `config.json` (as a dict) for a Meta checkpoint, from its `params.json` and its tensors' shapes.

Meta's folders carry no config.json, which every HF-side preset (`meta_to_hf`, the GGUF output) reads, and which
an HF output needs to load (`planning.build` writes this one into it): the inverse of `output.pth.meta_params`. Sizes come from params.json (dim, n_layers, n_heads, n_kv_heads, norm_eps,
rope_theta, use_scaled_rope) and from the tensors where params.json does not say them exactly: the FFN width from
`w1`'s rows (Meta computes it from multiple_of / ffn_dim_multiplier), the vocabulary from `output.weight`'s rows
(Llama 2's params.json says -1). Model-parallel parts (`mp<r>/<name>`) are summed. The context length follows
transformers' Llama converter: 131072 with Llama 3.1's scaled RoPE, 8192 for rope_theta 500000, else 4096.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ...errors import MapperError

_MP = re.compile(r"mp(\d+)/(.+)")
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                  "rope_type": "llama3"}
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _rows(tensors: Mapping[str, Any], name: str) -> int | None:
    """Rows of `name`, or the sum of its model-parallel parts' rows."""
    if name in tensors:
        return int(tensors[name].shape[0])
    parts = [t for n, t in tensors.items() if (m := _MP.fullmatch(n)) and m.group(2) == name]
    return sum(int(t.shape[0]) for t in parts) if parts else None


def meta_params_of(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """params.json's values from a Meta catalog's metadata (`params.<key>`, JSON-encoded), or None for other sources."""
    found = {key.removeprefix("params."): value for key, value in metadata.items() if key.startswith("params.")}
    if "dim" not in found:
        return None
    try:
        return {key: json.loads(value) for key, value in found.items()}
    except ValueError:
        return None


def hf_config_from_meta(params: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The HF Llama config.json of a Meta checkpoint (see the module docstring)."""
    def size(key: str) -> int:
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MapperError(f"Cannot build config.json from params.json: {key} is {value!r}, not a positive integer. Fix params.json.")
        return value

    dim, heads = size("dim"), size("n_heads")
    kv_heads = params.get("n_kv_heads") or heads
    ffn = _rows(tensors, "layers.0.feed_forward.w1.weight")
    vocab = _rows(tensors, "output.weight") or _rows(tensors, "tok_embeddings.weight")
    if ffn is None or vocab is None:
        raise MapperError("Cannot build config.json from params.json: the checkpoint has no layers.0.feed_forward.w1.weight "
                          "or output.weight to size the FFN and vocabulary. Put the model's config.json beside it.")
    theta = float(params.get("rope_theta", 10000.0))
    scaled = bool(params.get("use_scaled_rope"))
    first = tensors.get("tok_embeddings.weight") or next((t for n, t in tensors.items() if n.endswith("/tok_embeddings.weight")), None)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": dim, "intermediate_size": ffn, "num_hidden_layers": size("n_layers"),
        "num_attention_heads": heads, "num_key_value_heads": int(kv_heads), "head_dim": dim // heads,
        "vocab_size": vocab, "rms_norm_eps": float(params.get("norm_eps", 1e-5)), "rope_theta": theta,
        "max_position_embeddings": 131072 if scaled else 8192 if theta == 500000.0 else 4096,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }
    if scaled:
        config["rope_scaling"] = dict(LLAMA3_SCALING)
    if first is not None and first.dtype in _DTYPES:
        config["torch_dtype"] = _DTYPES[first.dtype]
    return config
