"""Mapper presets output formats build on (see `OutputFormat.prepare`), and Meta's model-parallel split.

`OUTPUT_PRESETS` maps an output format's name to the preset its `prepare` receives from the planner: GGUF
builds llama.cpp's layout on `gguf_preset.hf_to_gguf`, Meta `.pth` uses the HF -> Meta rename by default.
"""

from __future__ import annotations

from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError
from ..base import Mapper
from .model_shape import attention_shape

# The planner imports this module for every conversion; the presets, ops and the GGUF layout it refers to are
# imported when a pth or GGUF output uses them (a safetensors conversion does not).

# Meta's model-parallel layers (fairscale): column-parallel weights split their rows (dim 0), row-parallel ones
# their columns (dim 1); column-parallel biases split with their rows, row-parallel biases and norms are
# replicated in every file. The embedding splits its columns (Llama 2's ParallelEmbedding) or its rows
# (Llama 3's VocabParallelEmbedding), see `embedding_split_dim`.
_MP_SPLIT = (
    ("output.weight", 0),
    ("layers.{i}.attention.wq.weight", 0), ("layers.{i}.attention.wk.weight", 0), ("layers.{i}.attention.wv.weight", 0),
    ("layers.{i}.attention.wo.weight", 1), ("layers.{i}.feed_forward.w1.weight", 0),
    ("layers.{i}.feed_forward.w3.weight", 0), ("layers.{i}.feed_forward.w2.weight", 1),
)
_MP_SPLIT_BIASES = (("layers.{i}.attention.wq.bias", 0), ("layers.{i}.attention.wk.bias", 0), ("layers.{i}.attention.wv.bias", 0))
_MP_MLP_BIASES = (("layers.{i}.feed_forward.w1.bias", 0), ("layers.{i}.feed_forward.w3.bias", 0))
_MP_REPLICATED = ("norm.weight", "layers.{i}.attention_norm.weight", "layers.{i}.ffn_norm.weight")
LLAMA3_VOCAB = 128000  # Llama 3's tokenizer has 128,256 entries; Llama 2's 32,000


def replicate(tensor: Any, *, n: int) -> list[Any]:
    """`n` copies of `tensor` (one per model-parallel file)."""
    return [tensor.clone() for _ in range(n)]


def infer_replicate(tensor: TensorInfo, *, n: int) -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `replicate`."""
    return [(tensor.dtype, tuple(tensor.shape))] * n


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def embedding_split_dim(config: Any) -> int:
    """The dim Meta's code splits `tok_embeddings` along: 0 (rows, Llama 3's VocabParallelEmbedding) for a
    Llama-3-size vocabulary, else 1 (columns, Llama 2's ParallelEmbedding)."""
    return 0 if int(_get(config, "vocab_size") or 0) >= LLAMA3_VOCAB else 1


def _check_divisible(config: Any, nproc_mp: int, embedding_dim: int) -> None:
    shape = attention_shape(config)
    sizes = {"num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
             "intermediate_size": _get(config, "intermediate_size")}
    if embedding_dim == 1:
        sizes["hidden_size"] = _get(config, "hidden_size")
    sizes["vocab_size"] = _get(config, "vocab_size")  # output.weight splits its rows, tied or not (`layouts.tied_output`)
    for key, size in sizes.items():
        if size is not None and int(size) % nproc_mp:
            raise MapperError(f"Cannot split the Meta layout {nproc_mp} ways: {key} ({size}) is not a multiple of {nproc_mp}, "
                              "and Meta's model-parallel layers give every rank an equal part. Choose an nproc_mp that divides it.")


def meta_mp_split(config: Any, nproc_mp: int, embedding_dim: int | None = None) -> Mapper:
    """Meta-layout tensors -> Meta's `nproc_mp` model-parallel parts, named `mp<r>/<meta name>` (the `.pth` output
    puts them in `consolidated.<r>.pth` under `<meta name>`). `embedding_dim`: see `embedding_split_dim` (default)."""
    if isinstance(nproc_mp, bool) or not isinstance(nproc_mp, int) or nproc_mp < 1:
        raise MapperError(f"Cannot split the Meta layout with nproc_mp={nproc_mp!r}: give a whole number of files, at least 1.")
    shape = attention_shape(config)
    embedding_dim = embedding_split_dim(config) if embedding_dim is None else embedding_dim
    _check_divisible(config, nproc_mp, embedding_dim)
    split = [("tok_embeddings.weight", embedding_dim), *_MP_SPLIT]
    replicated = list(_MP_REPLICATED)
    if shape.qkv_bias:
        split += _MP_SPLIT_BIASES
    if shape.o_bias:
        replicated.append("layers.{i}.attention.wo.bias")
    if shape.mlp_bias:
        split += _MP_MLP_BIASES
        replicated.append("layers.{i}.feed_forward.w2.bias")
    if shape.qk_norm:
        replicated += ["layers.{i}.attention.q_norm.weight", "layers.{i}.attention.k_norm.weight"]
    from ..compose import Parallel
    from ..function import Function
    from ..ops import Split

    parts: list[Mapper] = [Split(name, [f"mp{r}/{name}" for r in range(nproc_mp)], dim=dim) for name, dim in split]
    parts += [Function("workbench.mapper.presets.output_presets:replicate", (name,), tuple(f"mp{r}/{name}" for r in range(nproc_mp)),
                       infer="workbench.mapper.presets.output_presets:infer_replicate", params=(("n", nproc_mp),))
              for name in replicated]
    return Parallel(*parts)


def hf_to_meta_pth(config: Any) -> Mapper:
    """HF Llama -> Meta's whole layout: `presets.hf_to_meta`, which writes `output.weight` for tied embeddings itself
    (`layouts.tied_output`)."""
    from .layouts import hf_to_meta

    return hf_to_meta(config)


def hf_to_meta_mp(config: Any, nproc_mp: int, embedding_dim: int | None = None) -> Mapper:
    """HF Llama -> Meta's `consolidated.NN.pth` layout split over `nproc_mp` model-parallel files (see `meta_mp_split`)."""
    from ..compose import Sequential

    return Sequential(hf_to_meta_pth(config), meta_mp_split(config, nproc_mp, embedding_dim))


def meta_pth(config: Any, nproc_mp: int = 1, before: Mapper | None = None) -> Mapper:
    """The `.pth` output's preset: HF -> Meta's layout (`hf_to_meta_pth`; `before`, a user mapper producing Meta names,
    replaces it), split over `nproc_mp` model-parallel files when it is above 1."""
    from ..compose import Sequential

    first = hf_to_meta_pth(config) if before is None else before
    return first if nproc_mp == 1 else Sequential(first, meta_mp_split(config, nproc_mp))


def meta_layout(config: Any, nproc_mp: int = 1) -> dict[str, tuple[int, ...]]:
    """Every tensor of Meta's checkpoint for `config` and its shape, as Meta's `Transformer` (llama/model.py) declares its
    parameters, from config.json's sizes alone (not from the ops that write them): the statement the `.pth` output is
    verified against. Over `nproc_mp` files: `mp<r>/<name>`, each file's part (fairscale's split dims), norms and
    row-parallel biases whole in every file."""
    shape = attention_shape(config)
    dim, vocab = int(_get(config, "hidden_size")), int(_get(config, "vocab_size"))
    inter, layers = int(_get(config, "intermediate_size")), int(_get(config, "num_hidden_layers"))
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    whole: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, dim), "norm.weight": (dim,), "output.weight": (vocab, dim)}
    for i in range(layers):
        attention, ff = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        whole.update({f"layers.{i}.attention_norm.weight": (dim,), f"layers.{i}.ffn_norm.weight": (dim,),
                      attention + "wq.weight": (q_rows, dim), attention + "wk.weight": (kv_rows, dim),
                      attention + "wv.weight": (kv_rows, dim), attention + "wo.weight": (dim, q_rows),
                      ff + "w1.weight": (inter, dim), ff + "w3.weight": (inter, dim), ff + "w2.weight": (dim, inter)})
        if shape.qkv_bias:
            whole.update({attention + "wq.bias": (q_rows,), attention + "wk.bias": (kv_rows,), attention + "wv.bias": (kv_rows,)})
        if shape.o_bias:
            whole[attention + "wo.bias"] = (dim,)
        if shape.mlp_bias:
            whole.update({ff + "w1.bias": (inter,), ff + "w3.bias": (inter,), ff + "w2.bias": (dim,)})
        if shape.qk_norm:
            whole.update({attention + "q_norm.weight": (shape.head_dim,), attention + "k_norm.weight": (shape.head_dim,)})
    if nproc_mp == 1:
        return whole
    split = {"tok_embeddings.weight": embedding_split_dim(config), "output.weight": 0}
    for name in whole:
        for suffix in ("wq.weight", "wk.weight", "wv.weight", "wq.bias", "wk.bias", "wv.bias", "w1.weight", "w3.weight",
                       "w1.bias", "w3.bias"):
            if name.endswith("." + suffix):
                split[name] = 0
        if name.endswith((".wo.weight", ".w2.weight")):
            split[name] = 1
    parts: dict[str, tuple[int, ...]] = {}
    for r in range(nproc_mp):
        for name, size in whole.items():
            dim_of = split.get(name)
            part = size if dim_of is None else tuple(n // nproc_mp if d == dim_of else n for d, n in enumerate(size))
            parts[f"mp{r}/{name}"] = part
    return parts


class MetaPthPreset:
    """The `.pth` output's preset (`meta_pth`, called as it is), with `layout` (`meta_layout`): what Meta's model
    declares, for the output to be verified against."""

    def __call__(self, config: Any, nproc_mp: int = 1, before: Mapper | None = None) -> Mapper:
        return meta_pth(config, nproc_mp, before)

    @staticmethod
    def layout(config: Any, nproc_mp: int = 1) -> dict[str, tuple[int, ...]]:
        return meta_layout(config, nproc_mp)


def hf_to_gguf(*args: Any, **kwargs: Any) -> Any:
    """`gguf_preset.hf_to_gguf` (imported on first use)."""
    from .gguf_preset import hf_to_gguf as build

    return build(*args, **kwargs)


OUTPUT_PRESETS = {"gguf": hf_to_gguf, "pth": MetaPthPreset()}


__all__ = ["LLAMA3_VOCAB", "OUTPUT_PRESETS", "MetaPthPreset", "embedding_split_dim", "hf_to_meta_mp", "hf_to_meta_pth", "infer_replicate",
           "meta_layout", "meta_mp_split", "meta_pth", "replicate"]
