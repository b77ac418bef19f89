"""Legacy Megatron checkpoints (format 'megatron'): each tensor- and pipeline-parallel rank's own shards.

Megatron-LM's `save_checkpoint` (checkpoint format 'torch') writes, for TP size T and PP size P:
- `run/latest_checkpointed_iteration.txt`: the iteration (or `release`);
- `run/iter_0000100/mp_rank_TT/model_optim_rng.pt` (P = 1) or `mp_rank_TT_PPP/` (P > 1), plus `_EEE` for an
  expert-parallel rank: one `torch.save` of {'args': argparse.Namespace, 'checkpoint_version', 'iteration',
  'model': the rank's state dict, 'optimizer', 'opt_param_scheduler', 'rng_state'}.

Each rank's file holds its *local* shard of every parameter (and, under pipeline parallelism, the layers of
its stage numbered from 0). This reader lists those shards as they are, named `<rank folder>/<key>`
(`mp_rank_01_000/decoder.layers.0.mlp.linear_fc1.weight`), with the shard's coordinates in the `tp`, `pp`
(and `ep`) columns and the global layer number in `layer`. Merging them into whole tensors is a mapper the
user sees and can export (`workbench.mapper.presets.megatron.megatron_merge`), not hidden reader logic.

Nothing is unpickled with code: every file goes through the inert unpickler (the `args` Namespace comes back
as a placeholder whose fields are read as data), tensors are byte ranges of the zip entries, and the
optimizer state is not listed unless `optimizer=True`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..catalog import Catalog, FileInfo, TensorInfo
from ..errors import CannotRead, CheckpointError
from .links import leads_inside
from .pickle.unpickler import DtypeRef, Placeholder
from .torch_folder import ShardedTorchReader
from .torch_zip import TorchFile, TorchZipReader, dtype_code, inspect_file

TRACKER = "latest_checkpointed_iteration.txt"
TORCH_DIST_META = "metadata.json"  # {"sharded_backend": "torch_dist", ...} beside the DCP files
TORCH_DIST_COMMON = "common.pt"  # the non-sharded part of the state dict: args, iteration ...
DCP_METADATA = ".metadata"
RANK_FILE = "model_optim_rng.pt"
_ITER = re.compile(r"^(?:iter_\d{7,}|release)$")
_RANK = re.compile(r"^mp_rank_(?P<tp>\d{2})(?:_(?P<pp>\d{3}))?(?:_(?P<ep>\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
MAX_TRACKER_BYTES = 4096
MODEL_EXTRAS = ("config.json", "generation_config.json")
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
# The args fields a merge or an HF config needs, shown in the catalog's metadata (all scalar args are in 'args').
ARG_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups",
    "kv_channels", "swiglu", "padded_vocab_size", "vocab_size", "make_vocab_size_divisible_by",
    "untie_embeddings_and_output_weights", "add_qkv_bias", "add_bias_linear", "normalization", "norm_epsilon",
    "position_embedding_type", "rotary_base", "max_position_embeddings", "num_experts", "moe_router_topk",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size", "transformer_impl",
)

_fail = CannotRead("Megatron checkpoint", "Copy every rank folder (mp_rank_*) of the iteration, as Megatron wrote it.")


# ---------------------------------------------------------------------------------------------- folders


def _rank_folders(path: Path) -> list[str]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in names if _RANK.match(n) and (path / n).is_dir())


def is_torch_dist(path: Path) -> bool:
    """True for an iteration folder megatron saved in its `torch_dist` format (a DCP folder + metadata.json)."""
    meta = path / TORCH_DIST_META
    if not (path / DCP_METADATA).is_file() or not meta.is_file() or meta.is_symlink():
        return False
    try:
        data = json.loads(meta.read_bytes()[:MAX_TRACKER_BYTES])
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("sharded_backend") == "torch_dist"


def _holds_ranks(path: Path) -> bool:
    return any((path / n / RANK_FILE).is_file() for n in _rank_folders(path))


def iteration_folder(path: Path) -> Path | None:
    """The `iter_NNNNNNN/` (or `release/`) folder to read: `path` itself, or the one its tracker file names."""
    if not path.is_dir():
        return None
    if _holds_ranks(path) or is_torch_dist(path):
        return path
    tracker = path / TRACKER
    if tracker.is_file() and not tracker.is_symlink():
        try:
            text = tracker.read_bytes()[:MAX_TRACKER_BYTES].decode("utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is not None and leads_inside(path, path / name) and (_holds_ranks(path / name) or is_torch_dist(path / name)):
            return path / name
    return None


def detect(path: Path) -> bool:
    """True for a Megatron run folder (with its tracker file) or one of its `iter_N/` folders (legacy or torch_dist)."""
    return iteration_folder(path) is not None


# ---------------------------------------------------------------------------------------------- args


def _plain(value: Any) -> Any:
    """A JSON-able copy of an args value (dtypes by name; other objects by their pickled global)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, DtypeRef):
        return repr(value)
    if isinstance(value, (list, tuple)) and len(value) <= 64:
        return [_plain(v) for v in value]
    if isinstance(value, Placeholder):
        return f"<{value.wb_global}>"
    return repr(value)[:200]


def args_of(root: Any) -> dict[str, Any]:
    """The training arguments pickled as `args` (an argparse.Namespace): its fields, read as data, never run."""
    args = root.get("args") if isinstance(root, dict) else None
    if isinstance(args, Placeholder):
        fields = args.wb_state if isinstance(args.wb_state, dict) else dict(args.wb_kwargs)
    elif isinstance(args, dict):
        fields = args
    else:
        return {}
    return {str(k): _plain(v) for k, v in fields.items() if isinstance(k, str)}


# ---------------------------------------------------------------------------------------------- ranks


@dataclass
class RankFile:
    """One rank's `model_optim_rng.pt`: its folder name, coordinates and parsed (inert) contents."""

    folder: str
    tp: int
    pp: int
    ep: int
    rel: str  # relative to the catalog root (the run folder)
    parsed: TorchFile

    @property
    def root(self) -> Any:
        return self.parsed.root


@dataclass
class MegatronCheckpoint:
    """The parsed iteration folder: the grid of rank files and the training arguments."""

    folder: Path
    ranks: list[RankFile]
    tp_size: int
    pp_size: int
    ep_size: int
    args: dict[str, Any]

    @property
    def root(self) -> Path:
        return self.folder.parent


def _coordinates(folder: Path, names: list[str], args: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """(folder name, tp, pp, ep) per rank folder. `mp_rank_TT_XXX` is a pipeline rank, or an expert rank when the
    args say there is expert parallelism and no pipeline parallelism (Megatron names both the same way)."""
    out = []
    shapes = set()
    expert_only = args.get("pipeline_model_parallel_size") == 1 and (_int_arg(args, "expert_model_parallel_size") or 1) > 1
    for name in names:
        m = _RANK.match(name)
        assert m is not None
        shapes.add((m["pp"] is not None, m["ep"] is not None))
        if expert_only and m["ep"] is None:
            out.append((name, int(m["tp"]), 0, int(m["pp"] or 0)))
        else:
            out.append((name, int(m["tp"]), int(m["pp"] or 0), int(m["ep"] or 0)))
    if len(shapes) > 1:
        raise _fail(folder, f"its rank folders mix naming schemes ({', '.join(names[:6])}): some carry a pipeline or expert "
                            "rank and others do not", fix="Keep the rank folders of one save only.")
    return out


def _int_arg(args: dict[str, Any], name: str) -> int | None:
    value = args.get(name)
    return value if type(value) is int else None


def _folder_name(tp: int, pp: int, ep: int, pp_named: bool, ep_named: bool) -> str:
    return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp_named else "") + (f"_{ep:03d}" if ep_named else "")


def _parse_rank(folder: Path, name: str) -> TorchFile:
    file = folder / name / RANK_FILE
    if not file.is_file():
        raise _fail(folder, f"{name}/{RANK_FILE} is missing")
    if not leads_inside(folder, file):
        raise _fail(folder, f"{name}/{RANK_FILE} is a link that leads outside the iteration folder",
                    fix="Copy the rank folder into the checkpoint instead of linking it.")
    parsed = inspect_file(file)
    if not isinstance(parsed.root, dict) or MODEL_KEY not in parsed.root:
        if isinstance(parsed.root, dict) and "model0" in parsed.root:
            raise _fail(file, "it holds virtual pipeline chunks (model0, model1 ...), which this reader does not merge yet",
                        fix="Convert it with Megatron's own tools to a checkpoint without virtual pipeline parallelism.")
        raise _fail(file, "it has no 'model' entry (is it a Megatron model_optim_rng.pt?)")
    return parsed


def _grid_size(folder: Path, values: set[int], what: str) -> int:
    size = max(values) + 1
    missing = sorted(set(range(size)) - values)
    if missing:
        raise _fail(folder, f"{what} ranks {missing} are missing (found {sorted(values)})")
    return size


def parse(path: Path) -> MegatronCheckpoint:
    """Parse a Megatron run or iteration folder's rank files (pickles inert, no tensor data read)."""
    folder = iteration_folder(path)
    if folder is None:
        raise _fail(path, f"it is neither an iter_N/ folder with mp_rank_*/{RANK_FILE} files nor a run folder whose {TRACKER} "
                          "names one", fix="Point at the folder Megatron's --save wrote, or one iter_N/ inside it.")
    names = _rank_folders(folder)
    parsed = {names[0]: _parse_rank(folder, names[0])}
    args = args_of(parsed[names[0]].root)
    coords = _coordinates(folder, names, args)
    tp_size = _grid_size(folder, {c[1] for c in coords}, "tensor-parallel")
    pp_size = _grid_size(folder, {c[2] for c in coords}, "pipeline-parallel")
    ep_size = _grid_size(folder, {c[3] for c in coords}, "expert-parallel")
    pp_named = pp_size > 1 or any(_RANK.match(n)["ep"] for n in names)  # type: ignore[index]
    have = {(t, p, e) for _, t, p, e in coords}
    for t in range(tp_size):
        for p in range(pp_size):
            for e in range(ep_size):
                if (t, p, e) not in have:
                    name = _folder_name(t, p, e, pp_named or (pp_size > 1), ep_size > 1)
                    raise _fail(folder, f"the rank folder {name} is missing (TP={tp_size} x PP={pp_size}"
                                        f"{f' x EP={ep_size}' if ep_size > 1 else ''} needs {tp_size * pp_size * ep_size})")
    ranks = []
    for name, t, p, e in sorted(coords, key=lambda c: (c[2], c[3], c[1])):
        tf = parsed.get(name) or _parse_rank(folder, name)
        ranks.append(RankFile(name, t, p, e, f"{folder.name}/{name}/{RANK_FILE}", tf))
    for field, found in (("tensor_model_parallel_size", tp_size), ("pipeline_model_parallel_size", pp_size),
                         ("expert_model_parallel_size", ep_size)):
        said = args.get(field)
        if isinstance(said, int) and said != found:
            raise _fail(folder, f"its args say {field}={said} but the rank folders make {found}",
                        fix=f"Copy all {field.split('_')[0].upper()}-parallel rank folders, or point at the right iteration.")
    return MegatronCheckpoint(folder, ranks, tp_size, pp_size, ep_size, args)


def _items(mapping: Any) -> list[tuple[str, Any]]:
    if isinstance(mapping, dict):
        return [(str(k), v) for k, v in mapping.items()]
    items = getattr(mapping, "wb_items", None)
    return [(str(k), v) for k, v in items.items()] if isinstance(items, dict) else []


def _listed(rank: RankFile, prefix: str) -> list[tuple[str, str]]:
    """(catalog name, place path) for the rank's tensors under `prefix.` ('model' keys keep their own dots)."""
    out = []
    for path in rank.parsed.places:
        if path.startswith(prefix + "."):
            key = path[len(prefix) + 1:]
            if key.endswith("._extra_state") or key == "_extra_state" or "._extra_state." in key:
                continue  # Transformer Engine's FP8 bookkeeping, not a weight
            name = f"{rank.folder}/{key}" if prefix == MODEL_KEY else f"{rank.folder}/{prefix}.{key}"
            out.append((name, path))
    return out


def layer_counts(ck: MegatronCheckpoint) -> list[int]:
    """Decoder layers held by each pipeline stage (from the TP-rank-0 files)."""
    counts = []
    for p in range(ck.pp_size):
        rank = next(r for r in ck.ranks if r.pp == p and r.tp == 0 and r.ep == 0)
        layers = {int(m[1]) for n in rank.parsed.places if n.startswith(MODEL_KEY + ".") and (m := _LAYER.match(n[len(MODEL_KEY) + 1:]))}
        if layers and layers != set(range(len(layers))):
            raise _fail(ck.root / rank.rel, f"its decoder layers are numbered {sorted(layers)[:8]}, not 0..{len(layers) - 1}")
        counts.append(len(layers))
    return counts


def _catalog(ck: MegatronCheckpoint, optimizer: bool) -> Catalog:
    counts = layer_counts(ck)
    offsets = [sum(counts[:p]) for p in range(ck.pp_size)]
    tensors: dict[str, TensorInfo] = {}
    readers: dict[str, TorchZipReader] = {}
    columns: dict[str, dict[str, object]] = {"tp": {}, "pp": {}, "layer": {}}
    if ck.ep_size > 1:
        columns["ep"] = {}
    warnings: list[str] = []
    files = {}
    for rank in ck.ranks:
        places = {}
        listed = _listed(rank, MODEL_KEY) + (_listed(rank, OPTIMIZER_KEY) if optimizer else [])
        for name, path in listed:
            place = rank.parsed.places[path]
            code = dtype_code(place.ref.dtype)
            assert code is not None  # inspect_file skips tensors without a safetensors dtype
            nbytes = TensorInfo(name, code, tuple(place.ref.shape)).nbytes
            begin = place.begin if place.contiguous else place.data_offset
            tensors[name] = TensorInfo(name, code, tuple(place.ref.shape), rank.rel, begin, begin + nbytes)
            places[name] = place
            columns["tp"][name] = rank.tp
            columns["pp"][name] = rank.pp
            if ck.ep_size > 1:
                columns["ep"][name] = rank.ep
            m = _LAYER.match(name.split("/", 1)[1])
            if m:
                columns["layer"][name] = offsets[rank.pp] + int(m[1])
        readers[rank.rel] = TorchZipReader(ck.root / rank.rel, places, rank.parsed.archive)
        files[rank.rel] = FileInfo(rank.rel, (ck.root / rank.rel).stat().st_size, 0, len(places))
        if rank.parsed.skipped:
            warnings.append(f"{rank.rel}: {len(rank.parsed.skipped)} entries are not listed ({rank.parsed.skipped[0]}).")
    root0 = ck.ranks[0].root
    metadata = {
        "layout": "legacy", "iteration": str(root0.get("iteration", "")), "checkpoint_version": str(root0.get("checkpoint_version", "")),
        "tp_size": str(ck.tp_size), "pp_size": str(ck.pp_size), "ep_size": str(ck.ep_size),
        "layers_per_stage": ",".join(map(str, counts)), "folder": ck.folder.name,
        "args": json.dumps(ck.args, sort_keys=True),
    }
    metadata.update({f"args.{k}": json.dumps(ck.args[k]) for k in ARG_FIELDS if k in ck.args})
    unsafe = sorted({g for rank in ck.ranks for g in rank.parsed.unsafe_globals})
    metadata["weights_only"] = "no" if unsafe else "yes"  # would torch.load(weights_only=True) accept the files?
    if unsafe:
        metadata["unsafe_globals"] = ", ".join(unsafe)
    extras = sorted(n for n in os.listdir(ck.root) if n in MODEL_EXTRAS and (ck.root / n).is_file())
    catalog = Catalog(root=ck.root, format="megatron", tensors=tensors, files=files, metadata=metadata, warnings=warnings,
                      reader=ShardedTorchReader(readers), columns=columns, extras=extras,
                      default_preset="megatron_merge")  # without a mapper, rank shards convert to the merged model
    return catalog


def _open_torch_dist(folder: Path) -> Catalog:
    """A torch_dist iteration: megatron's DCP folder of global tensors (read by the DCP reader), its args from
    `common.pt` (inert unpickler). Format 'megatron', metadata layout 'torch_dist'."""
    from . import dcp

    catalog = dcp.open_path(folder)
    catalog.format = "megatron"
    catalog.metadata["layout"] = "torch_dist"
    # megatron's common.pt / metadata.json describe the training run, not the model: they do not travel to outputs.
    catalog.extras = [e for e in catalog.extras if e in MODEL_EXTRAS]
    common = folder / TORCH_DIST_COMMON
    if common.is_file() and not common.is_symlink():
        root = inspect_file(common).root
        args = args_of(root)
        catalog.metadata["args"] = json.dumps(args, sort_keys=True)
        catalog.metadata.update({f"args.{k}": json.dumps(args[k]) for k in ARG_FIELDS if k in args})
        if isinstance(root, dict) and type(root.get("iteration")) is int:
            catalog.metadata["iteration"] = str(root["iteration"])
    return catalog


def open_megatron(path: str | os.PathLike, *, optimizer: bool = False) -> Catalog:
    """Open a Megatron run or iteration folder as a Catalog (format 'megatron').

    A `torch_dist` iteration is a DCP folder of global (already merged) tensors under megatron's sharded keys
    (layers stacked on a leading axis); it is listed as such (metadata `layout` 'torch_dist', args from
    `common.pt`). A legacy one is listed as every rank's shards:

    Tensors are named `<rank folder>/<state dict key>`; `catalog.columns` gives each one's `tp`, `pp` (and `ep`)
    coordinates and global `layer`; `catalog.metadata` the parallel sizes, layers per stage and the training
    args (`args.<field>` as JSON, all scalar args under 'args'). `optimizer=True` also lists the optimizer's
    tensors (`<rank folder>/optimizer.<path>`), which are otherwise never read.
    """
    folder = iteration_folder(Path(path))
    if folder is not None and is_torch_dist(folder):
        if optimizer:
            raise CheckpointError(f"Cannot open {path} with optimizer=True: a torch_dist folder lists every tensor it holds "
                                  "already. Drop the option.", file=str(path))
        return _open_torch_dist(folder)
    catalog = _catalog(parse(Path(path)), optimizer)
    catalog.open_options = {"optimizer": True} if optimizer else {}
    return catalog


def open_path(path: Path, *, optimizer: bool = False) -> Catalog:
    """Open a legacy Megatron checkpoint: each rank's model shards (see `open_megatron`)."""
    return open_megatron(path, optimizer=optimizer)


def megatron_args(catalog: Catalog) -> dict[str, Any]:
    """The training args recorded on a Megatron catalog (`{}` for other catalogs)."""
    try:
        return json.loads(catalog.metadata.get("args", "{}"))
    except ValueError:
        return {}
