"""What each packed tensor of a quantised checkpoint is: compressed-tensors, GPTQ and AWQ, read from config.json.

A quantised linear `X` is stored as several tensors: compressed-tensors writes `X.weight_packed` (int32, values packed
densely) or `X.weight` (int8 / float8) beside `X.weight_scale`, maybe `X.weight_zero_point`, `X.weight_shape`,
`X.weight_global_scale` and activation scales; GPTQ writes `X.qweight`, `X.qzeros`, `X.scales`, `X.g_idx`; AWQ the
same without `g_idx`. Which format, how many bits, which group size and whether a zero point is used are in
`quantization_config` (compressed-tensors: `config_groups` with `targets`, `weights` and `format`; GPTQ / AWQ: `bits`,
`group_size`, `sym` / `zero_point`, `desc_act`, `version`, `checkpoint_format`). A 2:4 sparse compressed-tensors
weight (`sparsity_config.format: sparse-24-bitmask`) is `X.compressed` (the kept half of each row), `X.bitmask` (which
values were kept, a bit each) and `X.shape`, int8 / float8 with `X.weight_scale` when quantised under the sparsity.

`packed_modules(names, config)` pairs the two, from metadata alone: one `PackedModule` per quantised linear, naming
its tensors by role. The catalog columns (`packed_columns`), the dequantising preset (`decompress`) and `suggest`
all read this one description.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import MapperError
from .model_shape import read_config

CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "nvfp4-pack-quantized")
METHODS = ("compressed-tensors", "gptq", "awq")
# compressed-tensors tensors of a module, by role (suffix after the module name)
CT_ROLES = {"weight_packed": "packed", "weight_scale": "scale", "weight_zero_point": "zero_point",
            "weight_shape": "shape", "weight_global_scale": "global_scale", "weight_g_idx": "g_idx"}
# activation / kv-cache quantisation parameters: meaningless once the weights are plain, dropped with the config
CT_EXTRAS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
             "output_global_scale", "k_scale", "v_scale")
GPTQ_ROLES = {"qweight": "packed", "scales": "scale", "qzeros": "zero_point", "g_idx": "g_idx"}


@dataclass(frozen=True)
class PackedModule:
    """One quantised linear: how its weight is stored (`method`, `format`, `bits`, ...) and its tensors by role
    (`parts`: 'packed' -> the packed / quantised weight, 'scale', 'zero_point', 'g_idx', 'shape', 'global_scale')."""

    module: str
    method: str  # 'compressed-tensors' | 'gptq' | 'awq'
    format: str  # one of CT_FORMATS ('dense': a 2:4 sparse weight not quantised), 'marlin-24', or 'gptq' / 'awq'
    bits: int
    kind: str  # 'int' | 'float'
    strategy: str  # 'group' | 'channel' | 'tensor' | 'block' | 'tensor_group'
    group_size: int | None
    symmetric: bool
    parts: dict[str, str] = field(default_factory=dict)
    extras: tuple[str, ...] = ()  # activation scales of the module, dropped when it is dequantised
    block: tuple[int, int] | None = None
    desc_act: bool = False  # GPTQ: rows reordered by activation (g_idx says each row's group)
    variant: str = ""  # GPTQ: 'gptq' (zeros stored minus one) or 'gptq_v2'; AWQ: 'gemm' / 'gemv'
    sparse: str = ""  # compressed-tensors sparsity: 'sparse-24-bitmask' (values + bitmask), stacked on `format`

    @property
    def label(self) -> str:
        """What the catalog's `quant_format` column says: the format, with the sparsity stacked under it."""
        if not self.sparse:
            return self.format
        return self.sparse if self.format == "dense" else f"{self.sparse} + {self.format}"

    @property
    def output(self) -> str:
        """The name of the dequantised weight: `X.weight`."""
        return f"{self.module}.weight"

    @property
    def inputs(self) -> tuple[str, ...]:
        """The tensors the dequantisation reads, in role order."""
        return tuple(self.parts[role] for role in ROLE_ORDER if role in self.parts)


ROLE_ORDER = ("packed", "scale", "zero_point", "g_idx", "shape", "global_scale", "bitmask")


def quant_config(config: Any) -> dict[str, Any]:
    """`quantization_config` of `config` (a config.json path or folder, dict, transformers config) as a dict; {} if none."""
    quant = read_config(config).get("quantization_config") if config is not None else None
    if quant is None:
        return {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {}
    return quant


def method_of(quant: Mapping[str, Any]) -> str:
    """'compressed-tensors', 'gptq', 'awq', or another `quant_method` (lower case; '' when absent)."""
    method = str(quant.get("quant_method", "")).lower().replace("_", "-")
    return "compressed-tensors" if method in ("compressed-tensors", "sparseml") else method


def packed_modules(names: Iterable[str], config: Any) -> list[PackedModule]:
    """The quantised linears of a checkpoint whose tensor `names` are given and whose config is `config`; [] when the
    config describes none of the formats here. Metadata only."""
    quant = quant_config(config)
    method = method_of(quant)
    dtypes = {n: getattr(i, "dtype", None) for n, i in names.items()} if isinstance(names, Mapping) else {}
    names = list(names)
    if method == "compressed-tensors":
        return _ct_modules(names, quant, dtypes)
    if method in ("gptq", "awq"):
        return _gptq_modules(names, quant, method)
    return []


# -- compressed-tensors --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    weights: dict[str, Any]
    format: str


def _ct_groups(quant: Mapping[str, Any]) -> list[_Group]:
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise MapperError("Cannot read the compressed-tensors quantization_config: it has no config_groups. Check "
                          "config.json (llm-compressor writes one group per scheme).")
    top = str(quant.get("format") or "")
    found = []
    for name, group in groups.items():
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            continue
        fmt = str(group.get("format") or top)
        targets = group.get("targets") or []
        found.append(_Group(str(name), tuple(str(t) for t in (targets if isinstance(targets, list) else [targets])),
                            dict(group["weights"]), fmt))
    return found


def _is_class_target(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _target_matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _group_for(module: str, groups: list[_Group], stored: str) -> _Group:
    """The config group of `module`: one whose name or regex targets it, else the class-targeted group whose format
    fits how its weight is stored (`stored`: 'packed', 'nvfp4', 'int8', 'float8')."""
    named = [g for g in groups if any(_target_matches(t, module) for t in g.targets if not _is_class_target(t))]
    if named:
        return named[0]
    fitting = {"packed": ("pack-quantized",), "nvfp4": ("nvfp4-pack-quantized",),
               "int8": ("int-quantized", "naive-quantized"), "float8": ("float-quantized", "naive-quantized")}[stored]
    candidates = [g for g in groups if any(_is_class_target(t) for t in g.targets)]
    fits = [g for g in candidates if g.format in fitting or g.format in ("mixed-precision", "")] or candidates
    if not fits:
        raise MapperError(f"Cannot tell how {module!r} is quantised: no config_groups entry of quantization_config "
                          f"targets it. Check config.json's config_groups targets.", tensor=module)
    return fits[0]


SPARSE_FORMATS = ("sparse-24-bitmask",)
# compressed-tensors' legacy sparse formats whose tensors are listed but not dequantised: `marlin-24` is a GPU kernel's
# tile layout the library itself never decompressed (Marlin24Compressor.decompress raised NotImplementedError up to
# 0.14.0, the last release holding it); `sparse-bitmask` (unstructured) is not read here
REFUSED_SPARSE = ("marlin-24", "sparse-bitmask")


def _sparse_config(quant: Mapping[str, Any]) -> dict[str, Any]:
    sparsity = quant.get("sparsity_config") or {}
    return dict(sparsity) if isinstance(sparsity, Mapping) else {}


def _sparse_module(module: str, quant: Mapping[str, Any], groups: list[_Group], present: set[str],
                   dtypes: Mapping[str, Any]) -> PackedModule:
    """A 2:4 sparse weight (`X.compressed` values, `X.bitmask`, `X.shape`), maybe quantised under it (int8 / float8
    with `X.weight_scale`)."""
    sparse = str(_sparse_config(quant).get("format") or "sparse-24-bitmask")
    stored = str(dtypes.get(f"{module}.compressed") or "")
    parts = {"packed": f"{module}.compressed", "bitmask": f"{module}.bitmask"}
    parts |= {role: f"{module}.{suffix}" for suffix, role in (("shape", "shape"), ("weight_scale", "scale"),
                                                              ("weight_zero_point", "zero_point")) if f"{module}.{suffix}" in present}
    extras = tuple(f"{module}.{e}" for e in CT_EXTRAS if f"{module}.{e}" in present)
    if "scale" not in parts:
        bits = {"BF16": 16, "F16": 16, "F32": 32}.get(stored, 16)
        return PackedModule(module=module, method="compressed-tensors", format="dense", bits=bits, kind="float",
                            strategy="tensor", group_size=None, symmetric=True, parts=parts, extras=extras, sparse=sparse)
    group = _group_for(module, groups, "float8" if stored.startswith("F8") else "int8") if groups else None
    weights = group.weights if group else {}
    fmt = group.format if group and group.format in ("int-quantized", "float-quantized", "naive-quantized") else (
        "float-quantized" if stored.startswith("F8") else "int-quantized")
    return PackedModule(module=module, method="compressed-tensors", format=fmt, bits=int(weights.get("num_bits", 8)),
                        kind="float" if stored.startswith("F8") else "int",
                        strategy=str(weights.get("strategy") or "channel").lower(),
                        group_size=int(weights["group_size"]) if weights.get("group_size") else None,
                        symmetric=bool(weights.get("symmetric", True)), parts=parts, extras=extras, sparse=sparse)


def _ct_modules(names: list[str], quant: Mapping[str, Any], dtypes: Mapping[str, Any]) -> list[PackedModule]:
    present = set(names)
    sparse = {name.rpartition(".")[0] for name in names if name.endswith(".compressed")
              and f"{name.rpartition('.')[0]}.bitmask" in present}
    groups = _ct_groups(quant) if quant.get("config_groups") or not sparse else []
    modules: list[PackedModule] = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        if module in sparse:
            if leaf == "compressed":
                modules.append(_sparse_module(module, quant, groups, present, dtypes))
            continue
        if leaf == "weight_packed":
            stored = "nvfp4" if f"{module}.weight_global_scale" in present else "packed"
        elif leaf == "weight" and f"{module}.weight_scale" in present:
            stored = "int8-or-float8"
        else:
            continue
        if stored == "int8-or-float8" and dtypes.get(name):
            stored = "float8" if str(dtypes[name]).startswith("F8") else "int8"
        if stored == "int8-or-float8":
            guess = [g for g in groups if g.format in ("int-quantized", "float-quantized", "naive-quantized")]
            kind = str((guess[0].weights if guess else {}).get("type", "int"))
            stored = "float8" if kind == "float" else "int8"
        group = _group_for(module, groups, stored)
        weights = group.weights
        fmt = group.format if group.format in CT_FORMATS else {"packed": "pack-quantized", "nvfp4": "nvfp4-pack-quantized",
                                                               "int8": "int-quantized", "float8": "float-quantized"}[stored]
        if group.format in REFUSED_SPARSE:
            fmt = group.format  # listed as what it is; decompress refuses it with the reason
        elif stored in ("packed", "nvfp4") and fmt not in ("pack-quantized", "nvfp4-pack-quantized"):
            fmt = "pack-quantized" if stored == "packed" else "nvfp4-pack-quantized"
        parts = {role: f"{module}.{suffix}" for suffix, role in CT_ROLES.items() if f"{module}.{suffix}" in present}
        if stored not in ("packed", "nvfp4"):
            parts["packed"] = name
        block = weights.get("block_structure")
        strategy = str(weights.get("strategy") or ("group" if weights.get("group_size") else "tensor")).lower()
        modules.append(PackedModule(
            module=module, method="compressed-tensors", format=fmt, bits=int(weights.get("num_bits", 8)),
            kind=str(weights.get("type", "int")).lower(), strategy=strategy,
            group_size=int(weights["group_size"]) if weights.get("group_size") else None,
            symmetric=bool(weights.get("symmetric", True)), parts=parts,
            extras=tuple(f"{module}.{e}" for e in CT_EXTRAS if f"{module}.{e}" in present),
            block=tuple(int(b) for b in block) if isinstance(block, list) and len(block) == 2 else None,  # type: ignore[arg-type]
        ))
    return modules


# -- GPTQ / AWQ -----------------------------------------------------------------------------------------
def _gptq_modules(names: list[str], quant: Mapping[str, Any], method: str) -> list[PackedModule]:
    present = set(names)
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if method == "gptq":
        symmetric = bool(quant.get("sym", True))
        variant = str(quant.get("checkpoint_format") or "gptq").lower()
        desc_act = bool(quant.get("desc_act", False))
    else:
        symmetric = not bool(quant.get("zero_point", True))
        variant = str(quant.get("version", "gemm")).lower()
        desc_act = False
    modules = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf != "qweight":
            continue
        parts = {role: f"{module}.{suffix}" for suffix, role in GPTQ_ROLES.items() if f"{module}.{suffix}" in present}
        modules.append(PackedModule(
            module=module, method=method, format=method, bits=bits, kind="int",
            strategy="group" if group > 0 else "channel", group_size=group if group > 0 else None,
            symmetric=symmetric, parts=parts, desc_act=desc_act, variant=variant,
        ))
    return modules


def packed_shape(module: PackedModule, infos: Mapping[str, Any]) -> tuple[int, ...]:
    """The dense shape of `module`'s weight, from the packed tensor and its scales (metadata only): [rows, cols], or
    [experts, rows, cols] for stacked experts (a 3-D packed tensor, each expert packed as a 2-D weight)."""
    packed = _need(module, "packed", infos)
    if len(packed.shape) not in (2, 3):
        raise MapperError(f"Cannot decompress {packed.name!r}: it is {list(packed.shape)}; a packed weight has 2 dims "
                          "[rows, packed columns], or 3 for stacked experts [experts, rows, packed columns].",
                          tensor=packed.name)
    *lead, rows, stored = packed.shape
    if module.format == "pack-quantized":
        scale = _need(module, "scale", infos)
        widest = stored * 32 // module.bits  # the last word may be partly padding
        if module.strategy == "group" and module.group_size and len(scale.shape) == len(packed.shape):
            by_scale = scale.shape[-1] * module.group_size
            if widest - 32 // module.bits < by_scale <= widest:
                return (*lead, rows, by_scale)
        return (*lead, rows, widest)
    if module.format == "nvfp4-pack-quantized" or module.sparse:  # two FP4 values a byte; 2:4: half of each row kept
        return (*lead, rows, stored * 2)
    return tuple(packed.shape)


def _need(module: PackedModule, role: str, infos: Mapping[str, Any]) -> Any:
    name = module.parts.get(role)
    if name is None or name not in infos:
        wanted = {"packed": "weight_packed / weight", "scale": "weight_scale", "zero_point": "weight_zero_point",
                  "global_scale": "weight_global_scale"}.get(role, role) if module.method == "compressed-tensors" else \
            {"packed": "qweight", "scale": "scales", "zero_point": "qzeros"}.get(role, role)
        raise MapperError(f"Cannot decompress {module.module!r} ({module.format}): its {wanted} tensor is missing. The "
                          "checkpoint is incomplete, or config.json describes another format.", tensor=module.module)
    return infos[name]


def gptq_shape(module: PackedModule, infos: Mapping[str, Any]) -> tuple[int, int]:
    """The dense shape [out, in] of a GPTQ / AWQ `module`'s weight, from qweight and scales (metadata only)."""
    packed = _need(module, "packed", infos)
    scale = _need(module, "scale", infos)
    if len(packed.shape) != 2 or len(scale.shape) != 2 or module.bits not in (2, 3, 4, 8):
        raise MapperError(f"Cannot dequantise {packed.name!r}: qweight {list(packed.shape)} and scales {list(scale.shape)} "
                          f"({module.bits} bits) do not describe a {module.format} weight: both need 2 dims, bits 2, 3, 4 "
                          "or 8.", tensor=packed.name)
    if module.method == "gptq":  # 32 input rows in `bits` words (3 bits: values cross word boundaries)
        return (scale.shape[1], packed.shape[0] * 32 // module.bits)
    if module.variant == "gemv":  # AutoAWQ GEMV: by output rows, packed along the input dim
        return (packed.shape[0], packed.shape[1] * 32 // module.bits)
    return (packed.shape[1] * 32 // module.bits, packed.shape[0])


def dense_shape(module: PackedModule, infos: Mapping[str, Any]) -> tuple[int, ...]:
    """The dense shape of `module`'s weight, whatever its method."""
    return packed_shape(module, infos) if module.method == "compressed-tensors" else gptq_shape(module, infos)


# -- catalog columns -------------------------------------------------------------------------------------
COLUMNS = ("quant_format", "quant_role", "quant_bits", "quant_group", "quant_sym", "quant_parts")


def packed_columns(modules: Iterable[PackedModule]) -> dict[str, dict[str, object]]:
    """Catalog columns (`Catalog.columns`: column -> {tensor -> value}) for the tensors of `modules`:
    `quant_format` ('pack-quantized', 'gptq', 'sparse-24-bitmask + float-quantized', ...), `quant_role` ('packed',
    'scale', 'zero_point', 'g_idx', 'shape', 'global_scale', 'bitmask', 'activation'), `quant_bits`, `quant_group` (group size; 'channel' / 'tensor' / 'RxC' block),
    `quant_sym`, and on the packed tensor `quant_parts`: the tensors that belong to it."""
    columns: dict[str, dict[str, object]] = {name: {} for name in COLUMNS}
    for m in modules:
        group = (str(m.group_size) if m.group_size else f"{m.block[0]}x{m.block[1]}" if m.block else m.strategy)
        roles = {name: role for role, name in m.parts.items()} | {name: "activation" for name in m.extras}
        for name, role in roles.items():
            columns["quant_format"][name] = m.label
            columns["quant_role"][name] = role
            columns["quant_bits"][name] = m.bits
            columns["quant_group"][name] = group
            columns["quant_sym"][name] = m.symmetric
        columns["quant_parts"][m.parts["packed"]] = tuple(n for r, n in m.parts.items() if r != "packed") + m.extras
    return columns


def annotate(catalog: Any, config: Any) -> bool:
    """Add the packed-tensor columns to `catalog` (`columns`, `shown_columns`) when `config` describes a packed
    format; True when it did. A config that cannot be read, or that describes no tensor of the catalog, leaves it."""
    try:
        modules = packed_modules(catalog.tensors, config)
    except (MapperError, OSError, ValueError):
        return False
    if not modules:
        return False
    for column, values in packed_columns(modules).items():
        catalog.columns[column] = values
    catalog.shown_columns = (*catalog.shown_columns, *(c for c in COLUMNS if c not in catalog.shown_columns))
    return True


# names that only a packed weight's parts carry: a catalog without any is not asked for its config.json
PACKED_LEAVES = (".weight_packed", ".weight_scale", ".qweight", ".compressed", ".bitmask")


def annotate_found(catalog: Any) -> bool:
    """`annotate` with the config.json of a catalog's checkpoint: beside a local one (its folder, or the folder of its
    file), or, for a remote one (hf://, https://, s3://), the server's, fetched once per version into the catalog's
    cached folder (`RemoteReader.fetch_file`). Nothing is read (no request made) unless a tensor name is one only a
    packed weight's parts carry (`PACKED_LEAVES`)."""
    catalog = getattr(catalog, "catalog", catalog)
    if not any(name.endswith(PACKED_LEAVES) for name in getattr(catalog, "tensors", {})):
        return False
    found = _remote_config(catalog) if getattr(catalog, "url", "") else _local_config(getattr(catalog, "root", None))
    if found is None:
        return False
    try:
        text = found.read_text(encoding="utf-8")
    except OSError:
        return False
    if "quantization_config" not in text:
        return False
    return annotate(catalog, found)


def _local_config(root: Any) -> Any:
    from pathlib import Path

    if root is None:
        return None
    root = Path(root)
    return next((f / "config.json" for f in ((root,) if root.is_dir() else (root.parent,)) if (f / "config.json").is_file()), None)


def _remote_config(catalog: Any) -> Any:
    from ...errors import WorkbenchError

    fetch = getattr(getattr(catalog, "reader", None), "fetch_file", None)
    if fetch is None:
        return None
    try:
        found = fetch("config.json")
    except (WorkbenchError, OSError):  # a column is not worth a failed open: the table is shown without it
        return None
    return found if found is not None and found.is_file() else None


__all__ = ["CT_FORMATS", "COLUMNS", "PackedModule", "annotate", "annotate_found", "dense_shape", "gptq_shape", "packed_shape", "method_of", "packed_columns", "packed_modules",
           "quant_config"]
