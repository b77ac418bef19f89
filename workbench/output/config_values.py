"""config.json's model parameters read by type, for the writers that copy them into their outputs.

GGUF metadata and Meta's params.json hold a model's sizes and RoPE/norm constants taken from an untrusted
config.json. A value no model has (a size of 10^12, which GGUF's uint32 cannot hold; `rms_norm_eps: "x"`;
`rope_theta: NaN`; a rope_scaling that is a string) must be refused naming the file and key, never copied
into the output nor left to fail deep inside a packer. `ModelConfig` is config.json as a dict whose typed
getters (`size`, `count`, `real`, `rope`) check type, finiteness and range; `checked` applies them to every
key the writers and the GGUF preset read, once, before anything else uses the config.

Bounds: sizes (widths, counts of layers, heads, experts, context lengths) are whole numbers from 1 to
`MAX_SIZE` (2^31 - 1: GGUF stores them as uint32, llama.cpp reads several as int32); `vocab_size` at most
`MAX_VOCAB` (2^22, 16x the largest real vocabulary: the writers list one token per id).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import PlanError

MAX_SIZE = (1 << 31) - 1
MAX_VOCAB = 1 << 22
_REQUIRED = object()

# key -> kind: what `ModelConfig.checked` verifies when the key is present (and not null)
SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "max_position_embeddings", "original_max_position_embeddings", "head_dim", "moe_intermediate_size",
         "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# may be 0 (a dense model's expert count, no dense leading layers, no shared experts)
COUNTS = ("first_k_dense_replace", "n_shared_experts", "num_local_experts", "num_experts", "n_routed_experts",
          "num_experts_per_tok", "n_group", "topk_group")
POSITIVE_REALS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
# keys of the RoPE block: positive reals, finite reals, sizes
ROPE_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "rope_theta")
ROPE_FINITE = ("extrapolation_factor", "attention_factor", "attn_factor", "beta_fast", "beta_slow", "mscale_all_dim", "mscale")
ROPE_SIZES = ("original_max_position_embeddings",)
ROPE_KEYS = ("rope_parameters", "rope_scaling")


class ModelConfig(dict):
    """config.json's object (a dict, so code that only looks keys up takes it as it is) with typed getters that
    refuse, naming `path` and the key, a value no model has. `ModelConfig.of(config)` wraps a plain mapping."""

    def __init__(self, data: Mapping[str, Any], path: str | Path = "config.json") -> None:
        super().__init__(data)
        self.path = str(path)

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> ModelConfig:
        """`config` itself when it is a ModelConfig, else a ModelConfig of it."""
        return config if isinstance(config, ModelConfig) else cls(config)

    def _refuse(self, key: str, value: Any, problem: str) -> PlanError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return PlanError(f"Cannot use {self.path}: {key} is {shown}, {problem}. Fix the file (the model's own config.json "
                         "holds the values it was trained with).", file=self.path)

    def _value(self, key: str, default: Any, where: Mapping[str, Any] | None) -> tuple[bool, Any]:
        """(found, value): the value when present and not null, else (False, default); refused when required."""
        source = self if where is None else where
        value = source.get(key)
        if value is None:
            if default is _REQUIRED:
                raise PlanError(f"Cannot use {self.path}: it has no {key}, which the output needs. Use the model's own "
                                "config.json.", file=self.path)
            return False, default
        return True, value

    def size(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1, maximum: int = MAX_SIZE,
             where: Mapping[str, Any] | None = None, label: str | None = None) -> Any:
        """Whole number `key` within [minimum, maximum] (`default` when absent or null; required without one).
        `where`: a sub-object (the RoPE block) to read from, `label` its key as messages name it."""
        found, value = self._value(key, default, where)
        if not found:
            return value
        name = label or key
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._refuse(name, value, "not a whole number")
        if not minimum <= value <= maximum:
            raise self._refuse(name, value, f"outside {minimum}..{maximum}")
        return value

    def count(self, key: str, default: Any = _REQUIRED, **kwargs: Any) -> Any:
        """`size` that may be 0 (dense leading layers, shared experts)."""
        return self.size(key, default, minimum=0, **kwargs)

    def vocab(self, default: Any = None) -> Any:
        """vocab_size, at most MAX_VOCAB."""
        return self.size("vocab_size", default, maximum=MAX_VOCAB)

    def real(self, key: str, default: Any = _REQUIRED, *, positive: bool = True, below: float | None = None,
             where: Mapping[str, Any] | None = None, label: str | None = None) -> Any:
        """Finite number `key` as a float (positive unless `positive=False`, less than `below` when given)."""
        found, value = self._value(key, default, where)
        if not found:
            return value
        name = label or key
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._refuse(name, value, "not a number")
        value = float(value)
        if not math.isfinite(value):
            raise self._refuse(name, value, "not finite")
        if positive and value <= 0:
            raise self._refuse(name, value, "not positive")
        if below is not None and value >= below:
            raise self._refuse(name, value, f"not below {below}")
        return value

    def rope(self) -> dict[str, Any]:
        """The RoPE block (transformers v5 `rope_parameters`, or `rope_scaling`; its `full_attention` part when
        split per layer type), refused unless it is an object whose values are of their kinds; {} when absent."""
        blocks = [self._rope_block(key) for key in ROPE_KEYS if self.get(key)]  # each one present is checked
        return blocks[0] if blocks else {}

    def _rope_block(self, key: str) -> dict[str, Any]:
        rope = self[key]
        if not isinstance(rope, dict):
            raise self._refuse(key, rope, "not an object")
        if "full_attention" in rope:
            key, rope = f"{key}.full_attention", rope["full_attention"]
            if not isinstance(rope, dict):
                raise self._refuse(key, rope, "not an object")
        kind = rope.get("rope_type", rope.get("type"))
        if kind is not None and not isinstance(kind, str):
            raise self._refuse(f"{key}.rope_type", kind, "not a name")
        for name in ROPE_POSITIVE:
            self.real(name, None, where=rope, label=f"{key}.{name}")
        for name in ROPE_FINITE:
            self.real(name, None, positive=False, where=rope, label=f"{key}.{name}")
        for name in ROPE_SIZES:
            self.size(name, None, where=rope, label=f"{key}.{name}")
        return rope

    def checked(self) -> ModelConfig:
        """Itself, after every key the writers and the GGUF preset read has been checked by its getter."""
        for key in SIZES:
            self.size(key, None)
        for key in COUNTS:
            self.count(key, None)
        self.vocab()
        self.real("rms_norm_eps", None, below=1.0)
        for key in POSITIVE_REALS:
            self.real(key, None)
        self.rope()
        return self


__all__ = ["MAX_SIZE", "MAX_VOCAB", "ModelConfig"]
