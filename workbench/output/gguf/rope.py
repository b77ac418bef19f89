"""Tensors llama.cpp's converter generates from config.json rather than reads: Llama 3.1+'s `rope_freqs.weight`.

Llama 3.1 / 3.2 / 3.3 scale RoPE by frequency band (`rope_type: llama3`): llama.cpp reads the per-frequency
factors from a tensor, `rope_freqs.weight` (F32, head_dim / 2 values), which `convert_hf_to_gguf.py` computes
from the config and writes first, before any model tensor; it writes no rope-scaling keys for this type. The
tensor is tiny and known when the plan is made, so the GGUF layout carries its bytes with the header
(`output.gguf.container.layout_gguf_file`), and `--verify` computes them again (`GeneratedTensor.compute`).

The factors are computed with numpy in float32, one operation at a time in the order the converter's torch code
performs them (float32 tensors against Python numbers, which torch rounds to float32 first), so that the bytes are
the converter's; see `llama3_rope_factors` for the one place where they can differ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import PlanError
from ..config_values import ModelConfig

ROPE_FREQS = "rope_freqs.weight"
# The config keys llama.cpp's converter looks RoPE's base up by, when the rope block does not name it (its order).
_THETA_KEYS = ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base")


@dataclass(frozen=True)
class GeneratedTensor:
    """A GGUF tensor with no source tensor, computed from config.json: its name, GGUF type, shape, what it is
    made from (for plans) and the parameters `compute` makes its bytes from."""

    name: str
    type: str
    shape: tuple[int, ...]
    origin: str  # e.g. "config.json rope_scaling (llama3)"
    params: tuple[tuple[str, float], ...]  # keyword arguments of llama3_rope_factors
    data: bytes  # its bytes, computed when planned

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def compute(self) -> bytes:
        """Its bytes computed again from the parameters (what `--verify` compares the written bytes with)."""
        return llama3_rope_factors(**dict(self.params)).tobytes()


def rope_block(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's RoPE block (transformers v5 `rope_parameters`, or `rope_scaling`), its full-attention part."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    return rope if isinstance(rope, dict) else {}


def rope_type(rope: Mapping[str, Any]) -> str | None:
    """The RoPE scaling type a rope block names (`rope_type`, or the older `type`), lower case as llama.cpp compares it."""
    kind = rope.get("rope_type", rope.get("type"))
    return str(kind).lower() if kind is not None else None


def llama3_rope_factors(*, head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_context: float) -> Any:
    """Llama 3's per-frequency RoPE factors as llama.cpp's converter computes them: a float32 numpy array of
    head_dim / 2 values, 1 for high frequencies (wavelength below original_context / high_freq_factor), `factor`
    for low ones (above original_context / low_freq_factor), and a smooth blend between.

    Every step is one float32 operation, as torch performs the converter's expression: Python numbers are rounded
    to float32 first, `a / tensor` is `reciprocal(tensor) * a` (torch's reflected division), comparisons are made in
    float32. The power `theta ** (k / head_dim)` is computed in float64 and rounded once to float32, which is the
    correctly rounded float32 power: torch's scalar `powf` and its non-SIMD CPU build give the same, and so does
    numpy's float32 `power` on glibc, but not on every libm, hence float64. torch's AVX2 / AVX-512 kernel (SLEEF's
    `powf`, within 1 ulp) rounds a power lying within ~0.02 ulp of a half-way point the other way: in a grid of head
    dims 16-256 and thetas 1e4-1e6, 7 of 32 (dim, theta) pairs had one such frequency (none for Llama 3's own
    64 / 128 with 500000), and 2 of 128 factor sets then differed in one value by one ulp. The converter's bytes
    depend on the machine's SIMD there; these are the correctly rounded ones.
    """
    import numpy as np

    f32 = np.float32
    exponents = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    powers = np.power(np.float64(theta), exponents.astype(np.float64)).astype(f32)
    freqs = f32(1.0) / powers
    wavelen = (f32(1.0) / freqs) * f32(2 * math.pi)
    smooth = ((f32(1.0) / wavelen) * f32(original_context) - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
    with np.errstate(divide="ignore", invalid="ignore"):  # equal band edges (Llama 4) leave no value in between
        blended = f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth)
    high_edge, low_edge = f32(original_context / high_freq_factor), f32(original_context / low_freq_factor)
    out = np.where(wavelen < high_edge, f32(1.0), np.where(wavelen > low_edge, f32(factor), blended))
    return out.astype(f32)


def generated_tensors(config: Mapping[str, Any], arch: str) -> tuple[GeneratedTensor, ...]:
    """The tensors llama.cpp's converter generates for this config and architecture (its Llama converter, which also
    converts Mistral and Mixtral: `rope_freqs.weight` for `llama3` RoPE scaling); PlanError when the converter of
    `arch` would drop the scaling instead."""
    rope = rope_block(config)
    if rope_type(rope) != "llama3":
        return ()
    if arch != "llama":
        raise PlanError(f"Cannot write GGUF: config.json asks for Llama 3's RoPE scaling (rope_type 'llama3') in a llama.cpp "
                        f"{arch!r} model, whose converter has no rope_freqs tensor for it. Remove the scaling from config.json "
                        "or convert with llama.cpp's convert_hf_to_gguf.py.")
    values = ModelConfig.of(config)
    rope = values.rope()  # the same block, its values checked (finite, positive, sizes in range)
    heads = values.size("num_attention_heads")
    head_dim = values.size("head_dim", 0) or values.size("hidden_size") // heads
    theta = rope.get("rope_theta")
    if theta is None and "full_attention" not in (config.get("rope_parameters") or config.get("rope_scaling") or {}):
        key = next((k for k in _THETA_KEYS if config.get(k) is not None), None)
        theta = values.real(key) if key is not None else None
    original = rope.get("original_max_position_embeddings", values.size("original_max_position_embeddings", None))
    params = (("head_dim", head_dim), ("theta", float(10000.0 if theta is None else theta)),
              ("factor", float(rope.get("factor", 8.0))), ("low_freq_factor", float(rope.get("low_freq_factor", 1.0))),
              ("high_freq_factor", float(rope.get("high_freq_factor", 4.0))),
              ("original_context", float(8192 if original is None else original)))
    if head_dim < 1:
        raise PlanError(f"Cannot write GGUF: Llama 3's RoPE factors need a positive head_dim, not {head_dim}. Check config.json.")
    data = llama3_rope_factors(**dict(params)).tobytes()  # one value per even index below head_dim
    return (GeneratedTensor(ROPE_FREQS, "F32", ((head_dim + 1) // 2,), "config.json RoPE scaling (llama3)", params, data),)


__all__ = ["ROPE_FREQS", "GeneratedTensor", "generated_tensors", "llama3_rope_factors", "rope_block", "rope_type"]
