"""Model weights out of training checkpoints, as ordinary mappers that `wb.plan` / `wb.convert` run.

Training checkpoints hold more than a model: optimizer state, trainer progress, EMA copies, under
prefixes a trainer adds (`model.`, `state_dict.`, torch.compile's `_orig_mod.`). The functions here
decide, from metadata alone, which source tensor becomes which model tensor, and express that as a
mapper of `Rename`s with everything else dropped (`rest='drop'`). So an extraction is dry-run-able,
streams with bounded memory, runs on several processes, and exports as code like any other mapper.

- `select_mapper(source, 'model')`: the model part of any training checkpoint (DCP, atorch, torch
  files, Lightning), prefixes stripped; a legacy Megatron folder's rank shards merged (`megatron_merge`);
  `'all'` keeps everything as it is.
- `lightning_mapper(path, ema=True)`: a Lightning `.ckpt` file or FSDP sharded folder, with the EMA
  weights in place of the live ones when they can be matched (by name, or by parameter order when
  exactly one matching exists); `lightning_matching` shows that matching as a table.
- `lightning_to_hf(src, dest, ema=True)`: the conversion itself (HF safetensors, or DCP with `to='dcp'`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..catalog import Catalog
from ..errors import CheckpointError, MapperError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from ..engine.report import RunReport
    from ..mapper import Mapper
    from .lightning import LightningInfo

SELECTIONS = ("model", "all")
LIGHTNING_WEIGHTS = ("ema", "model")
# Where trainers put the model, in order of preference, and top-level keys that are never model weights.
MODEL_CONTAINERS = ("model.", "state_dict.", "model_state_dict.", "module.")
TRAINING_STATE = (
    "optimizer.", "optimizer_", "optim.", "optimizer_states.", "lr_scheduler", "lr_schedulers.", "scheduler.",
    "train_state.", "trainer.", "callbacks.", "loops.", "meta.", "rng", "dataloader", "ema.", "averaging_state.",
)
DROP_SEGMENTS = ("_orig_mod",)


def _catalog_of(source: Any) -> Catalog:
    from ..planning.sources import resolve_catalog

    return resolve_catalog(source)


def renames_mapper(pairs: dict[str, str]) -> Mapper:
    """A mapper taking each source name to its target name (Identity when unchanged); use it with rest='drop'."""
    from .. import mapper as M

    ops: list[Mapper] = []
    for src, dst in pairs.items():
        for name in (src, dst):
            if "{" in name or "}" in name:
                raise MapperError(
                    f"Cannot extract tensor {src!r}: the name {name!r} holds '{{' or '}}', which mapper names read as "
                    "template placeholders. Rename it with a custom mapper first."
                )
        ops.append(M.Identity(src) if src == dst else M.Rename(src, dst))
    if not ops:
        raise MapperError("Cannot build an extraction mapper: no tensor was selected. Check the checkpoint and the selection.")
    return M.Parallel(*ops)


def _is_lightning(catalog: Catalog) -> bool:
    from ..formats.dcp import DcpReader
    from ..formats.torch_zip import TorchZipReader

    reader = catalog.reader
    if isinstance(reader, TorchZipReader):
        root = reader.archive.root
        return isinstance(root, dict) and "pytorch-lightning_version" in root and "state_dict" in root
    return isinstance(reader, DcpReader) and reader.meta_reader is not None


def model_tensors(catalog: Catalog, *, drop_segments: Sequence[str] = DROP_SEGMENTS) -> dict[str, str]:
    """Source tensor -> model name for the model part of a training checkpoint (no data read).

    Lightning checkpoints: the LightningModule's live weights, `model.` stripped. DeepSpeed: the listed
    weights under their own names (`model.` is part of an HF model's names there). Otherwise the first
    container among `model.`, `state_dict.`, `model_state_dict.`, `module.` that the checkpoint has,
    stripped; or, when there is none, every tensor not under a training-state key (optimizer, scheduler,
    trainer/callback state ...). `_orig_mod` segments (torch.compile) are removed from names.
    """
    from .lightning import strip_prefixes

    if _is_lightning(catalog):
        return extraction_pairs(_lightning_info(catalog), ema=False)
    names = list(catalog.tensors)
    if catalog.format == "deepspeed":  # already the model's own names; optimizer moments only when opened with them
        return {n: n for n in names if not n.startswith(TRAINING_STATE)}
    for container in MODEL_CONTAINERS:
        inside = [n for n in names if n.startswith(container)]
        if inside:
            return strip_prefixes(inside, (container,), drop_segments)
    rest = [n for n in names if not n.startswith(TRAINING_STATE)]
    return strip_prefixes(rest, (), drop_segments)


def select_mapper(source: Any, select: str = "model") -> tuple[Mapper | None, str]:
    """(mapper, rest policy) that keep `select` of a checkpoint: 'model' (weights, prefixes stripped) or 'all'."""
    if select not in SELECTIONS:
        raise MapperError(f"Cannot select {select!r} of a checkpoint: choose one of {', '.join(map(repr, SELECTIONS))}.")
    if select == "all":
        return None, "keep"
    catalog = _catalog_of(source)
    if catalog.format == "megatron" and catalog.metadata.get("layout") == "legacy":  # rank shards: the TP/PP merge
        from ..mapper.presets.megatron import megatron_merge

        return megatron_merge(catalog), "drop"
    return renames_mapper(model_tensors(catalog)), "drop"


# ---------------------------------------------------------------------------------------------- Lightning


def _lightning_info(source: Any) -> LightningInfo:
    from .lightning import LightningInfo, lightning_info

    if isinstance(source, LightningInfo):
        return source
    return lightning_info(_catalog_of(source))


def _param_names(param_names: Any, weights: dict[str, str], prefixes: Sequence[str]) -> list[str] | None:
    """Names in the LightningModule's terms from a list of names or a torch module's named_parameters()."""
    if param_names is None:
        return None
    named = getattr(param_names, "named_parameters", None)
    names = [n for n, p in named() if getattr(p, "requires_grad", True)] if named is not None else list(param_names)
    out = []
    for name in names:
        if name in weights:
            out.append(name)
            continue
        found = next((p + name for p in prefixes if p + name in weights), None)
        out.append(found if found is not None else name)  # unknown names are refused by the matcher, by name
    return out


def _matching(
    info: LightningInfo, ema: bool, source: str | None, param_names: Any, prefixes: Sequence[str],
) -> list[tuple[str, str, str]]:
    """(weight name, source tensor, taken from) for every weight of the LightningModule."""
    weights = info.weight_sources()
    if not weights:
        raise CheckpointError(f"Cannot extract weights from {info.path}: it holds no model weights (no state_dict / model entries).",
                              file=str(info.path))
    matches = info.ema_matches(source, _param_names(param_names, weights, prefixes)) if ema else {}
    rows = []
    for weight, live in weights.items():
        if weight in matches:
            src, how = matches[weight]
            rows.append((weight, src, f"ema (by {how})"))
        else:
            rows.append((weight, live, "model"))
    return rows


def extraction_pairs(
    source: Any, *, ema: bool = True, ema_source: str | None = None, param_names: Any = None,
    prefixes: Sequence[str] = ("model.",), drop_segments: Sequence[str] = DROP_SEGMENTS,
) -> dict[str, str]:
    """Source tensor -> model name for a Lightning checkpoint's weights (EMA ones when `ema`)."""
    from .lightning import strip_prefixes

    info = _lightning_info(source)
    rows = _matching(info, ema, ema_source, param_names, prefixes)
    names = strip_prefixes([w for w, _, _ in rows], prefixes, drop_segments)
    return {src: names[w] for w, src, _ in rows}


def lightning_matching(
    source: Any, *, ema: bool = True, ema_source: str | None = None, param_names: Any = None,
    prefixes: Sequence[str] = ("model.",), drop_segments: Sequence[str] = DROP_SEGMENTS,
) -> pd.DataFrame:
    """The extraction as a table: output name, LightningModule weight, source tensor, taken from, dtype, shape.

    `taken_from` is 'ema (by name)', 'ema (by order)' or 'model' (no EMA copy: buffers, frozen weights, or
    `ema=False`). Raises CheckpointError when EMA is asked for and cannot be matched unambiguously.
    """
    import pandas as pd

    from .lightning import strip_prefixes

    info = _lightning_info(source)
    rows = _matching(info, ema, ema_source, param_names, prefixes)
    names = strip_prefixes([w for w, _, _ in rows], prefixes, drop_segments)
    data = [(names[w], w, src, how, info.catalog[src].dtype, info.catalog[src].shape) for w, src, how in rows]
    return pd.DataFrame(data, columns=["output", "weight", "source", "taken_from", "dtype", "shape"]).set_index("output")


def lightning_mapper(
    source: Any, *, ema: bool = True, ema_source: str | None = None, param_names: Any = None,
    prefixes: Sequence[str] = ("model.",), drop_segments: Sequence[str] = DROP_SEGMENTS,
) -> Mapper:
    """The mapper that extracts a Lightning checkpoint's model (EMA weights when `ema`); plan it with rest='drop'.

    `ema_source` picks one EMA container when several exist; `param_names` (names, or a torch module whose
    `named_parameters()` order the EMA list follows) resolves an order matching that is otherwise ambiguous.
    """
    pairs = extraction_pairs(source, ema=ema, ema_source=ema_source, param_names=param_names, prefixes=prefixes,
                             drop_segments=drop_segments)
    return renames_mapper(pairs)


def lightning_to_hf(
    src: str | os.PathLike | Any,
    dest: str | os.PathLike,
    ema: bool = True,
    *,
    ema_source: str | None = None,
    param_names: Any = None,
    prefixes: Sequence[str] = ("model.",),
    drop_segments: Sequence[str] = DROP_SEGMENTS,
    to: str = "safetensors",
    **convert_options: Any,
) -> RunReport:
    """Extract a Lightning checkpoint's model into HF safetensors (or DCP with `to='dcp'`), streaming.

    Works on a `.ckpt` file and on an FSDP sharded `*.ckpt/` folder. `ema=True` takes the EMA weights
    (refusing when they cannot be matched to names unambiguously); `prefixes` are stripped from the
    LightningModule's names and `drop_segments` removed. Other keyword arguments go to `wb.convert`
    (shard_size, dtype, nproc, overwrite, quiet ...). Dry-run first with `wb.plan(src, lightning_mapper(src),
    rest='drop')`.
    """
    from ..conversion import convert

    info = _lightning_info(src)
    mapper = lightning_mapper(info, ema=ema, ema_source=ema_source, param_names=param_names, prefixes=prefixes,
                              drop_segments=drop_segments)
    convert_options.setdefault("rest", "drop")
    return convert(info.catalog, dest, mapper, to=to, **convert_options)


def training_mapper(source: Any, *, select: str | None = None, lightning_weights: str | None = None,
                    mapper: Any = None, rest: str = "keep") -> tuple[Any, str]:
    """(mapper, rest) for the CLI's --select / --lightning-weights options, composed before a user mapper."""
    from .. import mapper as M

    if select is not None and lightning_weights is not None:
        raise MapperError("Cannot use --select and --lightning-weights together: --lightning-weights already selects the model.")
    if lightning_weights is not None:
        if lightning_weights not in LIGHTNING_WEIGHTS:
            raise MapperError(f"Cannot extract Lightning weights {lightning_weights!r}: choose 'ema' or 'model'.")
        first, first_rest = lightning_mapper(source, ema=lightning_weights == "ema"), "drop"
    elif select is not None:
        first, first_rest = select_mapper(source, select)
    else:
        return mapper, rest
    if first is None:
        return mapper, rest
    return (first if mapper is None else M.Sequential(first, mapper)), first_rest


__all__ = [
    "LIGHTNING_WEIGHTS", "SELECTIONS", "extraction_pairs", "lightning_mapper", "lightning_matching", "lightning_to_hf",
    "model_tensors", "renames_mapper", "select_mapper", "training_mapper",
]
