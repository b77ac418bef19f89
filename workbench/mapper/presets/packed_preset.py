"""`M.presets.decompress(config)`: every packed weight format config.json describes (compressed-tensors, GPTQ, AWQ)
turned into dense weights, one `Function` per folded name template; the kernels are in `compressed` and `gptq`, what
each tensor is in `packed`."""

from __future__ import annotations

from typing import Any

from ...dtypes import normalize_dtype
from ...errors import MapperError
from ..base import Mapper
from ..function import Function
from .compressed import check_parts
from .gptq import gptq_params
from .model_shape import read_config
from .packed import REFUSED_SPARSE, method_of, packed_modules, packed_shape, quant_config
from .quantized import _functions, _infos, _output_code

HERE = "workbench.mapper.presets.compressed"
REFUSALS = {
    "marlin-24": "is Marlin's GPU tile layout of 2:4 sparse int4 weights, which the library itself never decompressed "
                 "(no reference to check against). Re-save the model with llm-compressor in 'sparse-24-bitmask' or a "
                 "dense format.",
    "sparse-bitmask": "(unstructured bitmask sparsity) is not read by the workbench. Decompress it with "
                      "compressed-tensors <= 0.14 first.",
}

def default_dtype(config: Any) -> str:
    """The config's `torch_dtype` / `dtype` when it is bf16 / fp16 / fp32, else bf16."""
    data = read_config(config) if config is not None else {}
    value = data.get("torch_dtype") or data.get("dtype")
    try:
        code = normalize_dtype(str(value).replace("torch.", "")) if value else "BF16"
    except Exception:
        return "BF16"
    return code if code in ("BF16", "F16", "F32") else "BF16"


def decompress(config: Any, source: Any = None, *, dtype: str | None = None) -> Mapper:
    """Quantised linears -> dense weights in `dtype` (the config's torch_dtype, else bf16), for every format of
    compressed-tensors (`pack-quantized` int3/int4/int8 groups, symmetric or not; `int-quantized`, `float-quantized`,
    `naive-quantized`, `nvfp4-pack-quantized`; 2:4 sparse `sparse-24-bitmask`, quantised under it or not; stacked
    experts [E, rows, cols]), GPTQ (2, 3, 4, 8 bits) and AWQ (GEMM, GEMV) (`quant_method` in config.json's quantization_config).

    `config` is a config.json path, its folder, a dict or a transformers config; the tensor names come from `source`
    (a checkpoint, catalog, folder or name -> TensorInfo mapping; default: the checkpoint in the config's folder).
    Each weight's scales, zero points, g_idx and shape are its op's inputs (the plan counts them); activation scales
    of the same module are dropped, and a conversion removes `quantization_config` from the copied config.json.
    """
    from ..compose import Parallel
    from ..ops import Drop

    quant = quant_config(config)
    method = method_of(quant)
    if method not in ("compressed-tensors", "gptq", "awq"):
        raise MapperError(f"Cannot build decompress: config.json's quantization_config has quant_method {method or 'none'!r}; "
                          "decompress reads compressed-tensors, gptq and awq. For FP8 block scales use dequantize_fp8, for "
                          "MXFP4 dequantize_mxfp4.")
    code = _output_code(dtype) if dtype is not None else default_dtype(config)
    infos_list = _infos(source, config)
    infos = {info.name: info for info in infos_list}
    modules = packed_modules(infos, config)
    if not modules:
        raise MapperError(f"Cannot build decompress: config.json says {method}, but the source holds no packed weight "
                          f"({'weight_packed / weight + weight_scale' if method == 'compressed-tensors' else 'qweight'}). "
                          "Check that config.json belongs to this checkpoint.")
    pairs: dict[str, tuple[str, ...]] = {}
    outputs: dict[str, tuple[str, ...]] = {}
    params: dict[str, dict[str, Any]] = {}
    for module in modules:
        first = module.parts.get("packed")
        if method == "compressed-tensors":
            if module.format in REFUSED_SPARSE:
                raise MapperError(f"Cannot decompress {module.module!r}: compressed-tensors format {module.format!r} "
                                  f"{REFUSALS[module.format]}", tensor=module.module)
            shape = packed_shape(module, infos)
            roles = tuple(r for r in ("packed", "scale", "zero_point", "shape", "global_scale", "bitmask")
                          if r in module.parts)
            if module.symmetric and "zero_point" in roles:
                roles = tuple(r for r in roles if r != "zero_point")
            kwargs = {"roles": list(roles), "format": module.format, "bits": module.bits, "strategy": module.strategy,
                      "group_size": module.group_size, "symmetric": module.symmetric,
                      "block": list(module.block) if module.block else None, "shape": list(shape), "dtype": code}
            if module.sparse:
                kwargs["sparse"] = module.sparse
            check_parts({r: infos[module.parts[r]] for r in roles}, format=module.format, bits=module.bits,
                        strategy=module.strategy, group_size=module.group_size, symmetric=module.symmetric,
                        block=module.block, shape=shape, sparse=module.sparse)
        else:
            roles, kwargs = gptq_params(module, infos, code)
        inputs = tuple(module.parts[r] for r in roles)
        pairs[first] = inputs
        outputs[first] = (module.output,)
        params[first] = kwargs
    extras = [name for m in modules for name in m.extras]
    unused = [m.parts[r] for m in modules for r in m.parts if m.parts[r] not in pairs.get(m.parts["packed"], ())]

    fn = f"{HERE}:decompress_tensor" if method == "compressed-tensors" else "workbench.mapper.presets.gptq:dequantize_gptq_tensor"
    infer = f"{HERE}:infer_decompress" if method == "compressed-tensors" else "workbench.mapper.presets.gptq:infer_dequantize_gptq"
    by_signature: dict[str, dict[str, tuple[str, ...]]] = {}
    for first, kwargs in params.items():
        by_signature.setdefault(repr(sorted(kwargs.items())), {})[first] = pairs[first]
    ops: list[Mapper] = []
    for signature_pairs in by_signature.values():
        kwargs = params[next(iter(signature_pairs))]

        def make(inputs: list[str], outs: list[str], kwargs: dict[str, Any] = kwargs) -> Function:
            return Function(fn=fn, inputs=inputs, outputs=outs, infer=infer, params=kwargs)

        ops.append(_functions(signature_pairs, {k: outputs[k] for k in signature_pairs}, infos, make))
    ops.extend(Drop(name) for name in sorted(set(extras) | set(unused)))
    return ops[0] if len(ops) == 1 else Parallel(*ops)


__all__ = ["decompress", "default_dtype"]
