"""Quantised weights: FP8 with block scales and MXFP4, to and from bf16/fp32, as ordinary `Function` ops.

FP8 "fine-grained" checkpoints (DeepSeek-V3, Qwen3-FP8) store each linear weight `X.weight` as
float8_e4m3fn beside `X.weight_scale_inv`, one float32 scale per `weight_block_size` tile (rows x cols);
the last tile of a dimension that is not a multiple of the block is partial. Dequantising multiplies
every element by its tile's scale in float32, then rounds once to the output dtype.

MXFP4 (gpt-oss experts) stores `X_blocks` (uint8, two e2m1 values per byte, low nibble first, 16 bytes =
32 values per block) and `X_scales` (uint8 e8m0 exponents, value 2**(byte-127), one per block). As
transformers does, the dequantised `X` has its last two dims swapped (gpt-oss holds experts [E, in, out]).

The kernels decode with numpy and ml_dtypes (no torch needed); given torch tensors (the engine's
compute path) they view the same memory and return torch tensors. Each works one block-row (or one
expert) at a time, so its scratch stays small next to the group's inputs and outputs that the plan counts.
The scale tensors are inputs of the same `Function`, so every group lists them and the plan counts them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ...catalog import TensorInfo
from ...dtypes import is_float, normalize_dtype
from ...errors import MapperError
from ...names import Template, placeholders_of
from ..base import Mapper
from ..compose import Parallel
from ..function import Function
from ..groups import Problem
from ..state import State
from .layouts import fold_names
from .model_shape import read_config
from .scaled_rows import ScaledRows

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MXFP4_BLOCK = 32  # values per e8m0 scale
PIECE = 1 << 16  # values a kernel converts at a time: its float32 scratch stays a few hundred KiB
OUTPUT_DTYPES = ("BF16", "F16", "F32")
HERE = "workbench.mapper.presets.quantized"
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE_SUFFIX = "_scale_inv"


# -- numpy <-> torch at the edges ------------------------------------------------------------------
def _numpy_dtype(code: str) -> Any:
    import ml_dtypes
    import numpy as np

    table = {
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
        "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "U8": np.uint8, "I8": np.int8,
    }
    if code not in table:
        raise MapperError(f"Cannot decode a {code} tensor with numpy: the quantised kernels read {', '.join(table)}.")
    return table[code]


def _as_numpy(tensor: Any) -> tuple[Any, bool]:
    """(numpy array over the same memory, whether `tensor` was a torch tensor)."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return tensor, False
    import torch

    from ...dtypes import from_torch

    code = from_torch(tensor.dtype)
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view(_numpy_dtype(code)).reshape(tuple(tensor.shape)), True


def _out(array: Any, code: str, torch_out: bool) -> Any:
    if not torch_out:
        return array
    import torch

    from ...dtypes import to_torch

    shape = array.shape
    return torch.from_numpy(array.reshape(-1).view("uint8")).view(to_torch(code)).reshape(shape)


def _output_code(dtype: Any) -> str:
    code = normalize_dtype(dtype)
    if code not in OUTPUT_DTYPES:
        raise MapperError(f"Cannot dequantise to {code}: choose one of {', '.join(OUTPUT_DTYPES)} (bf16 by default).")
    return code


def _block(block: Any) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise MapperError(f"Cannot use FP8 block {block!r}: give two positive whole numbers (rows, cols), e.g. (128, 128).")
    return int(block[0]), int(block[1])


def _grid(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


# -- FP8 block scales ---------------------------------------------------------------------------------
def dequantize_fp8_tensor(weight: Any, scale_inv: Any, *, block: Sequence[int], dtype: str = "BF16") -> Any:
    """`weight` (float8, [..., rows, cols]) times its tile's `scale_inv` (float32 grid [..., ceil(rows/b0), ceil(cols/b1)]),
    computed in float32 and rounded once to `dtype`; partial edge tiles use their own scale."""
    import numpy as np

    b0, b1 = _block(block)
    code = _output_code(dtype)
    w, torch_in = _as_numpy(weight)
    s, _ = _as_numpy(scale_inv)
    rows, cols = w.shape[-2:]
    lead = w.shape[:-2]
    w3 = w.reshape(-1, rows, cols)
    s3 = s.reshape(-1, *s.shape[-2:])
    out = np.empty(w3.shape, dtype=_numpy_dtype(code))
    step = _rows_per_piece(cols)
    for index in range(w3.shape[0]):
        for tile, r0 in enumerate(range(0, rows, b0)):
            row_scales = np.repeat(s3[index, tile].astype(np.float32), b1)[:cols]
            for p0 in range(r0, min(r0 + b0, rows), step):
                p1 = min(p0 + step, r0 + b0, rows)
                values = w3[index, p0:p1].astype(np.float32)
                np.multiply(values, row_scales, out=values)
                np.copyto(out[index, p0:p1], values, casting="unsafe")  # one rounding, to nearest even
    return _out(out.reshape(*lead, rows, cols), code, torch_in)


def _rows_per_piece(cols: int) -> int:
    """Rows converted at a time: about PIECE values of float32 scratch, whatever the tensor's size."""
    return max(1, PIECE // max(1, cols))


def infer_dequantize_fp8(weight: TensorInfo, scale_inv: TensorInfo, *, block: Sequence[int], dtype: str = "BF16") -> list:
    """Metadata of `dequantize_fp8_tensor`; refuses a scale grid that does not fit the weight and the block."""
    b0, b1 = _block(block)
    code = _output_code(dtype)
    if len(weight.shape) < 2 or not is_float(weight.dtype):
        raise MapperError(f"Cannot dequantise {weight.name!r}: it is {weight.dtype} {list(weight.shape)}; FP8 block scales "
                          "apply to float weights with at least 2 dims.", tensor=weight.name)
    expected = _grid(weight.shape, (b0, b1))
    if tuple(scale_inv.shape) != expected or not is_float(scale_inv.dtype):
        raise MapperError(
            f"Cannot dequantise {weight.name!r} {list(weight.shape)}: its scales {scale_inv.name!r} are {scale_inv.dtype} "
            f"{list(scale_inv.shape)}, but block [{b0}, {b1}] needs a float grid {list(expected)}. Check "
            "quantization_config.weight_block_size in config.json (or pass the block the checkpoint was made with).",
            tensor=scale_inv.name,
        )
    return [(code, tuple(weight.shape))]


def quantize_fp8_tensor(weight: Any, *, block: Sequence[int]) -> tuple[Any, Any]:
    """Block-scaled FP8, transformers' algorithm (Fp8Quantize) extended to partial edge tiles: per tile,
    scale = 448 / max|w| in float32 as torch computes it (1 for an all-zero tile), `weight_scale_inv` = 1 / scale (float32), and
    w * scale clamped to +-448 rounded to float8_e4m3fn."""
    import numpy as np

    b0, b1 = _block(block)
    w, torch_in = _as_numpy(weight)
    rows, cols = w.shape[-2:]
    lead = w.shape[:-2]
    w3 = w.reshape(-1, rows, cols)
    grid = _grid(w3.shape, (b0, b1))
    q = np.empty(w3.shape, dtype=_numpy_dtype("F8_E4M3"))
    inv = np.empty(grid, dtype=np.float32)
    starts = np.arange(0, cols, b1)
    step = _rows_per_piece(cols)
    top, one = np.float32(FP8_MAX), np.float32(1.0)
    for index in range(w3.shape[0]):
        for tile, r0 in enumerate(range(0, rows, b0)):
            r1 = min(r0 + b0, rows)
            amax = np.zeros(cols, dtype=np.float32)
            for p0 in range(r0, r1, step):
                np.maximum(amax, np.abs(w3[index, p0:min(p0 + step, r1)].astype(np.float32)).max(axis=0), out=amax)
            amax = np.maximum.reduceat(amax, starts)
            # torch computes `448 / amax` as reciprocal(amax) * 448 (two roundings): the same here, bit for bit
            scale = np.where(amax > 0, (one / np.where(amax > 0, amax, one)) * top, one).astype(np.float32)
            inv[index, tile] = one / scale
            col_scales = np.repeat(scale, b1)[:cols]
            for p0 in range(r0, r1, step):
                values = w3[index, p0:min(p0 + step, r1)].astype(np.float32)
                np.multiply(values, col_scales, out=values)
                np.clip(values, -top, top, out=values)
                np.copyto(q[index, p0:min(p0 + step, r1)], values, casting="unsafe")
    return _out(q.reshape(*lead, rows, cols), "F8_E4M3", torch_in), _out(inv.reshape(*lead, *grid[-2:]), "F32", torch_in)


def infer_quantize_fp8(weight: TensorInfo, *, block: Sequence[int]) -> list:
    """Metadata of `quantize_fp8_tensor`: the float8 weight and its float32 scale grid."""
    b0, b1 = _block(block)
    if len(weight.shape) < 2 or weight.dtype not in ("BF16", "F16", "F32"):
        raise MapperError(f"Cannot quantise {weight.name!r} to FP8: it is {weight.dtype} {list(weight.shape)}; block "
                          "quantisation takes a bf16/fp16/fp32 weight with at least 2 dims. Leave it out of the targets.",
                          tensor=weight.name)
    return [("F8_E4M3", tuple(weight.shape)), ("F32", _grid(weight.shape, (b0, b1)))]


# -- MXFP4 --------------------------------------------------------------------------------------------
def dequantize_mxfp4_tensor(blocks: Any, scales: Any, *, dtype: str = "BF16", transpose: bool = True) -> Any:
    """MXFP4 `blocks` ([..., R, G, 16] bytes, low nibble first) times 2**(scale-127) per 32 values -> [..., R, G*32];
    with `transpose`, the last two dims swapped (transformers' gpt-oss layout [..., G*32, R])."""
    import ml_dtypes
    import numpy as np

    code = _output_code(dtype)
    b, torch_in = _as_numpy(blocks)
    s, _ = _as_numpy(scales)
    b = b.view(np.uint8)
    *lead, rows, groups, width = (1, *b.shape) if b.ndim == 2 else b.shape
    values = groups * width * 2
    mats = b.reshape(-1, rows, groups, width)
    exps = s.view(np.uint8).reshape(-1, rows, groups)
    out = np.empty((mats.shape[0], values, rows) if transpose else (mats.shape[0], rows, values), dtype=_numpy_dtype(code))
    fp4, e8m0 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu
    step = _rows_per_piece(values)
    for index in range(mats.shape[0]):
        for r0 in range(0, rows, step):
            chunk = mats[index, r0:r0 + step]
            decoded = np.empty((*chunk.shape, 2), dtype=np.float32)
            decoded[..., 0] = (chunk & 0x0F).view(fp4).astype(np.float32)
            decoded[..., 1] = (chunk >> 4).view(fp4).astype(np.float32)
            decoded *= exps[index, r0:r0 + step].view(e8m0).astype(np.float32)[..., None, None]
            flat = decoded.reshape(chunk.shape[0], values)
            np.copyto(out[index, :, r0:r0 + step] if transpose else out[index, r0:r0 + step], flat.T if transpose else flat,
                      casting="unsafe")
    shape = (*b.shape[:-3], *out.shape[1:]) if b.ndim > 2 else out.shape[1:]
    if b.ndim == 2:
        shape = (values,)
    return _out(out.reshape(shape), code, torch_in)


def infer_dequantize_mxfp4(blocks: TensorInfo, scales: TensorInfo, *, dtype: str = "BF16", transpose: bool = True) -> list:
    """Metadata of `dequantize_mxfp4_tensor`; checks that blocks and scales fit each other."""
    code = _output_code(dtype)
    shape = tuple(blocks.shape)
    fits = (len(shape) >= 2 and blocks.dtype in ("U8", "I8") and scales.dtype in ("U8", "F8_E8M0")
            and tuple(scales.shape) == shape[:-1] and shape[-1] * 2 == MXFP4_BLOCK)
    if not fits:
        raise MapperError(
            f"Cannot dequantise MXFP4 {blocks.name!r} ({blocks.dtype} {list(shape)}) with {scales.name!r} ({scales.dtype} "
            f"{list(scales.shape)}): expected uint8 blocks [..., G, 16] (32 FP4 values per block) and uint8 scales [..., G].",
            tensor=blocks.name,
        )
    lead, values = shape[:-2], shape[-2] * MXFP4_BLOCK
    if transpose and lead:
        return [(code, (*lead[:-1], values, lead[-1]))]
    return [(code, (*lead, values))]


# -- MXFP4 experts by rows: one expert (or a few) at a time -------------------------------------------
class Mxfp4Rows(ScaledRows):
    """The row job of `dequantize_mxfp4_tensor` on stacked experts (`mapper.row_jobs`): a "row" is one expert, its
    blocks read raw and dequantised with that expert's scales (read whole beside it), so a step holds a few experts'
    bytes instead of the whole stack in and out."""

    library_detail = "ml_dtypes: MXFP4 experts dequantised by rows"

    def __init__(self, blocks: TensorInfo, scales: TensorInfo, output: TensorInfo, code: str, transpose: bool) -> None:
        super().__init__(blocks, output, (scales,), code)
        self.scales, self.transpose = scales, transpose

    def scratch(self, rows: int) -> int:
        return 3 * 4 * PIECE  # the kernel's float32 pieces (decoded values and their transpose)

    def converter(self, rows: int) -> Any:
        import numpy as np

        shape, grid = self.inputs[0].shape[1:], self.scales.shape[1:]

        def convert(k: int, first: int, raw: Any, whole: Any) -> tuple[Any, int, float]:
            blocks = np.frombuffer(raw, np.uint8).reshape(-1, *shape)
            scales = np.frombuffer(whole[0], np.uint8).reshape(-1, *grid)[first:first + blocks.shape[0]]
            out = dequantize_mxfp4_tensor(blocks, scales, dtype=self.code, transpose=self.transpose)
            return np.ascontiguousarray(out).reshape(-1).view(np.uint8), 0, 0.0

        return convert


def _mxfp4_rows(op: Any, group: Any, ahead: tuple[Any, ...] = ()) -> Mxfp4Rows | None:
    """The row job of a stacked-experts MXFP4 group (blocks [E, rows, G, 16] + scales), None for any other."""
    if ahead or len(group.inputs) != 2 or len(group.outputs) != 1:
        return None
    infos = {info.name: info for info in group.inputs}
    blocks, scales = infos.get(op.inputs[0]), infos.get(op.inputs[1])
    if blocks is None or scales is None or len(blocks.shape) != 4 or blocks.shape[0] < 2:
        return None
    kwargs = op.kwargs
    return Mxfp4Rows(blocks, scales, group.outputs[0], kwargs.get("dtype", "BF16"), bool(kwargs.get("transpose", True)))


dequantize_mxfp4_tensor.rows = _mxfp4_rows  # type: ignore[attr-defined]  # the row job `Function.rows` finds


# -- finding the tensors ------------------------------------------------------------------------------
def _infos(source: Any, config: Any) -> list[TensorInfo]:
    from ..bind import source_infos

    if source is None and isinstance(config, (str, os.PathLike)):
        from .folder_infos import folder_infos

        path = Path(config)
        return folder_infos(path if path.is_dir() else path.parent)
    if source is None:
        raise MapperError("Cannot build a quantisation preset without the tensor names: pass source=wb.open_checkpoint(path) "
                          "(or give config as the checkpoint folder).")
    if isinstance(source, (str, os.PathLike)):
        from .folder_infos import folder_infos

        return folder_infos(source)
    return source_infos(source)


def _quant_config(config: Any) -> dict[str, Any]:
    quant = read_config(config).get("quantization_config") or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {}
    return quant


def _functions(pairs: dict[str, tuple[str, ...]], outputs: dict[str, tuple[str, ...]], all_names: Iterable[str],
               make: Any) -> Mapper:
    """One Function per folded template of `pairs` (first input -> all inputs), spelling out names whose
    template would also catch a tensor that is not part of a pair."""
    index = State(dict.fromkeys(all_names))  # type: ignore[arg-type] - only its name index is used
    ops: list[Mapper] = []
    for template, members in sorted(fold_names(pairs).items()):
        instances = [template] if "{" in template else []
        if instances:
            for position in range(len(pairs[members[0]])):
                text = _template_of(pairs[members[0]][position], members[0], template)
                compiled = Template(text, placeholders_of(text))
                candidates = index.candidates(compiled)
                expected = {pairs[m][position] for m in members}
                if len(candidates) == len(expected) and expected.issuperset(candidates):
                    continue  # the names sharing the template's literal segments are exactly the pairs'
                found = [n for n in candidates if compiled.match(n.split(".")) is not None]
                if set(found) != expected:
                    instances = []
                    break
        if instances:
            first = members[0]
            ops.append(make([_template_of(n, first, template) for n in pairs[first]],
                            [_template_of(n, first, template) for n in outputs[first]]))
        else:
            ops.extend(make(list(pairs[m]), list(outputs[m])) for m in members)
    return Parallel(*ops)


def _template_of(name: str, member: str, template: str) -> str:
    """`name` (a sibling of `member`) with the numeric segments `template` turned into placeholders."""
    mine, theirs = member.split("."), template.split(".")
    parts = name.split(".")
    for pos, (value, pattern) in enumerate(zip(mine, theirs, strict=True)):
        if pattern != value and pos < len(parts) - 1:
            parts[pos] = pattern
    return ".".join(parts)


# -- presets ------------------------------------------------------------------------------------------
def dequantize_fp8(config: Any, source: Any = None, *, dtype: str = "bf16", block: Sequence[int] | None = None) -> Mapper:
    """FP8 weights with block scales (`X.weight` + `X.weight_scale_inv`) -> `X.weight` in `dtype` (bf16 by default).

    The block comes from `quantization_config.weight_block_size` of `config` (a config.json path or its
    folder, a dict, or a transformers config), or from `block`; the tensor names from `source` (a
    checkpoint, catalog or name -> TensorInfo mapping; default: the checkpoint in the config's folder).
    """
    quant = _quant_config(config)
    chosen = block if block is not None else quant.get("weight_block_size")
    if chosen is None:
        raise MapperError("Cannot build dequantize_fp8: the config has no quantization_config.weight_block_size. "
                          "Pass block=(rows, cols) as the checkpoint was quantised.")
    b0, b1 = _block(tuple(chosen))
    code = _output_code(dtype)
    infos = _infos(source, config)
    names = {info.name for info in infos}
    pairs: dict[str, tuple[str, ...]] = {}
    outputs: dict[str, tuple[str, ...]] = {}
    for name in names:
        if not name.endswith(SCALE_SUFFIX):
            continue
        base = name[: -len(SCALE_SUFFIX)]
        weight = base  # 'X.weight' for 'X.weight_scale_inv'; experts: 'X.gate_up_proj' for 'X.gate_up_proj_scale_inv'
        if weight not in names:
            continue
        pairs[weight] = (weight, name)
        outputs[weight] = (weight,)
    if not pairs:
        raise MapperError("Cannot build dequantize_fp8: the source holds no weight with a '*_scale_inv' beside it. "
                          "Check that this is a fine-grained FP8 checkpoint.")

    def make(inputs: list[str], outs: list[str]) -> Function:
        return Function(fn=f"{HERE}:dequantize_fp8_tensor", inputs=inputs, outputs=outs,
                        infer=f"{HERE}:infer_dequantize_fp8", params={"block": [b0, b1], "dtype": code})

    return _functions(pairs, outputs, names, make)


def dequantize_mxfp4(config: Any = None, source: Any = None, *, dtype: str = "bf16", transpose: bool = True) -> Mapper:
    """MXFP4 weights (`X_blocks` + `X_scales`, gpt-oss experts) -> `X` in `dtype`, laid out as transformers holds
    it (last two dims swapped; `transpose=False` keeps the stored order). Names from `source` (default: the
    checkpoint in the config's folder)."""
    code = _output_code(dtype)
    infos = _infos(source, config)
    names = {info.name for info in infos}
    pairs: dict[str, tuple[str, ...]] = {}
    outputs: dict[str, tuple[str, ...]] = {}
    for name in names:
        if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in names:
            base = name[: -len("_blocks")]
            pairs[name] = (name, base + "_scales")
            outputs[name] = (base,)
    if not pairs:
        raise MapperError("Cannot build dequantize_mxfp4: the source holds no '*_blocks' tensor with '*_scales' beside it. "
                          "Check that this is an MXFP4 checkpoint (gpt-oss).")

    def make(inputs: list[str], outs: list[str]) -> Function:
        return Function(fn=f"{HERE}:dequantize_mxfp4_tensor", inputs=inputs, outputs=outs,
                        infer=f"{HERE}:infer_dequantize_mxfp4", params={"dtype": code, "transpose": bool(transpose)})

    return _functions(pairs, outputs, names, make)


def quantize_fp8(block: Sequence[int] = (128, 128), *, source: Any = None, targets: Sequence[str] = LINEAR_TARGETS,
                 layers: str = "model.layers.{i}") -> Mapper:
    """bf16/fp16/fp32 linear weights -> FP8 (`X.weight` float8_e4m3fn + `X.weight_scale_inv` float32 per block).

    Without `source`: the Llama-style projections `targets` under `layers`. With `source`: every 2-D float
    `X.weight` whose module name ends in one of `targets` (experts included), folded into templates.
    A conversion with this mapper writes the matching `quantization_config` into the copied config.json.
    """
    b0, b1 = _block(tuple(block))

    def make(inputs: list[str], outs: list[str]) -> Function:
        return Function(fn=f"{HERE}:quantize_fp8_tensor", inputs=inputs, outputs=outs,
                        infer=f"{HERE}:infer_quantize_fp8", params={"block": [b0, b1]})

    if source is None:
        return Parallel(*[
            make([f"{layers}.{{block}}.{t}.weight"], [f"{layers}.{{block}}.{t}.weight", f"{layers}.{{block}}.{t}.weight{SCALE_SUFFIX}"])
            for t in targets
        ])
    infos = _infos(source, None)
    pairs: dict[str, tuple[str, ...]] = {}
    outputs: dict[str, tuple[str, ...]] = {}
    for info in infos:
        parts = info.name.split(".")
        if (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in targets and len(info.shape) == 2
                and info.dtype in ("BF16", "F16", "F32")):
            pairs[info.name] = (info.name,)
            outputs[info.name] = (info.name, info.name + SCALE_SUFFIX)
    if not pairs:
        raise MapperError(f"Cannot build quantize_fp8: no 2-D bf16/fp16/fp32 weight of a module named {', '.join(targets)} "
                          "in the source. Pass targets=[...] with the linear modules to quantise.")
    return _functions(pairs, outputs, [i.name for i in infos], make)


# -- the dequantised view of a checkpoint ------------------------------------------------------------
def dequantized_view(infos: Iterable[TensorInfo], dtype: str = "bf16", config: Any = None) -> tuple[dict[str, TensorInfo], list[str]]:
    """The tensors as `dequantize_fp8` / `dequantize_mxfp4` / `decompress` leave them (name -> TensorInfo, in order),
    and the quantised kinds found ('FP8', 'MXFP4', 'PACKED'): what a layout preset composed after a dequantising step
    sees.

    An FP8 weight with `*_scale_inv` beside it becomes `dtype` and loses its scales; `X_blocks` + `X_scales` become
    `X` (transformers' gpt-oss layout); with `config`, the packed weights it describes (compressed-tensors, GPTQ,
    AWQ) become `X.weight` without their scales, zero points and activation scales. Metadata only; the kinds are
    empty when nothing is quantised.
    """
    code = _output_code(dtype)
    tensors = {info.name: info for info in infos}
    packed = _packed_view(tensors, config, code) if config is not None else {}
    if packed:
        tensors = packed
    fp8 = {name[: -len(SCALE_SUFFIX)] for name in tensors if name.endswith(SCALE_SUFFIX)
           and getattr(tensors.get(name[: -len(SCALE_SUFFIX)]), "dtype", None) in QUANTISED_DTYPES}
    mxfp4: dict[str, TensorInfo] = {}  # base -> its dequantised TensorInfo
    for name, info in tensors.items():
        if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors:
            base = name[: -len("_blocks")]
            try:
                ((out_code, shape),) = infer_dequantize_mxfp4(info, tensors[base + "_scales"], dtype=code)
            except MapperError:  # not a pair dequantize_mxfp4 converts: left as it is (and claimed)
                continue
            mxfp4[base] = TensorInfo(base, out_code, shape)
    if not fp8 and not mxfp4:
        return tensors, ["PACKED"] if packed else []
    view: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        if name in fp8:
            view[name] = TensorInfo(name, code, tuple(info.shape))
        elif name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in fp8:
            continue
        elif name.endswith("_blocks") and name[: -len("_blocks")] in mxfp4:
            view[name[: -len("_blocks")]] = mxfp4[name[: -len("_blocks")]]
        elif not (name.endswith("_scales") and name[: -len("_scales")] in mxfp4):
            view[name] = info
    return view, [kind for kind, found in (("FP8", fp8), ("MXFP4", mxfp4), ("PACKED", packed)) if found]


def _packed_view(tensors: dict[str, TensorInfo], config: Any, code: str) -> dict[str, TensorInfo]:
    """`tensors` with each packed module `config` describes turned into its dense `X.weight` (in place of its packed
    tensor; its other parts left out); {} when there is none, or when they do not fit (the preset will say why)."""
    from .packed import dense_shape, packed_modules

    try:
        modules = packed_modules(tensors, config)
        dense = {m.parts["packed"]: TensorInfo(m.output, code, tuple(dense_shape(m, tensors))) for m in modules}
    except (MapperError, OSError, ValueError):
        return {}
    if not dense:
        return {}
    parts = {name for m in modules for name in (*m.parts.values(), *m.extras)}
    view: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        if name in dense:
            view[dense[name].name] = dense[name]
        elif name not in parts:
            view[name] = info
    return view


# the parts of packed weights (compressed-tensors, GPTQ, AWQ) a layout preset leaves to `decompress`
PACKED_SUFFIXES = (r"\.weight_packed", r"\.weight_scale", r"\.weight_zero_point", r"\.weight_shape", r"\.weight_global_scale",
                   r"\.input_scale", r"\.input_global_scale", r"\.qweight", r"\.qzeros", r"\.g_idx", r"\.scales",
                   r"\.compressed", r"\.bitmask")


def quantised_claim(kinds: Sequence[str], family: str) -> Any:
    """A `Claim` on the quantised companions (`*_scale_inv`, `*_blocks`, `*_scales`) of `kinds`: a layout preset
    derived from `dequantized_view` places it after its steps, so that used alone on a quantised checkpoint its
    plan names the scales left behind; after a dequantising step they are consumed and it reports nothing."""
    from ..claim import Claim

    suffixes = [SCALE_SUFFIX] * ("FP8" in kinds) + ["_blocks", "_scales"] * ("MXFP4" in kinds) + list(PACKED_SUFFIXES) * ("PACKED" in kinds)
    presets = {"FP8": "dequantize_fp8", "MXFP4": "dequantize_mxfp4", "PACKED": "decompress"}
    steps = ", ".join(f"M.presets.{presets[kind]}(config)" for kind in kinds)
    names = ",".join(presets[kind] for kind in kinds)
    return Claim(
        f"{'/'.join(kinds)} quantised ({family})",
        f".+(?:{'|'.join(suffixes)})",
        f"Dequantise first: M.Sequential({steps}, M.presets.{family}(config)) (workbench convert --preset {names},{family}).",
        f"but {family} gives the layout of the dequantised model, so the output would hold quantised weights apart from "
        "their scales",
    )


# -- what a conversion does to config.json -----------------------------------------------------------
def fp8_quantization_config(block: Sequence[int]) -> dict[str, Any]:
    """The `quantization_config` transformers writes for fine-grained FP8 (FineGrainedFP8Config.to_dict())."""
    b0, b1 = _block(tuple(block))
    return {
        "activation_scheme": "dynamic", "dequantize": False, "expert_dtype": "fp8", "modules_to_convert": None,
        "modules_to_not_convert": None, "quant_method": "fp8", "scale_fmt": "float", "weight_block_size": [b0, b1],
    }


QUANTISED_NAMES = (SCALE_SUFFIX, "_blocks", "_scales", ".activation_scale", ".weight_packed", ".weight_scale", ".weight_zero_point",
                   ".weight_shape", ".weight_global_scale", ".qweight", ".qzeros", ".g_idx", ".compressed", ".bitmask")
# every op that turns quantised weights into plain ones (a conversion with one drops quantization_config)
DEQUANTIZING = (f"{HERE}:dequantize_fp8_tensor", f"{HERE}:dequantize_mxfp4_tensor",
                "workbench.mapper.presets.compressed:decompress_tensor", "workbench.mapper.presets.gptq:dequantize_gptq_tensor")
QUANTISED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4")


def changes_config(mapper: Any) -> bool:
    """False when no operation of `mapper` (a mapper tree: its leaves) (de)quantises, so `config_changes` of any
    binding of it is None without looking at its groups (one op per tensor); True when it may, or is not a tree."""
    from ..base import Mapper

    if not isinstance(mapper, Mapper):
        return True
    changing = (f"{HERE}:quantize_fp8_tensor", *DEQUANTIZING)
    return any(getattr(leaf, "fn", None) in changing for leaf in mapper.leaves())


def config_changes(ops: Iterable[Any], outputs: Iterable[TensorInfo]) -> dict[str, Any] | None:
    """How config.json must change for a conversion made of `ops` producing `outputs`.

    {'quantization_config': dict} after FP8 quantisation; {'quantization_config': None, 'dtype': code} after a
    complete dequantisation; {'note': why} when a dequantisation leaves quantised tensors (FP8/FP4 weights or
    scales) in the output, so the config keeps describing them; None when the mapper does neither.
    """
    blocks: set[tuple[int, ...]] = set()
    dequantized: set[str] = set()
    for op in ops:
        fn = getattr(op, "fn", None)
        if fn == f"{HERE}:quantize_fp8_tensor":
            blocks.add(tuple(op.kwargs["block"]))
        elif fn in DEQUANTIZING:
            dequantized.add(op.kwargs["dtype"])
    if blocks and not dequantized:
        if len(blocks) > 1:
            return {"note": f"the mapper quantises with several blocks ({sorted(blocks)}): set quantization_config yourself"}
        return {"quantization_config": fp8_quantization_config(next(iter(blocks)))}
    if dequantized and not blocks:
        left = [t.name for t in outputs if t.name.endswith(QUANTISED_NAMES) or t.dtype in QUANTISED_DTYPES]
        if left:
            more = f" and {len(left) - 1} more" if len(left) > 1 else ""
            return {"note": f"quantised tensors remain in the output ({left[0]!r}{more}), so its quantization_config "
                            "is kept: dequantise them too (or drop them) for a plain model"}
        if len(dequantized) == 1:
            return {"quantization_config": None, "dtype": next(iter(dequantized))}
    return None


def _group_leaves(op: Any) -> Iterable[Any]:
    if op is None:
        return ()
    if isinstance(op, Function) or not hasattr(op, "leaves"):
        return (op,)
    return op.leaves()


def partial_block_problems(groups: Iterable[Any], shown: int = 5) -> list[Problem]:
    """A plan warning naming the tensors FP8 quantisation cuts into partial tiles (a block that does not divide
    their last two dims), or none.

    The workbench scales a partial edge tile by its own scale (a ceil-div grid, as DeepSeek's reference code
    does), so its output is right; but transformers' dequantisation on load (`Fp8Dequantize`, which it uses on
    CPU, on GPUs below compute capability 8.9, or with `dequantize=True`) takes the tile size from the scale grid
    (rows // grid rows, cols // grid cols): with a partial tile that size is wrong, so it multiplies rows and
    columns by another tile's scale (or refuses the weight as "not divisible by scale grid"), and its own
    quantiser leaves such shapes unquantised.
    """
    quantize = f"{HERE}:quantize_fp8_tensor"
    partial: list[tuple[str, tuple[int, ...], tuple[int, int]]] = []
    for group in groups:
        for leaf in _group_leaves(getattr(group, "op", None)):
            if getattr(leaf, "fn", None) != quantize:
                continue
            b0, b1 = _block(tuple(leaf.kwargs["block"]))
            shapes = {t.name: tuple(t.shape) for t in group.outputs}
            shape = shapes.get(leaf.outputs[0])
            if shape is not None and len(shape) >= 2 and (shape[-2] % b0 or shape[-1] % b1):
                partial.append((leaf.outputs[0], shape, (b0, b1)))
    if not partial:
        return []
    partial.sort()
    blocks = sorted({block for _, _, block in partial})
    listed = ", ".join(f"{name!r} {list(shape)}" for name, shape, _ in partial[:shown])
    more = f" and {len(partial) - shown} more" if len(partial) > shown else ""
    block_text = " / ".join(str(list(b)) for b in blocks)
    return [Problem(
        "warning",
        f"FP8 block {block_text} does not divide the shape of {len(partial)} quantised tensor(s): {listed}{more}. Their "
        "last tiles are partial: this output scales each by its own tile, but transformers' dequantisation on load "
        "(on CPU, on GPUs below compute capability 8.9, or with dequantize=True) takes the tile size from the scale "
        "grid and multiplies those rows and columns by the wrong scales (or refuses them as not divisible by the scale "
        "grid). Choose a block that divides these shapes, or leave these tensors out of quantize_fp8's targets.",
        None, partial[0][0], kind="preset",
    )]


__all__ = [
    "config_changes", "partial_block_problems", "dequantize_fp8", "dequantize_fp8_tensor", "dequantize_mxfp4", "dequantize_mxfp4_tensor",
    "fp8_quantization_config", "quantize_fp8", "quantize_fp8_tensor",
]



def _fp8_rows(op: Any, group: Any, ahead: tuple[Any, ...] = ()) -> Any:
    """The row job of a dense FP8 group (`fp8_rows`), given this module's kernel and dtype tables."""
    from .fp8_rows import fp8_rows

    return fp8_rows(op, group, ahead, kernel=dequantize_fp8_tensor, numpy_dtype=_numpy_dtype, output_code=_output_code)


dequantize_fp8_tensor.rows = _fp8_rows  # type: ignore[attr-defined]  # the row job `Function.rows` finds
