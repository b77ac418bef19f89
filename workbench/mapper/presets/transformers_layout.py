"""`from_transformers(config)`: the checkpoint layout -> the layout transformers 5 holds in memory.

Built at run time from transformers' own conversion registry (`conversion_mapping.py`), not from a
copy of it: the rules for the model type are collected with `get_model_conversion_mapping` on the
model built on the meta device, every checkpoint name goes through transformers' own
`rename_source_key`, and each `WeightConverter`'s operations are translated into workbench steps:

| transformers op | workbench steps |
|---|---|
| `MergeModulelist(dim)` | `Stack` over a range `{e*}` (every expert, natural order) |
| `Concatenate(dim)` | `Concat` |
| `Chunk(dim)` / `Split(dim)` | `Split` (equal parts / sizes of the model's parameters) |
| `Transpose(d0, d1)` | `Transpose` |
| `Interleave`, `PermuteForRope`, `Conv3dToLinear`, `LinearToConv3d` | `Reshape` + `Transpose` + `Reshape` / `Reshape` |

Any other operation becomes `Unsupported` naming it, and so does a tensor the model has no parameter
for (from_pretrained would drop it): the plan reports them, nothing is skipped. Each translated
group is checked against transformers itself, by running the converter on meta tensors (names and
shapes must agree). Concrete steps are then folded into templates (`{i}` for layers, `{e*}` for
experts), and the folded mapper is kept only if it binds to exactly the same outputs.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import MapperError
from ..base import Mapper
from ..compose import Parallel, Sequential
from ..ops import Concat, Rename, Reshape, Split, Stack, Transpose
from ..unsupported import Unsupported

TRANSLATED = ("MergeModulelist", "Concatenate", "Chunk", "Split", "Transpose", "Interleave", "PermuteForRope",
              "Conv3dToLinear", "LinearToConv3d")


# -- config and model ---------------------------------------------------------------------------------------
def load_config(config: Any) -> Any:
    """A transformers config from a config.json path or its folder, a dict, a config object or a model_type."""
    try:
        from transformers import AutoConfig, PretrainedConfig
    except ImportError:  # pragma: no cover - transformers is a dependency of this preset
        raise MapperError("Cannot build the transformers layout: transformers is not installed. pip install 'transformers>=5'.") from None
    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise MapperError(f"Cannot read {path}: {exc}. Pass a valid config.json.", file=str(path)) from None
        elif isinstance(config, str) and re.fullmatch(r"[A-Za-z0-9_\-]+", config):
            try:
                return AutoConfig.for_model(config)
            except (ValueError, KeyError):
                raise MapperError(f"Cannot build the transformers layout: {config!r} is not a model_type transformers knows. "
                                  "Pass a config.json path, a dict or a model_type such as 'mixtral'.") from None
        else:
            raise MapperError(f"Cannot build the transformers layout: {str(config)!r} is neither a config.json, a folder "
                              "holding one, nor a model_type. Pass the checkpoint's config.json.")
    if isinstance(config, Mapping):
        data = dict(config)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise MapperError("Cannot build the transformers layout: the config has no model_type. Pass the checkpoint's config.json.")
        try:
            return AutoConfig.for_model(model_type, **data)
        except (ValueError, KeyError, TypeError) as exc:
            raise MapperError(f"Cannot build the transformers layout for model_type {model_type!r}: {exc}.") from None
    raise MapperError(f"Cannot build the transformers layout from a {type(config).__name__}: pass a config.json path, a dict, "
                      "a transformers config or a model_type.")


def meta_model(config: Any) -> Any:
    """The model of `config` on the meta device (no memory): the class named in `architectures`, else the causal LM."""
    import torch
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    classes = [getattr(transformers, name, None) for name in names]
    candidates = [cls for cls in classes if cls is not None] + [transformers.AutoModelForCausalLM, transformers.AutoModel]
    quiet = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    problems = []
    try:
        for cls in candidates:
            try:
                with torch.device("meta"):
                    build = getattr(cls, "from_config", None) if cls.__name__.startswith("Auto") else cls._from_config
                    return build(config)
            except (ValueError, TypeError, AttributeError, KeyError) as exc:
                problems.append(f"{cls.__name__}: {exc}")
    finally:
        transformers.logging.set_verbosity(quiet)
    raise MapperError(f"Cannot build the transformers layout for {config.model_type!r}: no model class builds from the config "
                      f"({'; '.join(problems)[:300]}).")


# -- symbolic values --------------------------------------------------------------------------------------
class Slot:
    """One tensor value while translating a converter: its name (fixed for sources, chosen at the end for
    the others), its metadata, and the stage after which it exists."""

    __slots__ = ("name", "dtype", "shape", "stage", "source", "hint")

    def __init__(self, dtype: str, shape: tuple[int, ...], *, name: str | None = None, stage: int = 0, hint: str = "") -> None:
        self.name, self.dtype, self.shape, self.stage = name, dtype, tuple(shape), stage
        self.source = name is not None
        self.hint = hint


class Steps:
    """Workbench steps emitted over slots, each at the first stage after its inputs exist."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, str, list[Slot], list[Slot], dict[str, Any]]] = []

    def emit(self, kind: str, ins: list[Slot], outs: list[Slot], **params: Any) -> None:
        stage = 1 + max(slot.stage for slot in ins)
        for slot in outs:
            slot.stage = stage
        self.steps.append((stage, kind, ins, outs, params))

    def rewrite(self, slot: Slot, kind: str, **params: Any) -> Slot:
        """A one-to-one step (reshape, transpose): in place on intermediates, into a new slot for sources."""
        shape = params.pop("shape_out")
        if slot.source:
            out = Slot(slot.dtype, shape, hint=slot.hint)
            self.emit(kind, [slot], [out], **params)
            return out
        before = slot.stage
        slot.shape = tuple(shape)
        slot.stage = before + 1
        self.steps.append((before + 1, kind, [slot], [slot], params))
        return slot


def _drop_range_segment(names: list[str]) -> str:
    """A readable name for the stack of `names`: the first name without the segment in which they differ."""
    parts = [name.split(".") for name in names]
    if len({len(p) for p in parts}) == 1:
        differing = [k for k in range(len(parts[0])) if len({p[k] for p in parts}) > 1]
        if len(differing) == 1:
            return ".".join(parts[0][: differing[0]] + parts[0][differing[0] + 1:])
    return names[0] + ".stacked"


class Unsupportable(Exception):
    """A converter operation this module cannot express (carries the operation's name)."""


def _chunk_sizes(length: int, parts: int) -> list[int]:
    size = math.ceil(length / parts) if parts else 0
    sizes = []
    while length > 0 and size:
        sizes.append(min(size, length))
        length -= size
    return sizes


def _translate(op: Any, state: dict[str, list[Slot]], converter: Any, steps: Steps, context: dict[str, Any]) -> dict[str, list[Slot]]:
    """One transformers ConversionOps applied to the symbolic state, mirroring its `convert` key by key."""
    kind = type(op).__name__
    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    if kind == "MergeModulelist":
        out: dict[str, list[Slot]] = {}
        for pattern, slots in state.items():
            key = targets[0] if len(state) == 1 and len(targets) == 1 else pattern
            if len(state) == 1 and len(targets) > 1:
                raise Unsupportable(kind)
            shape = list(slots[0].shape)
            dim = op.dim % (len(shape) + 1)
            stacked = Slot(slots[0].dtype, tuple(shape[:dim] + [len(slots)] + shape[dim:]),
                           hint=_drop_range_segment([s.name for s in slots]) if all(s.source for s in slots) else "")
            steps.emit("Stack", slots, [stacked], dim=op.dim)
            out[key] = [stacked]
        return out
    if kind == "Concatenate":
        if len(targets) > 1 or getattr(op, "num_shards_attribute", None) is not None:
            raise Unsupportable(kind)
        slots = [slot for pattern in sources if pattern in state for slot in state[pattern]]
        dim = op.dim % len(slots[0].shape)
        shape = list(slots[0].shape)
        shape[dim] = sum(slot.shape[dim] for slot in slots)
        joined = Slot(slots[0].dtype, tuple(shape))
        steps.emit("Concat", slots, [joined], dim=op.dim)
        return {targets[0]: [joined]}
    if kind in ("Chunk", "Split"):
        if len(state) != 1 or getattr(op, "num_shards_attribute", None) is not None:
            raise Unsupportable(kind)
        (slot,) = next(iter(state.values()))[:1]
        dim = op.dim % len(slot.shape)
        if kind == "Chunk":
            sizes = _chunk_sizes(slot.shape[dim], len(targets))
        else:
            model, layer = context["model"], context["layer"]
            sizes = [model.get_parameter(layer.replace(targets[0], target)).shape[op.dim] for target in targets]
        parts = []
        for size in sizes:
            shape = list(slot.shape)
            shape[dim] = size
            parts.append(Slot(slot.dtype, tuple(shape)))
        steps.emit("Split", [slot], parts, sizes=tuple(sizes), dim=op.dim)
        return {target: [part] for target, part in zip(targets, parts, strict=False)}
    if kind == "Transpose":
        if len(state) != 1:
            raise Unsupportable(kind)
        key = (sources[0] if len(sources) == 1 else None) if len(targets) > 1 else targets[0]
        if key is None:
            raise Unsupportable(kind)
        (slot,) = next(iter(state.values()))[:1]
        if getattr(op, "check_dims", False):
            expected = tuple(context["model"].get_parameter(context["layer"]).shape)
            if slot.shape == expected:
                return {key: [slot]}
        shape = list(slot.shape)
        shape[op.dim0], shape[op.dim1] = shape[op.dim1], shape[op.dim0]
        return {key: [steps.rewrite(slot, "Transpose", dim0=op.dim0, dim1=op.dim1, shape_out=tuple(shape))]}
    if kind == "Interleave":
        (slot,) = next(iter(state.values()))[:1]
        shape = list(slot.shape)
        dim = op.dim % len(shape)
        if shape[dim] % 2:
            raise Unsupportable(f"{kind} of an odd size")
        split = [2, shape[dim] // 2] if op.inverse else [shape[dim] // 2, 2]
        viewed = tuple(shape[:dim] + split + shape[dim + 1:])
        swapped = list(viewed)
        swapped[dim], swapped[dim + 1] = swapped[dim + 1], swapped[dim]
        slot = steps.rewrite(slot, "Reshape", shape=viewed, shape_out=viewed)
        slot = steps.rewrite(slot, "Transpose", dim0=dim, dim1=dim + 1, shape_out=tuple(swapped))
        slot = steps.rewrite(slot, "Reshape", shape=tuple(shape), shape_out=tuple(shape))
        return {targets[0]: [slot]}
    if kind == "PermuteForRope":
        out = {}
        config = context["config"]
        if op.subconfig_key is not None:
            config = getattr(config, op.subconfig_key, config)
        heads = getattr(config, "num_attention_heads", 1)
        for pattern, slots in state.items():
            if (len(targets) > 1 and len(sources) == 1) or (len(targets) == 1 and len(sources) > 1):
                key = pattern
            elif len(targets) == 1 and len(sources) == 1:
                key = targets[0]
            else:
                raise Unsupportable(kind)
            (slot,) = slots[:1]
            if op.permute_layer_names is not None and not any(name in pattern for name in op.permute_layer_names):
                out[key] = [slot]
                continue
            rows = slot.shape[0]
            half = rows // heads // 2
            if len(slot.shape) not in (1, 2) or heads * 2 * half != rows:
                raise Unsupportable(f"{kind} of shape {list(slot.shape)} with {heads} heads")
            head = (2, half) if op.inverse else (half, 2)
            tail = tuple(slot.shape[1:])
            viewed = (heads, *head, *tail)
            swapped = (heads, head[1], head[0], *tail)
            slot = steps.rewrite(slot, "Reshape", shape=viewed, shape_out=viewed)
            slot = steps.rewrite(slot, "Transpose", dim0=1, dim1=2, shape_out=swapped)
            slot = steps.rewrite(slot, "Reshape", shape=(rows, *tail), shape_out=(rows, *tail))
            out[key] = [slot]
        return out
    if kind in ("Conv3dToLinear", "LinearToConv3d"):
        (slot,) = next(iter(state.values()))[:1]
        key = targets[0] if len(targets) == 1 else sources[0]
        if kind == "Conv3dToLinear":
            if len(slot.shape) == 2:
                return {key: [slot]}
            shape = (slot.shape[0], math.prod(slot.shape[1:]))
        else:
            shape = (slot.shape[0], op.in_channels, *op.kernel_size)
        return {key: [steps.rewrite(slot, "Reshape", shape=shape, shape_out=shape)]}
    raise Unsupportable(kind)


def _full_names(layer: str, outputs: dict[str, list[Slot]]) -> dict[str, Slot]:
    """Final names as `WeightConverter.convert` makes them: the target pattern framed by the layer name's prefix and suffix."""
    full = layer.replace("*.", "0.") if "*." in layer else layer
    found = next((full.partition(key) for key in outputs if key in full), None)
    if found is None:
        return {key: slots[0] for key, slots in outputs.items()}
    prefix, _, suffix = found
    return {prefix + key + suffix: slots[0] for key, slots in outputs.items()}


def _check_with_transformers(converter: Any, layer: str, collected: dict[str, list[str]], metas: dict[str, tuple[str, tuple[int, ...]]],
                             model: Any, named: dict[str, Slot]) -> str | None:
    """Run transformers' own converter on meta tensors: None when its names and shapes equal ours, else why not."""
    import torch

    from ...dtypes import to_torch

    twin = copy.deepcopy(converter)
    for pattern, keys in collected.items():
        twin.collected_tensors[pattern] = [torch.empty(metas[k][1], dtype=to_torch(metas[k][0]), device="meta") for k in keys]
    try:
        result = twin.convert(layer, model=model, config=model.config)
    except Exception as exc:  # noqa: BLE001 - any failure of the reference is reported, not raised
        return f"transformers' own {type(converter).__name__} fails on these tensors ({type(exc).__name__}: {exc})"
    theirs = {name: tuple((value[0] if isinstance(value, list) else value).shape) for name, value in result.items()}
    ours = {name: slot.shape for name, slot in named.items()}
    if theirs != ours:
        return f"the translated steps give {ours} but transformers gives {theirs}"
    return None


# -- derivation ------------------------------------------------------------------------------------------
def derive(config: Any, source: Any | None = None) -> tuple[list[tuple[int, str, list[str], list[str], dict[str, Any]]], dict[str, Any]]:
    """Concrete steps (stage, kind, inputs, outputs, params) taking `source`'s names to the in-memory layout.

    Without a source, the names are those transformers itself writes on save (its reverse conversion of
    the meta model's state dict). Returns the steps and the names they start from (name -> (dtype, shape)).
    """
    steps, metas = _derive_slots(config, source)
    return _named(steps), metas


def _named(steps: list[tuple[int, str, list[Slot], list[Slot], dict[str, Any]]]) -> list[tuple[int, str, list[str], list[str], dict[str, Any]]]:
    return [(stage, kind, [s.name for s in ins], [s.name for s in outs], params)  # type: ignore[misc]
            for stage, kind, ins, outs, params in steps]


def _derive_slots(config: Any, source: Any | None) -> tuple[list[tuple[int, str, list[Slot], list[Slot], dict[str, Any]]], dict[str, Any]]:
    """`derive`, its steps over slots (names, dtypes and final shapes)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
            revert_weight_conversion,
        )
    except ImportError as exc:
        raise MapperError(f"Cannot build the transformers layout: it reads transformers 5's conversion registry, which this "
                          f"transformers lacks ({exc}). pip install 'checkpoint-workbench[transformers]' (transformers>=5).") from None

    from ...dtypes import from_torch
    from ..bind import source_infos

    cfg = load_config(config)
    model = meta_model(cfg)
    expected = model.state_dict()
    if source is None:
        saved = revert_weight_conversion(model, dict(expected))
        metas = {name: (from_torch(t.dtype), tuple(t.shape)) for name, t in saved.items()}
    else:
        metas = {info.name: (info.dtype, tuple(info.shape)) for info in source_infos(source)}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: conv for conv in converters for pattern in conv.source_patterns}

    steps = Steps()
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    slots: dict[str, Slot] = {}
    unexpected: list[str] = []
    checked: set[tuple] = set()  # kinds of layer transformers' own converter agreed on
    for key in sorted(metas, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if renamed not in expected and key in expected:
            renamed, pattern = key, None
        if renamed not in expected:
            unexpected.append(key)
            continue
        if pattern is None:
            if renamed != key:
                source_slot = Slot(*metas[key], name=key)
                steps.emit("Rename", [source_slot], [Slot(*metas[key], name=renamed)])
            continue
        groups.setdefault(renamed, (by_pattern[pattern], {}))[1].setdefault(pattern, []).append(key)

    for layer, (converter, collected) in groups.items():
        keys = [k for ks in collected.values() for k in ks]
        state = {pattern: [slots.setdefault(k, Slot(*metas[k], name=k)) for k in ks] for pattern, ks in collected.items()}
        trial = Steps()
        context = {"model": model, "config": model.config, "layer": layer}
        try:
            for op in converter.operations:
                state = _translate(op, state, converter, trial, context)
        except Unsupportable as exc:
            steps.emit("Unsupported", [slots[k] for k in keys], [],
                       reason=f"transformers converts it with {exc.args[0]}, which has no workbench equivalent here. "
                              "Convert these tensors by hand, or drop them.")
            continue
        except Exception as exc:  # noqa: BLE001 - a converter that does not fit its tensors is reported
            steps.emit("Unsupported", [slots[k] for k in keys], [],
                       reason=f"translating transformers' {[type(o).__name__ for o in converter.operations]} failed "
                              f"({type(exc).__name__}: {exc}).")
            continue
        named = _full_names(layer, state)
        # Layers differing only in their numbers, with the same tensors, convert alike: transformers' own converter
        # runs once for each such kind (58 MoE layers of DeepSeek-V3: 2 runs, not 116).
        kind = (id(converter), _DIGIT_RUN.sub("#", layer), tuple((pattern, tuple(metas[k] for k in ks)) for pattern, ks in collected.items()),
                tuple(sorted((_DIGIT_RUN.sub("#", name), slot.dtype, slot.shape) for name, slot in named.items())))
        why = None if kind in checked else _check_with_transformers(converter, layer, collected, metas, model, named)
        if why is None:
            checked.add(kind)
            why = next((f"transformers' model has no parameter {name!r} of shape {list(slot.shape)}" for name, slot in named.items()
                        if name not in expected or tuple(expected[name].shape) != slot.shape), None)
        if why is not None:
            steps.emit("Unsupported", [slots[k] for k in keys], [], reason=f"{why}. Convert these tensors by hand, or drop them.")
            continue
        for name, slot in named.items():
            if slot.source:  # the converter only renamed it
                trial.emit("Rename", [slot], [Slot(slot.dtype, slot.shape, name=name)])
            else:
                slot.name = name
        for stage, kind, ins, outs, params in trial.steps:
            for slot in outs:
                if slot.name is None:
                    slot.name = slot.hint or f"{layer}.part{len(steps.steps)}"
            steps.steps.append((stage, kind, ins, outs, params))
    for key in unexpected:
        steps.emit("Unsupported", [Slot(*metas[key], name=key)], [],
                   reason=f"transformers' {type(model).__name__} has no parameter for it, so from_pretrained would drop it as "
                          "unexpected. Drop it explicitly (M.Drop) if that is intended, or check the model type and config.")
    return steps.steps, metas


# -- building and folding ------------------------------------------------------------------------------------
def _leaf(kind: str, ins: list[str], outs: list[str], params: dict[str, Any]) -> Mapper:
    if kind == "Rename":
        return Rename(ins[0], outs[0])
    if kind == "Stack":
        return Stack(ins, outs[0], dim=params["dim"])
    if kind == "Concat":
        return Concat(ins, outs[0], dim=params["dim"])
    if kind == "Split":
        sizes = params["sizes"]
        return Split(ins[0], outs, sizes=None if len(set(sizes)) == 1 else sizes, dim=params["dim"])
    if kind == "Transpose":
        return Transpose(ins[0], params["dim0"], params["dim1"], dst=None if outs[0] == ins[0] else outs[0])
    if kind == "Reshape":
        return Reshape(ins[0], params["shape"], dst=None if outs[0] == ins[0] else outs[0])
    if kind == "Unsupported":
        return Unsupported(ins, params["reason"])
    raise MapperError(f"Cannot build step {kind}.")  # pragma: no cover


_DIGITS = re.compile(r"^\d+$")
_DIGIT_RUN = re.compile(r"\d+")
_LETTERS = "ijklmnpqrs"


def _ranged(names: list[str]) -> list[str]:
    """Stack inputs differing in one all-digit segment, consecutive in order: one `{e*}` name."""
    if len(names) < 2:
        return names
    parts = [name.split(".") for name in names]
    if len({len(p) for p in parts}) != 1:
        return names
    differing = [k for k in range(len(parts[0])) if len({p[k] for p in parts}) > 1]
    if len(differing) != 1:
        return names
    values = [p[differing[0]] for p in parts]
    if not all(_DIGITS.match(v) for v in values) or [int(v) for v in values] != list(range(int(values[0]), int(values[0]) + len(values))):
        return names
    template = list(parts[0])
    template[differing[0]] = "{e*}"
    return [".".join(template)]


def _fold_stage(steps: list[tuple[str, list[str], list[str], dict[str, Any]]]) -> list[Mapper]:
    """Fold one stage's concrete steps into templated ones: digit segments become {i}, {j}..., tied across names."""
    grouped: dict[Any, list[tuple[list[str], list[str], str, dict[str, Any]]]] = {}
    for kind, ins, outs, params in steps:
        if kind in ("Stack",):
            ins = _ranged(ins)
        shape = tuple("#" if _DIGITS.match(seg) else seg for name in ins + outs for seg in name.split(".") + ["|"])
        key = (kind, repr(sorted(params.items())), len(ins), len(outs), shape)
        grouped.setdefault(key, []).append((ins, outs, kind, params))
    out: list[Mapper] = []
    for members in grouped.values():
        folded = _fold_group(members)
        if folded is not None:
            out.append(folded)
        else:
            out.extend(_leaf(kind, ins, outs, params) for ins, outs, kind, params in members)
    return out


def _fold_group(members: list[tuple[list[str], list[str], str, dict[str, Any]]]) -> Mapper | None:
    ins0, outs0, kind, params = members[0]
    first = ins0[0].split(".")
    positions = [k for k, seg in enumerate(first) if _DIGITS.match(seg)]
    if not positions:
        return None if len(members) > 1 else _leaf(kind, ins0, outs0, params)
    letters = {pos: _LETTERS[n] for n, pos in enumerate(positions[: len(_LETTERS)])}
    if len(letters) != len(positions):
        return None

    def template(index: int) -> str | None:
        """Name `index` (inputs then outputs) with each digit segment tied to a placeholder of the first input."""
        segments = (ins0 + outs0)[index].split(".")
        used: set[str] = set()
        for k, seg in enumerate(segments):
            if not _DIGITS.match(seg):
                continue
            tie = next((letters[p] for p in positions
                        if all((m[0] + m[1])[index].split(".")[k] == m[0][0].split(".")[p] for m in members)), None)
            if tie is None:
                return None
            segments[k] = "{" + tie + "}"
            used.add(tie)
        return ".".join(segments) if used == set(letters.values()) else None

    names = [template(index) for index in range(len(ins0) + len(outs0))]
    if any(name is None for name in names):
        return None
    try:
        return _leaf(kind, names[: len(ins0)], names[len(ins0):], params)  # type: ignore[arg-type]
    except MapperError:
        return None


def _assemble(stages: dict[int, list[Mapper]]) -> Mapper:
    parts = [Parallel(*ops) if len(ops) > 1 else ops[0] for _, ops in sorted(stages.items()) if ops]
    return parts[0] if len(parts) == 1 else Sequential(*parts)


def from_transformers(config: Any, source: Any | None = None) -> Mapper:
    """The mapper turning a checkpoint's layout into the one transformers 5 holds in memory for its model type.

    `config`: a config.json path (or the folder holding it), a dict, a transformers config, or a model_type.
    `source` (optional): the checkpoint to derive the steps from (a path, Checkpoint or Catalog); by default
    the folder of `config` when it holds weights, else the layout transformers itself saves for `config`.
    The steps are folded into templates, so the mapper also fits other sizes of the same family;
    `.inverse(source)` gives the save direction. Steps transformers performs that have no workbench
    equivalent, and tensors the model has no parameter for, are `Unsupported` steps: plan problems.

    A quantised checkpoint (FP8 weights with `*_scale_inv`, MXFP4 `*_blocks` + `*_scales`) is derived as the
    dequantising presets leave it, so the obvious recipe needs no config editing:
    `M.Sequential(M.presets.dequantize_fp8(config), M.presets.from_transformers(config))`. Its scales are then
    covered by a `Claim` at the end: consumed by the dequantising step before it, they raise nothing; used alone
    on the quantised folder, the plan names them and says to dequantise first.
    """
    if source is None and isinstance(config, (str, os.PathLike)):
        folder = Path(config)
        folder = folder if folder.is_dir() else folder.parent
        if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
            source = str(folder)
    kinds: list[str] = []
    if source is not None:
        from ..bind import source_infos
        from .folder_infos import folder_infos
        from .quantized import dequantized_view

        infos = folder_infos(source) if isinstance(source, (str, os.PathLike)) else source_infos(source)
        source, kinds = dequantized_view(infos, config=config)
    slot_steps, metas = _derive_slots(config, source)
    steps = _named(slot_steps)
    stages: dict[int, list[tuple[str, list[str], list[str], dict[str, Any]]]] = {}
    for stage, kind, ins, outs, params in steps:
        stages.setdefault(stage, []).append((kind, ins, outs, params))
    concrete = _assemble({stage: [_leaf(*step) for step in found] for stage, found in stages.items()}) if steps else Sequential()
    folded = _assemble({stage: _fold_stage(found) for stage, found in stages.items()}) if steps else Sequential()
    if source is None:
        from ...catalog import TensorInfo

        source = {name: TensorInfo(name, dtype, shape) for name, (dtype, shape) in metas.items()}
    chosen = folded if _same_outputs(folded, concrete, source, _outputs_of(slot_steps, source)) else concrete
    if not kinds:
        return chosen
    from .quantized import quantised_claim

    steps_of = list(chosen.mappers) if type(chosen) is Sequential else [chosen]
    return Sequential(*steps_of, quantised_claim(kinds, "from_transformers"))


def _outputs_of(steps: list[tuple[int, str, list[Slot], list[Slot], dict[str, Any]]], source: Any) -> dict[str, tuple] | None:
    """What the concrete steps leave (name -> (dtype, shape)), worked out from their slots, stage by stage as the
    concrete mapper runs them; None when a step is `Unsupported` (its problems are the binder's to count)."""
    from ..bind import source_infos

    if any(kind == "Unsupported" for _, kind, _, _, _ in steps):
        return None
    state = {info.name: (info.dtype, tuple(info.shape)) for info in source_infos(source)}
    for stage in sorted({step[0] for step in steps}):
        at = [step for step in steps if step[0] == stage]
        for _, _, ins, _, _ in at:
            for slot in ins:
                state.pop(slot.name, None)
        for _, _, _, outs, _ in at:
            state.update((slot.name, (slot.dtype, slot.shape)) for slot in outs)
    return state


def _same_outputs(folded: Mapper, concrete: Mapper, source: Any, expected: dict[str, tuple] | None = None) -> bool:
    """Whether the folded mapper does what the concrete one does on `source`: the same outputs (names, dtypes,
    shapes) and as many problems. `expected`: the concrete one's outputs when known without binding it (no problems)."""
    a = folded.bind(source)
    ours = {k: (v.dtype, tuple(v.shape)) for k, v in a.outputs.items()}
    if expected is not None:
        return not a.problems and ours == expected
    b = concrete.bind(source)
    return len(a.problems) == len(b.problems) and ours == {k: (v.dtype, tuple(v.shape)) for k, v in b.outputs.items()}
