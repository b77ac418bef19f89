"""DeepSpeed ZeRO checkpoints (format 'deepspeed'): fp32 master weights from the flat per-rank partitions.

`engine.save_checkpoint(run)` writes `run/latest` (the tag) and `run/<tag>/` (`global_stepN/`) holding,
for data-parallel world size W:
- model states: `mp_rank_00_model_states.pt` (stages 1, 2) or `zero_pp_rank_R_mp_rank_00_model_states.pt`
  per rank (stage 3). They carry `module` (the lower-precision module state dict; empty tensors under
  stage 3), `param_shapes` (one ordered name -> shape mapping per optimizer parameter group),
  `frozen_param_shapes` / `frozen_param_fragments` (parameters outside the optimizer), `shared_params`
  (tied name -> name it shares), `buffer_names`.
- optimizer states: `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`, one per rank, whose
  `optimizer_state_dict` holds the rank's fp32 partitions: `single_partition_of_fp32_groups` (stages 1, 2)
  or `fp32_flat_groups` (stage 3), and the base optimizer's moments shaped like those partitions.

Assembly (what the layouts mean, from DeepSpeed's own writers):
- stages 1, 2: per group, the W partitions concatenated are the group's parameters flattened back to
  back (newer DeepSpeed records padding after each parameter as `param_alignment_paddings`); the group's
  tail padding is stripped when saving, so the last partitions may be shorter than the others. A
  parameter is one run or spans consecutive ranks.
- stage 3: every parameter is split on its own into W equal pieces of ceil(numel / W) elements (the
  last padded); each rank's flat buffer holds its piece of every parameter in order. A parameter is
  its W pieces concatenated, cut to numel.

Nothing is unpickled with code: every file goes through the inert unpickler, tensors are byte ranges
of the zip entries, and a catalogued tensor is a list of (file, offset, length) runs read on demand.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..catalog import Catalog, FileInfo, TensorInfo
from ..dtypes import DTYPE_BITS
from ..errors import CannotRead, CheckpointError
from ..iostats import read_at
from .file_pool import FilePool
from .links import leads_inside
from .safetensors_folder import safe_member
from .torch_zip import TensorPlace, TorchFile, dtype_code, inspect_file

_OPTIM = re.compile(r"^(?:(?P<prefix>[a-z0-9]+)_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
_MODEL = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
_STEP = re.compile(r"^global_step(\d+)$")
WEIGHTS = ("fp32", "module")
DEFAULT_OPTIONS = {"weights": "fp32", "moments": False}
OPTIM_PREFIX = "optimizer.state."
MAX_TAG_BYTES = 4096
MODEL_EXTRAS = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class Run:
    """`length` bytes at `offset` of `file` (relative to the step folder)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class ZeroTensor:
    """A catalogued tensor: its runs in order; `stored` is the dtype on disk when the reader casts (buffers)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]
    stored: str | None = None
    ranks: tuple[int, ...] = ()


_fail = CannotRead("DeepSpeed checkpoint", "The checkpoint is incomplete or damaged: copy every rank's files of the step folder.")


# ---------------------------------------------------------------------------------------------- folders


def _is_step_folder(path: Path) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(_OPTIM.match(n) for n in names) and any(_MODEL.match(n) or _MODEL3.match(n) for n in names)


def _latest_tag(path: Path) -> str | None:
    """The tag `path/latest` names (stripped), or None when there is no regular `latest` file or it is not UTF-8."""
    latest = path / "latest"
    if not latest.is_file() or latest.is_symlink():
        return None
    try:
        return latest.read_bytes()[:MAX_TAG_BYTES].decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _is_folder_name(tag: str) -> bool:
    return bool(tag) and not any(c in tag for c in "/\\\x00") and tag not in (".", "..")


def step_folder(path: Path) -> Path | None:
    """The `global_stepN/` folder to read: `path` itself, or the one its `latest` file names."""
    if not path.is_dir():
        return None
    if _is_step_folder(path):
        return path
    tag = _latest_tag(path)
    if tag is not None and _is_folder_name(tag) and _is_step_folder(path / tag):
        return path / tag
    return None


def _holds_steps(path: Path) -> bool:
    """True for a folder with a `latest` file beside `global_stepN/` folders: a run whose `latest` names no step."""
    try:
        return _latest_tag(path) is not None and any(_STEP.match(n) and _is_step_folder(path / n) for n in os.listdir(path))
    except OSError:
        return False


def _inside_run(run: Path, folder: Path) -> None:
    """Refuse a step folder that `latest` names but that is a link leading outside the run folder (Megatron's
    `iter_N/` rule): its rank files are somebody else's, and a conversion would read them as this run's."""
    if folder != run and not leads_inside(run, folder):
        raise _fail(run, f"its step folder {folder.name}/ is a link that leads outside the run folder ({os.path.realpath(folder)})",
                    fix="Copy the step folder into the run folder instead of linking it, or open the folder it leads to itself.")


def detect(path: Path) -> bool:
    """True for a DeepSpeed run folder (with `latest`) or one of its `global_stepN/` folders; also for a run whose
    `latest` names no step folder, so that opening it says what is wrong with `latest`."""
    return step_folder(path) is not None or (path.is_dir() and _holds_steps(path))


# ---------------------------------------------------------------------------------------------- files


@dataclass
class _RankFile:
    rel: str
    parsed: TorchFile

    @property
    def root(self) -> Any:
        return self.parsed.root

    def place(self, path: str) -> TensorPlace:
        place = self.parsed.places.get(path)
        if place is None or not place.contiguous:
            raise _fail(self.parsed.path, f"it has no contiguous tensor at {path!r}")
        return place


def _parse(folder: Path, name: str) -> _RankFile:
    """A rank file of the step folder, named relative to the run folder (`global_stepN/<name>`)."""
    safe_member(folder, name, what=f"DeepSpeed file {name}")
    return _RankFile(f"{folder.name}/{name}", inspect_file(folder / name))


def _natural(rank_files: Iterable[tuple[int, str]]) -> list[str]:
    return [rel for _, rel in sorted(rank_files)]


def _shape(value: Any, source: object, name: str) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and all(type(d) is int and d >= 0 for d in value):
        return tuple(value)
    raise _fail(source, f"its recorded shape {value!r} is not a shape", name)


def _int(value: Any) -> Any:
    """An int, or the int an enum member (inert placeholder, e.g. ZeroStageEnum(2)) was built from."""
    args = getattr(value, "wb_args", None)
    if type(value) is not int and isinstance(args, tuple) and len(args) == 1 and type(args[0]) is int:
        return args[0]
    return value


def _items(mapping: Any) -> list[tuple[str, Any]]:
    """Items of a (possibly OrderedDict-placeholder) mapping, in order."""
    if isinstance(mapping, dict):
        return list(mapping.items())
    items = getattr(mapping, "wb_items", None)
    if isinstance(items, dict):
        return list(items.items())
    return []


# ---------------------------------------------------------------------------------------------- layout


class _Flat:
    """One rank's flat fp32 buffer: several group tensors concatenated (stage 3 reads them as one)."""

    def __init__(self, rel: str, places: list[TensorPlace]) -> None:
        self.rel = rel
        self.parts = [(p.begin, math.prod(p.ref.shape)) for p in places]
        self.numel = sum(n for _, n in self.parts)

    def runs(self, start: int, count: int, itemsize: int = 4) -> list[Run]:
        """Byte runs holding elements [start, start+count) of the concatenation."""
        out: list[Run] = []
        at = 0
        for begin, n in self.parts:
            lo, hi = max(start, at), min(start + count, at + n)
            if lo < hi:
                out.append(Run(self.rel, begin + (lo - at) * itemsize, (hi - lo) * itemsize))
            at += n
        return out


def _merge(runs: list[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for r in runs:
        if r.length == 0:
            continue
        if out and out[-1].file == r.file and out[-1].offset + out[-1].length == r.offset:
            out[-1] = Run(r.file, out[-1].offset, out[-1].length + r.length)
        else:
            out.append(r)
    return tuple(out)


def _stage12(source: Path, shapes: list[list[tuple[str, tuple[int, ...]]]], flats: list[list[_Flat]],
             paddings: list[list[int]] | None) -> list[ZeroTensor]:
    """Stages 1, 2: each group's parameters back to back across the concatenated rank partitions.

    DeepSpeed's ZeRO-1/2 optimizer pads a group's flat buffer to a multiple of 2 * W, cuts it into W equal
    partitions, and saves each partition without its share of that padding: the last rank's partition (and,
    for a group smaller than the padding, the ones before it) is shorter, or empty. So the partitions are
    concatenated at their own sizes, as `zero_to_fp32` does, and a rank's piece starts where the previous ends.
    `paddings` (recorded by newer DeepSpeed as `param_alignment_paddings`) are elements skipped after each parameter.
    """
    world = len(flats)
    align = 2 * world
    out = []
    for g, group in enumerate(shapes):
        parts = [flats[r][g] for r in range(world)]
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + p.numel)
        total = starts[-1]
        offset = 0
        pads = paddings[g] if paddings is not None else [0] * len(group)
        if len(pads) != len(group):
            raise _fail(source, f"group {g} records {len(pads)} alignment paddings for {len(group)} parameters")
        for (name, shape), pad in zip(group, pads, strict=True):
            n = math.prod(shape)
            if offset + n > total:
                raise _fail(source, f"group {g}'s parameters need {offset + n} elements but its partitions hold {total}", name)
            runs: list[Run] = []
            ranks = []
            for r in range(bisect.bisect_right(starts, offset) - 1, world):
                lo, hi = max(offset, starts[r]), min(offset + n, starts[r + 1])
                if lo >= starts[r + 1]:
                    continue  # an empty partition at this offset
                if lo >= hi:
                    break
                runs += parts[r].runs(lo - starts[r], hi - lo)
                ranks.append(r)
            out.append(ZeroTensor(name, "F32", shape, _merge(runs), ranks=tuple(ranks)))
            offset += n + pad
        # What is left after the last parameter is alignment padding: less than 2 * W elements (zero_to_fp32's check).
        if math.ceil(offset / align) * align != math.ceil(total / align) * align:
            raise _fail(source, f"group {g}'s parameters fill {offset} elements of {total}: the shapes do not match the partitions")
    return out


def _stage3(source: Path, shapes: list[list[tuple[str, tuple[int, ...]]]], flats: list[_Flat]) -> list[ZeroTensor]:
    """Stage 3: each parameter in W pieces of ceil(numel / W) elements, one per rank, in parameter order."""
    world = len(flats)
    out = []
    offset = 0
    for group in shapes:
        for name, shape in group:
            n = math.prod(shape)
            piece = math.ceil(n / world)
            runs: list[Run] = []
            ranks = []
            for r in range(world):
                take = min(piece, n - r * piece)
                if offset + piece > flats[r].numel:
                    raise _fail(source, f"rank {r}'s fp32 partition ends before this parameter's piece", name)
                if take > 0:
                    runs += flats[r].runs(offset, take)
                    ranks.append(r)
            out.append(ZeroTensor(name, "F32", shape, _merge(runs), ranks=tuple(ranks)))
            offset += piece
    for r, flat in enumerate(flats):
        if flat.numel != offset:
            raise _fail(source, f"rank {r}'s fp32 partition holds {flat.numel} elements but the parameters use {offset}")
    return out


# ---------------------------------------------------------------------------------------------- reader


class ZeroReader:
    """Reads catalogued tensors by concatenating their runs across rank files (counted preads)."""

    def __init__(self, root: Path, tensors: dict[str, ZeroTensor]) -> None:
        self.root = root
        self.tensors = tensors
        self.files = FilePool(root)

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The tensor's row-major bytes (runs in order; buffers cast to fp32 as zero_to_fp32 returns them)."""
        entry = self.tensors[info.name]
        try:
            parts = [read_at(self.files.fd(r.file), r.length, r.offset) for r in entry.runs]
        except EOFError:
            raise _fail(self.root, "a rank file ended early (it changed after it was opened)", info.name) from None
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        if entry.stored is not None and entry.stored != entry.dtype:
            import torch

            from ..dtypes import to_torch

            raw = torch.frombuffer(bytearray(raw), dtype=to_torch(entry.stored)).to(to_torch(entry.dtype)).numpy().tobytes()
        return raw

    def sources_of(self, info: TensorInfo) -> list[tuple[str, int]]:
        """(file, bytes) for every rank file that holds a run of the tensor."""
        out: dict[str, int] = {}
        for r in self.tensors[info.name].runs:
            out[r.file] = out.get(r.file, 0) + r.length
        return list(out.items())

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """Raw bytes of a tensor held in one run and stored as catalogued, else None."""
        entry = self.tensors[info.name]
        if len(entry.runs) != 1 or (entry.stored is not None and entry.stored != entry.dtype):
            return None
        run = entry.runs[0]
        return ((self.root / run.file).resolve(), run.offset, run.offset + run.length)

    def close(self) -> None:
        self.files.close()


# ---------------------------------------------------------------------------------------------- opening


@dataclass
class ZeroCheckpoint:
    """The parsed step folder: stage, world size, rank files, and the model states' object tree."""

    folder: Path  # the step folder; the catalog's root is its parent (the run folder, with config.json)
    stage: int
    world: int
    model: _RankFile
    model_files: list[_RankFile]
    optim: list[_RankFile]
    fp32_key: str

    @property
    def root(self) -> Path:
        return self.folder.parent

    @property
    def states(self) -> dict:
        root = self.model.root
        return root if isinstance(root, dict) else {}


def _groups_of(rank: _RankFile, key: str) -> list[TensorPlace]:
    osd = rank.root.get("optimizer_state_dict") if isinstance(rank.root, dict) else None
    groups = osd.get(key) if isinstance(osd, dict) else None
    if not isinstance(groups, list):
        raise _fail(rank.parsed.path, f"optimizer_state_dict has no {key} list")
    return [rank.place(f"optimizer_state_dict.{key}.{i}") for i in range(len(groups))]


def parse(path: Path) -> ZeroCheckpoint:
    """Parse a DeepSpeed run or step folder's rank files (pickles inert, no tensor data read)."""
    folder = step_folder(path)
    if folder is None and _holds_steps(path):
        tag = _latest_tag(path)
        raise _fail(path / "latest", f"its tag {tag!r} names no step folder of this run",
                    fix="Write the name of one global_stepN/ folder into `latest`, or open that folder itself.")
    if folder is None:
        raise _fail(path, "it is neither a global_stepN/ folder with *_model_states.pt and *_optim_states.pt files nor a run folder whose `latest` names one",
                    fix="Point at the folder engine.save_checkpoint() wrote.")
    _inside_run(path, folder)
    names = os.listdir(folder)
    optim: dict[int, list[tuple[int, str]]] = {}
    for n in names:
        m = _OPTIM.match(n)
        if m:
            optim.setdefault(int(m["mp"]), []).append((int(m["rank"]), n))
    if set(optim) != {0}:
        raise _fail(folder, f"it holds model-parallel ranks {sorted(optim)}; only mp_rank_00 (no tensor parallelism) is supported",
                    fix="Convert each model-parallel rank with its own tool first.")
    ranks = sorted(optim[0])
    world = len(ranks)
    if [r for r, _ in ranks] != list(range(world)):
        raise _fail(folder, f"optimizer files exist for ranks {[r for r, _ in ranks]}, not 0..{world - 1}")
    optim_files = [_parse(folder, rel) for rel in _natural(ranks)]
    first = optim_files[0].root.get("optimizer_state_dict") if isinstance(optim_files[0].root, dict) else None
    if not isinstance(first, dict):
        raise _fail(folder.parent / optim_files[0].rel, "it has no optimizer_state_dict")
    stage = _int(first.get("zero_stage"))
    if type(stage) is not int or stage not in (1, 2, 3):
        raise _fail(folder.parent / optim_files[0].rel, f"its zero_stage is {stage!r}, not 1, 2 or 3")
    counts = first.get("partition_count")
    count = max(counts) if isinstance(counts, list) and counts and all(type(c) is int for c in counts) else counts
    if type(count) is int and count != world:
        raise _fail(folder, f"the optimizer was partitioned over {count} ranks but {world} rank files are present",
                    fix=f"Copy all {count} *_optim_states.pt files.")
    if stage == 3:
        model_ranks = sorted((int(m["rank"]), n) for n in names if (m := _MODEL3.match(n)) and int(m["mp"]) == 0)
        if len(model_ranks) != world:
            raise _fail(folder, f"stage 3 needs one model-states file per rank ({world}); found {len(model_ranks)}")
        model_files = [_parse(folder, rel) for rel in _natural(model_ranks)]
        key = "fp32_flat_groups"
    else:
        if "mp_rank_00_model_states.pt" not in names:
            raise _fail(folder, "mp_rank_00_model_states.pt is missing")
        model_files = [_parse(folder, "mp_rank_00_model_states.pt")]
        key = "single_partition_of_fp32_groups"
    return ZeroCheckpoint(folder, stage, world, model_files[0], model_files, optim_files, key)


def _param_shapes(ck: ZeroCheckpoint) -> list[list[tuple[str, tuple[int, ...]]]]:
    src = ck.root / ck.model.rel
    groups = ck.states.get("param_shapes")
    if isinstance(groups, dict) or _items(groups):
        groups = [groups]
    if not isinstance(groups, list):
        raise _fail(src, "it has no param_shapes (DeepSpeed older than 0.3.17 did not record them)")
    return [[(str(k), _shape(v, src, str(k))) for k, v in _items(g)] for g in groups]


def master_tensors(ck: ZeroCheckpoint) -> list[ZeroTensor]:
    """The fp32 master weights of the optimized parameters, assembled from every rank's partitions."""
    shapes = _param_shapes(ck)
    per_rank = [_groups_of(r, ck.fp32_key) for r in ck.optim]
    if ck.stage == 3:
        return _stage3(ck.folder, shapes, [_Flat(r.rel, g) for r, g in zip(ck.optim, per_rank, strict=True)])
    if any(len(g) != len(shapes) for g in per_rank):
        raise _fail(ck.folder, f"the model states list {len(shapes)} parameter groups but the ranks hold {[len(g) for g in per_rank]}")
    osd = ck.optim[0].root["optimizer_state_dict"]
    paddings = osd.get("param_alignment_paddings")
    if paddings is not None and not (isinstance(paddings, list) and all(
            isinstance(g, list) and all(type(p) is int and p >= 0 for p in g) for g in paddings)):
        raise _fail(ck.root / ck.optim[0].rel, f"its param_alignment_paddings {paddings!r} are not lists of counts")
    if paddings is not None and len(paddings) != len(shapes):
        raise _fail(ck.folder, f"{len(paddings)} groups of alignment paddings for {len(shapes)} parameter groups")
    flats = [[_Flat(r.rel, [p]) for p in g] for r, g in zip(ck.optim, per_rank, strict=True)]
    return _stage12(ck.folder, shapes, flats, paddings)


def _module_tensor(ck: ZeroCheckpoint, rank: _RankFile, key: str, name: str, *, cast: str | None = None) -> ZeroTensor:
    place = rank.place(key)
    code = dtype_code(place.ref.dtype)
    if code is None:
        raise _fail(ck.root / rank.rel, f"torch.{place.ref.dtype} has no safetensors dtype", name)
    run = Run(rank.rel, place.begin, math.prod(place.ref.shape) * DTYPE_BITS[code] // 8)
    return ZeroTensor(name, cast or code, tuple(place.ref.shape), _merge([run]), stored=code if cast else None)


def frozen_tensors(ck: ZeroCheckpoint) -> list[ZeroTensor]:
    """Parameters outside the optimizer (`frozen_param_fragments`), in their training dtype, as zero_to_fp32 returns them."""
    frozen = _items(ck.states.get("frozen_param_shapes"))
    out = []
    src = ck.root / ck.model.rel
    for name, shape in frozen:
        shape = _shape(shape, src, name)
        n = math.prod(shape)
        runs: list[Run] = []
        dtype = None
        # Stages 1, 2: the whole parameter in rank 0's fragments; stage 3: one fragment per rank, cut to numel.
        for rank in ck.model_files:
            place = rank.place(f"frozen_param_fragments.{name}")
            dtype = dtype_code(place.ref.dtype)
            if dtype is None:
                raise _fail(ck.root / rank.rel, f"torch.{place.ref.dtype} has no safetensors dtype", name)
            itemsize = DTYPE_BITS[dtype] // 8
            have = sum(r.length for r in runs) // itemsize
            take = min(math.prod(place.ref.shape), n - have)
            if take > 0:
                runs.append(Run(rank.rel, place.begin, take * itemsize))
        out.append(ZeroTensor(name, dtype or "F32", shape, _merge(runs)))
        if sum(r.length for r in runs) != n * DTYPE_BITS[dtype or "F32"] // 8:
            raise _fail(ck.folder, f"its stage-3 fragments hold fewer than {n} elements", name)
    return out


def buffer_tensors(ck: ZeroCheckpoint) -> list[ZeroTensor]:
    """Persistent buffers from the module states, cast to fp32 as zero_to_fp32 returns them."""
    names = ck.states.get("buffer_names")
    module = ck.states.get("module")
    out = []
    for name in names if isinstance(names, list) else []:
        if isinstance(name, str) and isinstance(module, dict) and name in module:
            out.append(_module_tensor(ck, ck.model, f"module.{name}", name, cast="F32"))
    return out


def module_tensors(ck: ZeroCheckpoint) -> list[ZeroTensor]:
    """The lower-precision module weights as saved (stages 1, 2; stage 3 saves empty placeholders)."""
    if ck.stage == 3:
        raise _fail(ck.folder, "ZeRO stage 3 saves no module weights (only empty placeholders); the fp32 master weights are the model",
                    fix="Use weights='fp32' (the default).")
    module = ck.states.get("module")
    return [_module_tensor(ck, ck.model, f"module.{k}", str(k)) for k in (module if isinstance(module, dict) else {})
            if f"module.{k}" in ck.model.parsed.places]


def shared_pairs(ck: ZeroCheckpoint) -> list[tuple[str, str]]:
    """(tied name, the name whose tensor it shares), e.g. ('lm_head.weight', 'model.embed_tokens.weight')."""
    return [(str(k), str(v)) for k, v in _items(ck.states.get("shared_params"))]


def _moment_groups(ck: ZeroCheckpoint, rank: _RankFile) -> list[str]:
    """Tree paths of the base optimizer's per-group states, in group order.

    Stages 1, 2 keep them under `base_optimizer_state` (a list per group, or a torch optimizer state dict);
    stage 3 under `optimizer_state_dict.state.<sub-group>`.
    """
    osd = rank.root["optimizer_state_dict"]
    for key in ("base_optimizer_state", "optimizer_state_dict"):
        base = osd.get(key)
        path = f"optimizer_state_dict.{key}"
        if isinstance(base, list):
            return [f"{path}.{i}" for i in range(len(base))]
        if isinstance(base, dict) and isinstance(base.get("state"), dict):
            ids = sorted(k for k in base["state"] if type(k) is int)
            return [f"{path}.state.{i}" for i in ids]
    raise _fail(ck.root / rank.rel, "it holds no base optimizer state (exp_avg / exp_avg_sq)",
                fix="The run's optimizer keeps no Adam moments, or its states were stripped: open it with moments=False.")


def _rank_paddings(rank: _RankFile, groups: int) -> list[int]:
    """The alignment padding DeepSpeed recorded for this rank's partition of each group (`group_paddings`), or zeros."""
    pads = rank.root["optimizer_state_dict"].get("group_paddings")
    if isinstance(pads, list) and len(pads) == groups and all(type(p) is int and p >= 0 for p in pads):
        return pads
    return [0] * groups


def moment_tensors(ck: ZeroCheckpoint, masters: list[ZeroTensor]) -> list[ZeroTensor]:
    """Adam moments (exp_avg, exp_avg_sq) of each optimized parameter, laid out like its fp32 master.

    A rank's moments are group by group like its fp32 partitions, each as long as the partition, or (stages 1,
    2, whose saved partitions drop the group's alignment padding while the base optimizer's state keeps it)
    longer by the padding the rank records in `group_paddings`.
    """
    out = []
    masters_of = {r.rel: _groups_of(r, ck.fp32_key) for r in ck.optim}
    for state in ("exp_avg", "exp_avg_sq"):
        moments_of: dict[str, list[TensorPlace]] = {}
        for rank in ck.optim:
            places = [rank.place(f"{prefix}.{state}") for prefix in _moment_groups(ck, rank)]
            master = masters_of[rank.rel]
            pads = _rank_paddings(rank, len(master)) if ck.stage != 3 else [0] * len(master)
            held, want = sum(math.prod(p.ref.shape) for p in places), sum(math.prod(p.ref.shape) for p in master)
            if len(places) != len(master) or any(
                    math.prod(m.ref.shape) not in (math.prod(f.ref.shape), math.prod(f.ref.shape) - pad)
                    for f, m, pad in zip(places, master, pads, strict=True)):
                raise _fail(ck.root / rank.rel, f"its {state} holds {held} elements in {len(places)} groups but its fp32 partitions "
                            f"{want} in {len(master)}", fix="The optimizer state does not mirror the partitions; open it with moments=False.")
            moments_of[rank.rel] = places
        for t in masters:
            runs: list[Run] = []
            for run in t.runs:
                # Each piece of the master's byte run in one group partition has its moment at the same element offset
                # of that group's moment tensor (a run may span partitions that lie back to back in the file).
                covered = 0
                for m, f in zip(masters_of[run.file], moments_of[run.file], strict=True):
                    lo, hi = max(run.offset, m.begin), min(run.offset + run.length, m.begin + math.prod(m.ref.shape) * 4)
                    if lo < hi:
                        runs.append(Run(run.file, f.begin + (lo - m.begin), hi - lo))
                        covered += hi - lo
                if covered != run.length:
                    raise _fail(ck.folder, "a master-weight run lies outside its rank's partitions", t.name)
            out.append(ZeroTensor(f"{OPTIM_PREFIX}{t.name}.{state}", "F32", t.shape, _merge(runs), ranks=t.ranks))
    return out


def _catalog(ck: ZeroCheckpoint, tensors: list[ZeroTensor], selection: str) -> Catalog:
    by_name: dict[str, ZeroTensor] = {}
    for t in tensors:
        if t.name in by_name:
            raise _fail(ck.folder, "two entries have this name", t.name)
        by_name[t.name] = t
    for tied, owner in shared_pairs(ck) if selection != "module" else []:
        if owner in by_name and tied not in by_name:
            t = by_name[owner]
            by_name[tied] = ZeroTensor(tied, t.dtype, t.shape, t.runs, t.stored, t.ranks)
    reader = ZeroReader(ck.root, by_name)
    infos = {}
    counts: dict[str, int] = {}
    for t in by_name.values():
        first = t.runs[0] if t.runs else Run(ck.optim[0].rel, 0, 0)
        infos[t.name] = TensorInfo(t.name, t.dtype, t.shape, first.file, first.offset, first.offset + first.length)
        counts[first.file] = counts.get(first.file, 0) + 1
    all_files = {r.rel: r for r in [*ck.model_files, *ck.optim]}
    files = {rel: FileInfo(rel, (ck.root / rel).stat().st_size, 0, counts.get(rel, 0)) for rel in sorted(all_files)}
    metadata = {
        "zero_stage": str(ck.stage), "world_size": str(ck.world), "weights": selection,
        "ds_version": str(ck.states.get("ds_version", "")), "tag": ck.folder.name,
    }
    columns: dict[str, dict[str, object]] = {
        "ranks": {t.name: ",".join(map(str, t.ranks)) for t in by_name.values() if t.ranks},
        "pieces": {t.name: len(t.runs) for t in by_name.values()},
    }
    # The training's model config (HF's config.json saved beside the run) travels with a conversion.
    extras = sorted(n for n in os.listdir(ck.root) if n in MODEL_EXTRAS and (ck.root / n).is_file())
    return Catalog(root=ck.root, format="deepspeed", tensors=infos, files=files, metadata=metadata, reader=reader,
                   columns=columns, extras=extras)


def open_deepspeed(path: str | os.PathLike, *, weights: str = "fp32", moments: bool = False) -> Catalog:
    """Open a DeepSpeed ZeRO run or step folder as a Catalog (format 'deepspeed').

    `weights='fp32'` (default) lists what `zero_to_fp32` returns: the fp32 master weights, frozen parameters
    (training dtype), persistent buffers (fp32) and tied names; `'module'` lists the lower-precision module
    weights as saved (stages 1, 2). `moments=True` adds Adam's `optimizer.state.<name>.exp_avg[_sq]`.
    """
    if weights not in WEIGHTS:
        raise CheckpointError(f"Cannot open DeepSpeed weights {weights!r}: choose one of {', '.join(WEIGHTS)}.")
    ck = parse(Path(path))
    if weights == "module":
        tensors = module_tensors(ck)
        masters = master_tensors(ck) if moments else []
    else:
        masters = master_tensors(ck)
        tensors = [*masters, *frozen_tensors(ck), *buffer_tensors(ck)]
    if moments:
        tensors += moment_tensors(ck, masters)
    catalog = _catalog(ck, tensors, weights)
    catalog.open_options = {k: v for k, v in (("weights", weights), ("moments", moments)) if v != DEFAULT_OPTIONS[k]}
    return catalog


def open_path(path: Path, *, weights: str = "fp32", moments: bool = False) -> Catalog:
    """Open a DeepSpeed checkpoint: the fp32 master weights by default (see `open_deepspeed`)."""
    return open_deepspeed(path, weights=weights, moments=moments)
