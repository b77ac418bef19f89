"""Mapper presets output formats build on (see `OutputFormat.prepare`), and Meta's model-parallel split.

`OUTPUT_PRESETS` maps an output format's name to the preset its `prepare` receives from the planner: GGUF
builds llama.cpp's layout on `gguf_preset.hf_to_gguf`, Meta `.pth` uses the HF -> Meta rename by default.
"""

from __future__ import annotations

from typing import Any

from ..catalog import TensorInfo
from .base import Mapper
from .compose import Parallel, Sequential
from .function import Function
from .gguf_preset import hf_to_gguf
from .model_shape import attention_shape
from .ops import Split
from .presets import hf_to_meta

OUTPUT_PRESETS = {"gguf": hf_to_gguf, "pth": hf_to_meta}

# Meta's model-parallel layers: column-parallel weights split their rows (dim 0), row-parallel ones their
# columns (dim 1), the embedding its columns (ParallelEmbedding); norms are replicated in every file.
_MP_DIMS = (
    ("tok_embeddings.weight", 1), ("output.weight", 0),
    ("layers.{i}.attention.wq.weight", 0), ("layers.{i}.attention.wk.weight", 0), ("layers.{i}.attention.wv.weight", 0),
    ("layers.{i}.attention.wo.weight", 1), ("layers.{i}.feed_forward.w1.weight", 0),
    ("layers.{i}.feed_forward.w3.weight", 0), ("layers.{i}.feed_forward.w2.weight", 1),
)
_MP_REPLICATED = ("norm.weight", "layers.{i}.attention_norm.weight", "layers.{i}.ffn_norm.weight")


def replicate(tensor: Any, *, n: int) -> list[Any]:
    """`n` copies of `tensor` (one per model-parallel file)."""
    return [tensor.clone() for _ in range(n)]


def infer_replicate(tensor: TensorInfo, *, n: int) -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `replicate`."""
    return [(tensor.dtype, tuple(tensor.shape))] * n


def hf_to_meta_mp(config: Any, nproc_mp: int) -> Mapper:
    """HF Llama -> Meta's `consolidated.NN.pth` layout split over `nproc_mp` model-parallel files: outputs are
    named `mp<r>/<meta name>` (the `.pth` output puts them in `consolidated.<r>.pth` under `<meta name>`)."""
    shape = attention_shape(config)
    names = [n for n, _ in _MP_DIMS if not (n == "output.weight" and shape.tie_word_embeddings)]
    dims = dict(_MP_DIMS)
    parts = [Split(name, [f"mp{r}/{name}" for r in range(nproc_mp)], dim=dims[name]) for name in names]
    parts += [Function("workbench.mapper.output_presets:replicate", (name,), tuple(f"mp{r}/{name}" for r in range(nproc_mp)),
                       infer="workbench.mapper.output_presets:infer_replicate", params=(("n", nproc_mp),))
              for name in _MP_REPLICATED]
    return Sequential(hf_to_meta(config), Parallel(*parts))


__all__ = ["OUTPUT_PRESETS", "hf_to_meta_mp", "infer_replicate", "replicate"]
