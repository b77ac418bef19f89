"""HF Llama-family names -> llama.cpp GGUF names, with llama.cpp's Q/K row permutation and its type policy.

The names, the permutation (Llama and Mistral store q/k rows per head as [first halves, second halves];
llama.cpp interleaves them, like Meta's layout) and the per-tensor types are the facts llama.cpp's
`convert_hf_to_gguf.py` applies; they are restated here as a workbench mapper so the planner can show
and schedule them. A tensor whose type changes (a cast, Q8_0 / Q4_0 blocks, with the permutation or the stacking of
experts) is one `gguf_rows.to_gguf` op, which the engine runs a few rows at a time with numpy alone; quantised
tensors arrive as their GGUF bytes, a U8 tensor of shape (rows, blocks * 34) or (rows, blocks * 18). Tensors kept
in their dtype are renamed, stacked or permuted as byte copies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError
from ..base import Mapper
from ..claim import Claim
from ..compose import Parallel, Sequential
from ..function import Function
from ..ops import Cast, Drop, Rename, Reshape, Split, Stack, Transpose
from .gguf_fp8 import DEQUANTIZE_FN, SCALE_SUFFIX, dequantized, fp8_block
from .gguf_rows import QUANTIZED, SOURCE_TYPES, gguf_function  # QUANTIZED: (elements, bytes) per block

LAYERS = "model.layers.{i}"
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
Q8_BLOCK, Q8_BYTES = 32, 34  # elements per Q8_0 block, bytes per block (an f16 scale + 32 int8)

# llama.cpp's architecture name per HF model_type, and whether it permutes q/k rows.
ARCHITECTURES = {"llama": ("llama", True), "mistral": ("llama", True), "mixtral": ("llama", True), "qwen2": ("qwen2", False),
                 "qwen3": ("qwen3", False), "qwen2_moe": ("qwen2moe", False), "qwen3_moe": ("qwen3moe", False),
                 "olmoe": ("olmoe", False), "deepseek_v3": ("deepseek2", False)}
# MoE experts as transformers saves them (one tensor per expert): llama.cpp stacks each layer's experts into one
# (experts, rows, columns) tensor per projection, in the order each converter emits them.
_EXPERTS = {
    "mixtral": (re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight"),
                (("w1", "ffn_gate_exps.weight"), ("w2", "ffn_down_exps.weight"), ("w3", "ffn_up_exps.weight"))),
    "qwen2_moe": (re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight"),
                  (("down_proj", "ffn_down_exps.weight"), ("gate_proj", "ffn_gate_exps.weight"), ("up_proj", "ffn_up_exps.weight"))),
}
_EXPERTS["qwen3_moe"] = _EXPERTS["qwen2_moe"]  # llama.cpp converts Qwen3-MoE with its Qwen2-MoE converter
_EXPERTS["olmoe"] = _EXPERTS["qwen2_moe"]  # and stacks OLMoE's experts the same way
_EXPERTS["deepseek_v3"] = _EXPERTS["qwen2_moe"]  # as does its DeepSeek-V2 converter (V3 too)
_F32_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # MoE routers: llama.cpp keeps them F32

# HF modules -> llama.cpp's: like the converter's tensor map, a module's `.weight` and `.bias` both map, keeping the suffix
# (a Llama with `attention_bias` / `mlp_bias`, Qwen2's q/k/v biases).
_TOP = (("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"), ("lm_head", "output"))
_LAYER = (
    ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
    ("block_sparse_moe.gate", "ffn_gate_inp"), ("mlp.gate", "ffn_gate_inp"),
    ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"), ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
    ("mlp.shared_expert.down_proj", "ffn_down_shexp"), ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
    # DeepSeek's multi-head latent attention (MLA) and its shared experts
    ("self_attn.q_a_proj", "attn_q_a"), ("self_attn.q_a_layernorm", "attn_q_a_norm"), ("self_attn.q_b_proj", "attn_q_b"),
    ("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("self_attn.kv_a_layernorm", "attn_kv_a_norm"),
    ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"), ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
    ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
)
_SUFFIXES = ("weight", "bias")
_LAYER_TENSORS = {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}  # DeepSeek's router bias (a tensor, not a module's)
# Tensors llama.cpp's converter reads and leaves out (its `prepare_tensors` skips these endings): dropped on purpose.
SKIPPED_ENDINGS = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
_CLAIM_HINT = ("llama.cpp's converter has no GGUF name for them either (it stops with 'Can not map tensor'). Drop them with a "
               "mapper given ahead of the preset (M.Drop(name), --mapper) if the model does not need them, or convert with "
               "llama.cpp's convert_hf_to_gguf.py.")
_PERMUTED = {"attn_q": "q", "attn_k": "k"}  # GGUF modules whose rows (weight and bias) llama.cpp permutes per head
_KV_B = "self_attn.kv_b_proj.weight"  # MLA's joint K/V up-projection: llama.cpp splits it per head into k_b (transposed), v_b


def gguf_name(hf: str) -> str | None:
    """The GGUF name of an HF tensor name, or None when llama.cpp has no place for it."""
    module, _, suffix = hf.rpartition(".")
    if suffix in _SUFFIXES:
        for src, dst in _TOP:
            if module == src:
                return f"{dst}.{suffix}"
    parts = hf.split(".")
    if len(parts) > 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdecimal():
        rest = ".".join(parts[3:])
        if rest in _LAYER_TENSORS:
            return f"blk.{parts[2]}.{_LAYER_TENSORS[rest]}"
        module = ".".join(parts[3:-1])
        if parts[-1] in _SUFFIXES:
            for src, dst in _LAYER:
                if module == src:
                    return f"blk.{parts[2]}.{dst}.{parts[-1]}"
    return None


def permuted_heads(out: str, heads: int, kv_heads: int) -> int:
    """Heads of llama.cpp's q/k row permutation for GGUF tensor `out` (its weight or its bias) of a permuting
    architecture: `heads` for attn_q, `kv_heads` for attn_k, 0 for any other tensor."""
    parts = out.split(".")
    kind = _PERMUTED.get(parts[-2]) if len(parts) >= 2 else None
    return heads if kind == "q" else kv_heads if kind == "k" else 0


def gguf_type(name: str, shape: tuple[int, ...], wanted: str) -> str:
    """llama.cpp's type for one output tensor: vectors, norms and anything but a `.weight` (biases) stay F32; a
    block-quantised type needs rows of whole blocks (else F16, as the converter falls back)."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith(_F32_MATRICES) or not name.endswith(".weight"):
        return "F32"
    if wanted in QUANTIZED and shape[-1] % QUANTIZED[wanted][0]:
        return "F16"
    return wanted


def quantized_shape(shape: tuple[int, ...], kind: str = "Q8_0") -> tuple[int, ...]:
    """Byte shape of a `kind` (Q8_0, Q4_0) tensor of logical `shape`."""
    block, size = QUANTIZED[kind]
    return (*shape[:-1], shape[-1] // block * size)


def q8_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Byte shape of a Q8_0 tensor of logical `shape`."""
    return quantized_shape(shape, "Q8_0")


QUANTIZE_CHUNK = 1 << 22  # elements quantised at a time: the float32 copy and the quantiser's scratch stay ~100 MB


def quantize(tensor: Any, *, kind: str = "Q8_0") -> Any:
    """`kind` (Q8_0, Q4_0) bytes of `tensor`, computed in float32 by the `gguf` package's own quantiser, as a U8 tensor.
    Blocks lie within rows, so rows are quantised a chunk at a time (a 2 GB embedding never becomes 4 GB of float32)."""
    import gguf
    import numpy as np
    import torch

    kind_id = gguf.GGMLQuantizationType[kind]
    shape = tuple(tensor.shape)
    rows = tensor.detach().reshape(-1, shape[-1]) if shape else tensor.detach().reshape(1, 1)
    out = np.empty(quantized_shape((rows.shape[0], rows.shape[1]), kind), dtype=np.uint8)
    step = max(1, QUANTIZE_CHUNK // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step].to(torch.float32).contiguous().numpy()
        out[start:start + step] = gguf.quants.quantize(chunk, kind_id)
    return torch.from_numpy(out.reshape(quantized_shape(shape, kind)))


def infer_quantize(tensor: TensorInfo, *, kind: str = "Q8_0") -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `quantize`."""
    block = QUANTIZED[kind][0]
    if not tensor.shape or tensor.shape[-1] % block:
        raise MapperError(f"Cannot quantise {tensor.name!r} {list(tensor.shape)} to {kind}: its rows are not whole blocks of "
                          f"{block}. Keep it F16.", tensor=tensor.name)
    return [("U8", quantized_shape(tuple(tensor.shape), kind))]


def quantize_q8_0(tensor: Any) -> Any:
    """Q8_0 bytes of `tensor` (see `quantize`)."""
    return quantize(tensor, kind="Q8_0")


def infer_q8_0(tensor: TensorInfo) -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `quantize_q8_0`."""
    return infer_quantize(tensor, kind="Q8_0")


@dataclass(frozen=True)
class GgufTensor:
    """One planned GGUF tensor: its name, GGUF type and logical shape (HF order, row-major)."""

    name: str
    type: str
    shape: tuple[int, ...]
    source: str = ""  # the HF tensor it is made from
    heads: int = 0  # heads of the q/k row permutation applied to it (0: none)
    stacked: tuple[str, ...] = ()  # the HF tensors stacked into it (MoE experts), when not one `source`
    # (heads, first row, rows, transposed): the rows of each head of `source` it holds (MLA's split kv_b_proj), if a part
    part: tuple[int, int, int, bool] | tuple[()] = ()
    fp8_block: tuple[int, int] | tuple[()] = ()  # the block its FP8 source(s) are de-quantised with (scales: `<source>_scale_inv`)


class GgufTensors(dict):
    """Output name -> `GgufTensor`: the preset's statement of every tensor the GGUF file holds, made apart from the ops
    (the output check compares the written file with it); `skipped`: source tensors left out on purpose -> why."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped: dict[str, str] = {}

    def accounted(self) -> set[str]:
        """The source tensors this statement accounts for: those its tensors are made from (with an FP8 weight's
        scales), and the skipped ones."""
        found = set(self.skipped)
        for tensor in self.values():
            for name in tensor.stacked or (tensor.source,):
                found.add(name)
                if tensor.fp8_block:
                    found.add(name + SCALE_SUFFIX)
        return found


def _typed(out: str, kind: str, dtype: str) -> list[Mapper]:
    """The op that gives output `out` its GGUF type `kind` (nothing when it already has it)."""
    if kind == "Q8_0":
        return [Function("workbench.mapper.presets.gguf_preset:quantize_q8_0", (out,), (out,), infer="workbench.mapper.presets.gguf_preset:infer_q8_0")]
    if kind in QUANTIZED:
        return [Function("workbench.mapper.presets.gguf_preset:quantize", (out,), (out,), infer="workbench.mapper.presets.gguf_preset:infer_quantize",
                         params=(("kind", kind),))]
    return [Cast(out, kind)] if dtype != kind else []


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _split_kv_b(config: Any, info: TensorInfo, block: str, dtype: str,
                fp8: tuple[int, int] | None = None) -> tuple[list[list[Mapper]], dict[str, GgufTensor]]:
    """The ops (one list per stage) splitting MLA's kv_b_proj as llama.cpp does for its absorbed attention: per head,
    the first qk_nope_head_dim rows become attn_k_b (transposed: heads, kv_lora_rank, qk_nope_head_dim), the
    v_head_dim rows after them attn_v_b (heads, v_head_dim, kv_lora_rank); and the two planned tensors. `fp8`: the
    block `info` (F32) was de-quantised with, if it was."""
    nope, v_dim = int(_config_get(config, "qk_nope_head_dim")), int(_config_get(config, "v_head_dim"))
    heads = int(_config_get(config, "num_key_value_heads") or _config_get(config, "num_attention_heads"))
    rows, rank = tuple(info.shape)
    if rows != heads * (nope + v_dim):
        raise MapperError(f"Cannot split {info.name!r} {[rows, rank]} into llama.cpp's attn_k_b / attn_v_b: it should have "
                          f"{heads} heads x (qk_nope_head_dim {nope} + v_head_dim {v_dim}) rows. Check config.json.", tensor=info.name)
    joined, k_b, v_b = f"{block}.attn_kv_b.weight", f"{block}.attn_k_b.weight", f"{block}.attn_v_b.weight"
    shapes = {k_b: (heads, rank, nope), v_b: (heads, v_dim, rank)}
    kinds = {out: gguf_type(out, shape, dtype) for out, shape in shapes.items()}
    # both parts are rewritten in the third step, k_b first: the file lists them in the order they were last written
    ops: list[list[Mapper]] = [[Reshape(info.name, [heads, nope + v_dim, rank], dst=joined)],
                               [Split(joined, (f"{k_b}.part", f"{v_b}.part"), (nope, v_dim), dim=1)],
                               [Transpose(f"{k_b}.part", 1, 2, dst=k_b), Rename(f"{v_b}.part", v_b)],
                               [op for out in shapes for op in _typed(out, kinds[out], info.dtype)]]
    parts = {k_b: (heads, 0, nope, True), v_b: (heads, nope, v_dim, False)}
    return ops, {out: GgufTensor(out, kinds[out], shape, info.name, part=parts[out], fp8_block=fp8 or ())
                 for out, shape in shapes.items()}


def read_order(source: Any) -> list[str]:
    """The tensor names of `source` in the order llama.cpp's converter reads (and writes) them: files in name order,
    and within a safetensors file its names sorted (its `SafetensorsLocal` sorts them); the catalog's order otherwise.
    It differs from the order of the bytes when a file mixes dtypes (safetensors lays data out by dtype size first)."""
    names = list(source.tensors)
    files = {name: str(getattr(source[name], "file", "") or "") for name in names}
    position = {name: k for k, name in enumerate(names)}

    def key(name: str) -> tuple[str, str, int]:
        file = files[name]
        return (file, name, 0) if file.endswith(".safetensors") else (file, "", position[name])

    return sorted(names, key=key)


def hf_to_gguf(config: Any, source: Any, dtype: str = "F16", before: Mapper | None = None) -> tuple[Mapper, dict[str, GgufTensor], str]:
    """The mapper from an HF Llama-family checkpoint (`source`: its catalog) to llama.cpp's tensors, the
    GGUF type and shape of every output, and llama.cpp's architecture name. `dtype`: the GGUF type of
    matrices (F32, F16, BF16, Q8_0, Q4_0). `before`: a user mapper applied first (its outputs must be HF names).
    An FP8 checkpoint (config `quantization_config.quant_method: "fp8"`) gets a first step de-quantising its
    weights to F32 (`gguf_fp8`), as llama.cpp's converter does before anything else."""
    model_type = _config_get(config, "model_type")
    if model_type not in ARCHITECTURES:
        raise MapperError(f"Cannot map model_type {model_type!r} to GGUF: the workbench writes GGUF for "
                          f"{', '.join(sorted(ARCHITECTURES))}. Use llama.cpp's convert_hf_to_gguf.py for it.")
    if dtype not in GGUF_TYPES:
        raise MapperError(f"Cannot write GGUF type {dtype!r}: choose one of {', '.join(t.lower() for t in GGUF_TYPES)}.")
    _, permute = ARCHITECTURES[model_type]
    heads = int(_config_get(config, "num_attention_heads"))
    kv_heads = int(_config_get(config, "num_key_value_heads") or heads)
    block = fp8_block(config)
    if block is not None and before is not None and any(getattr(op, "fn", None) == DEQUANTIZE_FN for op in before.leaves()):
        raise MapperError("Cannot put an FP8 de-quantisation ahead of the GGUF preset: it de-quantises FP8 checkpoints itself, "
                          "to float32 as llama.cpp's converter does. Convert without that mapper.")
    stage0: list[Mapper] = []  # FP8 weights de-quantised to F32
    stage1: list[Mapper] = []
    stage2: list[Mapper] = []
    stage3: list[Mapper] = []
    stage4: list[Mapper] = []
    planned = GgufTensors()
    n_experts = int(_config_get(config, "num_local_experts") or _config_get(config, "num_experts")
                    or _config_get(config, "n_routed_experts") or 0)
    n_layers = int(_config_get(config, "num_hidden_layers") or 1 << 30)
    expert_pattern, expert_names = _EXPERTS.get(model_type, (None, ()))
    experts: dict[int, dict[tuple[str, int], str]] = {}
    for name in read_order(source):
        layer_index = name.split(".")[2] if name.startswith("model.layers.") else ""
        if layer_index.isdecimal() and int(layer_index) >= n_layers:  # extra layers (DeepSeek's multi-token prediction)
            stage1.append(Drop(name))
            planned.skipped[name] = f"layer {layer_index} is beyond num_hidden_layers ({n_layers}): llama.cpp leaves it out"
            continue
        if name.endswith(SKIPPED_ENDINGS):
            stage1.append(Drop(name))
            planned.skipped[name] = "llama.cpp's converter leaves it out (a buffer computed again at load)"
            continue
        expert = expert_pattern.fullmatch(name) if expert_pattern is not None else None
        if expert is not None and n_experts:
            layer = experts.setdefault(int(expert.group(1)), {})
            layer[(expert.group(3), int(expert.group(2)))] = name
            if len(layer) == 3 * n_experts:  # llama.cpp writes a layer's stacks once its last expert tensor is read
                for wid, suffix in expert_names:
                    parts = tuple(layer[(wid, e)] for e in range(n_experts))
                    out = f"blk.{expert.group(1)}.{suffix}"
                    info = [dequantized(source, part, block, stage0) for part in parts][0]
                    fp8 = block if source[parts[0]].dtype != info.dtype else ()  # de-quantised: always by row chunks
                    shape = (n_experts, *info.shape)
                    kind = gguf_type(out, shape, dtype)
                    if (kind != info.dtype or fp8) and info.dtype in SOURCE_TYPES:  # stacked and converted row chunk by row chunk
                        stage1.append(gguf_function(parts, out, kind))
                    else:
                        stage1.append(Stack(parts, out))
                        stage4.extend(_typed(out, kind, info.dtype))
                    planned[out] = GgufTensor(out, kind, shape, parts[0], 0, parts, fp8_block=fp8)
            continue
        if name.endswith(_KV_B) and model_type == "deepseek_v3":
            info = dequantized(source, name, block, stage0)
            ops, made = _split_kv_b(config, info, f"blk.{layer_index}", dtype, block if source[name].dtype != info.dtype else None)
            for stage, op in zip((stage1, stage2, stage3, stage4), ops, strict=True):
                stage.extend(op)
            planned.update(made)
            continue
        out = gguf_name(name)
        if out is None:
            continue
        info = dequantized(source, name, block, stage0)
        fp8 = block if source[name].dtype != info.dtype else ()
        shape = tuple(info.shape)
        n_heads = permuted_heads(out, heads, kv_heads) if permute else 0
        kind = gguf_type(out, shape, dtype)
        # converted row chunk by row chunk, numpy alone (a permuted vector, a q/k bias, is one row: permuted by the copy below)
        if (kind != info.dtype or fp8) and info.dtype in SOURCE_TYPES and not (n_heads and len(shape) == 1):
            stage1.append(gguf_function((name,), out, kind, n_heads))
        elif n_heads:  # the bytes stay as they are: the permutation is a copy of row slices
            stage1.append(Reshape(name, [n_heads, 2, shape[0] // n_heads // 2, *shape[1:]], dst=out))
            stage2.append(Transpose(out, 1, 2))
            stage3.append(Reshape(out, list(shape)))
            stage4.extend(_typed(out, kind, info.dtype))
        else:
            stage1.append(Rename(name, out))
            stage4.extend(_typed(out, kind, info.dtype))
        planned[out] = GgufTensor(out, kind, shape, name, n_heads, fp8_block=fp8)
    stages: list[Mapper] = [Parallel(*ops) for ops in (stage0, stage1, stage2, stage3, stage4) if ops]
    if before is not None:
        stages.insert(0, before)
        for name in before.bind(source).dropped:  # rest='keep': what its own ops drop (M.Drop), on purpose
            planned.skipped.setdefault(name, "dropped by the mapper given ahead of the preset")
    arch = ARCHITECTURES[model_type][0]
    stages.append(Claim(f"HF {model_type} (GGUF, llama.cpp's {arch})", r".+", _CLAIM_HINT,
                        "and the GGUF file would be written without them"))
    return Sequential(*stages), planned, arch



__all__ = ["ARCHITECTURES", "GGUF_TYPES", "QUANTIZED", "SKIPPED_ENDINGS", "GgufTensor", "GgufTensors", "gguf_name", "gguf_type", "hf_to_gguf", "infer_q8_0",
           "infer_quantize", "permuted_heads", "quantize", "quantize_q8_0", "quantized_shape"]
