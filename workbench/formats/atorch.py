"""atorch FSDP flat-parameter checkpoints (format 'atorch-flat'): full parameters from per-rank flat shards.

A folder written by atorch's flat save holds, for world size W and suffix `R-W` = `{rank:05d}-{W:05d}`:
`flat_param.R-W` (safetensors: per FSDP unit, this rank's 1-D shard of the unit's flat parameter),
`flat_meta.R-W` (pickle: `param_meta` fqn -> shapes, numels, `param_offsets` = [start, end) of the piece in
this shard, `striped_fsdp_name` = the unit), `buffers` (safetensors, full buffers), `ckpt_meta` (pickle:
version, world_size, wrapped classes), and optionally `optim_param.R-W` (safetensors, `<fqn>-<state>` local
1-D slices) + `optim_meta` (pickle: param_groups).

A full parameter is its pieces in rank order, concatenated and reshaped. Catalog names: parameters and
buffers by fqn, optimizer state as `optimizer.state.<fqn>.<state>`. `TensorInfo.file/begin/end` give the
first piece; the reader assembles all pieces. Pickles are read with an allowlist (torch.Size, builtins).

`write_flat_checkpoint` writes this layout from full tensors the way FSDP (use_orig_params) shards them:
flatten a unit's parameters in order, pad each start to 16 bytes, pad the total to a multiple of W,
split into W equal shards. Tests and the sample generator use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..catalog import Catalog, FileInfo, TensorInfo
from ..display import format_shape
from ..dtypes import DTYPE_BITS
from ..errors import CannotRead, CheckpointError
from ..iostats import file_kind, open_for_read, read_at
from .file_pool import FilePool
from .pickle.unpickler import load_inert
from .safetensors import SafetensorsHeader, read_header
from .safetensors_folder import safe_member, shard_state
from .shape_bounds import shape_problem

_SUFFIX = re.compile(r"^(flat_meta|flat_param|optim_param)\.(\d{5})-(\d{5})$")
OPTIM_PREFIX = "optimizer.state."
KNOWN_STATES = (
    "exp_avg_sq", "exp_avg", "max_exp_avg_sq", "step", "momentum_buffer", "sum", "square_avg", "acc_delta",
    "exp_inf", "ax", "eta", "mu", "prev", "step_size", "mu_product",
)
ALIGNMENT_BYTES = 16
_FIXED_FILES = frozenset({"buffers", "ckpt_meta", "optim_meta"})
# flat_meta / ckpt_meta / optim_meta hold names, shapes and offsets: a few KB per parameter at most.
MAX_META_BYTES = 64 << 20
_PICKLE_ALLOWED = frozenset({"torch.Size", "builtins.set", "builtins.frozenset", "collections.OrderedDict", "_codecs.encode"})


@dataclass(frozen=True)
class Piece:
    """A run of one tensor's elements inside one rank's file: elements [start, end) of `key` there."""

    file: str
    key: str
    start: int
    end: int


@dataclass(frozen=True)
class FlatTensor:
    """A catalogued tensor of an atorch checkpoint and the pieces (in order) that make it up."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    unit: str | None


_fail = CannotRead("atorch checkpoint", "The checkpoint is incomplete or damaged: re-copy every rank's files.")


def _rank_files(folder: Path, kind: str) -> dict[int, tuple[str, int]]:
    """rank -> (file name, world size) for files `kind.RRRRR-WWWWW`."""
    out: dict[int, tuple[str, int]] = {}
    for entry in os.scandir(folder):
        match = _SUFFIX.match(entry.name)
        if match and match.group(1) == kind:
            what = file_kind(entry.path)
            if what is not None:
                raise _fail(str(folder), f"{entry.name} is {shard_state(what)}", fix="Replace it with the rank's file.")
            out[int(match.group(2))] = (entry.name, int(match.group(3)))
    return dict(sorted(out.items()))


def detect(path: Path) -> bool:
    """True for a folder holding atorch `flat_meta.RRRRR-WWWWW` files."""
    if not path.is_dir():
        return False
    try:
        return any(_SUFFIX.match(e.name) and e.name.startswith("flat_meta.") for e in os.scandir(path))
    except OSError:
        return False


def _load_pickle(path: Path) -> Any:
    source = str(path)
    try:
        fd = open_for_read(path)
    except OSError as exc:
        raise CheckpointError(f"Cannot open {source}: {exc.strerror}. Copy every file of the checkpoint.", file=source) from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_META_BYTES:
            raise _fail(source, f"it is {size} bytes, above the {MAX_META_BYTES}-byte limit for an atorch metadata pickle")
        raw = read_at(fd, size, 0)
    finally:
        os.close(fd)
    return load_inert(raw, source=source, strict=lambda g: g in _PICKLE_ALLOWED).root


def _check_world(folder: Path, kind: str, files: dict[int, tuple[str, int]], world: int) -> None:
    for _rank, (name, w) in files.items():
        if w != world:
            raise _fail(str(folder), f"{name} belongs to a world of {w} ranks but the checkpoint has {world}")
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise _fail(str(folder), f"{kind} files of ranks {missing} are missing (world size {world})", fix=f"Copy {kind}.{missing[0]:05d}-{world:05d} and the other missing files.")


def _split_state_key(key: str, known: set[str]) -> tuple[str, str]:
    """Split '<fqn>-<state>' where fqn itself may contain '-': prefer a known fqn, then a known state suffix."""
    at = key.rfind("-")
    while at > 0:
        if key[:at] in known:
            return key[:at], key[at + 1 :]
        at = key.rfind("-", 0, at)
    for state in sorted(KNOWN_STATES, key=len, reverse=True):
        if key.endswith("-" + state):
            return key[: -len(state) - 1], state
    fqn, _, state = key.rpartition("-")
    return fqn, state


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _header(folder: Path, rel: str) -> SafetensorsHeader:
    return read_header(folder / rel, rel=rel)


def _params(folder: Path, world: int, headers: dict[str, SafetensorsHeader]) -> tuple[list[FlatTensor], set[str]]:
    meta_files = _rank_files(folder, "flat_meta")
    param_files = _rank_files(folder, "flat_param")
    _check_world(folder, "flat_meta", meta_files, world)
    _check_world(folder, "flat_param", param_files, world)
    pieces: dict[str, list[tuple[int, Piece]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    units: dict[str, str] = {}
    order: dict[str, tuple[int, int]] = {}
    for rank, (meta_name, _) in meta_files.items():
        meta = _load_pickle(folder / meta_name)
        param_meta = meta.get("param_meta") if isinstance(meta, dict) else None
        if not isinstance(param_meta, dict):
            raise _fail(str(folder / meta_name), "it has no param_meta dictionary")
        rel = param_files[rank][0]
        header = headers.setdefault(rel, _header(folder, rel))
        flat = {t.name: t for t in header.tensors}
        for fqn, info in param_meta.items():
            if not isinstance(fqn, str) or not isinstance(info, dict):
                raise _fail(str(folder / meta_name), f"param_meta entry {fqn!r} is malformed")
            shape = info.get("param_shapes")
            span = info.get("param_offsets")
            unit = info.get("striped_fsdp_name")
            if unit is None:
                local = info.get("param_names")
                unit = fqn[: -len(local) - 1] if isinstance(local, str) and fqn.endswith("." + local) else ""
            if (
                not isinstance(shape, tuple) or not isinstance(span, (tuple, list)) or len(span) != 2
                or not all(type(v) is int and v >= 0 for v in span) or span[0] > span[1] or not isinstance(unit, str)
            ):
                raise _fail(str(folder / meta_name), f"param_meta has malformed shapes/offsets ({format_shape(shape)}, {format_shape(span)})", fqn)
            if unit not in flat:
                raise _fail(str(folder / rel), f"it has no flat parameter for FSDP unit {unit!r}", fqn)
            tensor = flat[unit]
            problem = shape_problem(shape, DTYPE_BITS[tensor.dtype])
            if problem:
                raise _fail(str(folder / meta_name), f"param_meta gives {problem}", fqn)
            if len(tensor.shape) != 1 or span[1] > tensor.shape[0]:
                raise _fail(str(folder / rel), f"piece [{span[0]}, {span[1]}) lies outside unit {unit!r} of shape {list(tensor.shape)}", fqn)
            if shapes.setdefault(fqn, shape) != shape or dtypes.setdefault(fqn, tensor.dtype) != tensor.dtype:
                raise _fail(str(folder), f"ranks disagree on its shape or dtype ({shapes[fqn]} vs {shape})", fqn)
            units[fqn] = unit
            order.setdefault(fqn, (rank, tensor.begin + span[0]))
            pieces.setdefault(fqn, []).append((rank, Piece(rel, unit, span[0], span[1])))
    out = []
    for fqn in sorted(pieces, key=lambda n: order[n]):
        parts = tuple(p for _, p in sorted(pieces[fqn], key=lambda rp: rp[0]) if p.end > p.start)
        held = sum(p.end - p.start for p in parts)
        if held != _prod(shapes[fqn]):
            raise _fail(str(folder), f"its pieces hold {held} of {_prod(shapes[fqn])} elements", fqn)
        out.append(FlatTensor(fqn, dtypes[fqn], shapes[fqn], parts, units[fqn]))
    return out, set(pieces)


def _optimizer(folder: Path, world: int, params: dict[str, FlatTensor], headers: dict[str, SafetensorsHeader]) -> list[FlatTensor]:
    files = _rank_files(folder, "optim_param")
    if not files:
        return []
    _check_world(folder, "optim_param", files, world)
    known = set(params)
    if (folder / "optim_meta").is_file():
        groups = _load_pickle(folder / "optim_meta")
        for group in groups if isinstance(groups, list) else []:
            if isinstance(group, dict) and isinstance(group.get("params"), list):
                known.update(p for p in group["params"] if isinstance(p, str))
    parts: dict[tuple[str, str], list[tuple[int, Piece, str, tuple[int, ...]]]] = {}
    for rank, (rel, _) in files.items():
        header = headers.setdefault(rel, _header(folder, rel))
        for t in header.tensors:
            fqn, state = _split_state_key(t.name, known)
            parts.setdefault((fqn, state), []).append((rank, Piece(rel, t.name, 0, _prod(t.shape)), t.dtype, t.shape))
    out = []
    position = {name: i for i, name in enumerate(params)}
    for (fqn, state), found in sorted(parts.items(), key=lambda kv: (position.get(kv[0][0], len(position)), kv[0])):
        name = f"{OPTIM_PREFIX}{fqn}.{state}"
        dtype = found[0][2]
        if any(d != dtype for _, _, d, _ in found):
            raise _fail(str(folder), "ranks store it with different dtypes", name)
        param = params.get(fqn)
        flat = all(len(shape) == 1 for _, _, _, shape in found)
        total = sum(p.end - p.start for _, p, _, _ in found)
        if param is not None and flat and total == _prod(param.shape):
            pieces = tuple(p for _, p, _, _ in sorted(found, key=lambda f: f[0]) if p.end > p.start)
            out.append(FlatTensor(name, dtype, param.shape, pieces, param.unit))
        else:
            # A per-parameter scalar (e.g. Adam's step) is stored whole by every rank that holds a piece.
            _, piece, _, shape = found[0]
            out.append(FlatTensor(name, dtype, tuple(shape), (piece,), param.unit if param else None))
    return out


class AtorchReader:
    """Reads atorch tensors by concatenating their pieces across rank files (counted preads)."""

    def __init__(self, root: Path, tensors: dict[str, FlatTensor], headers: dict[str, SafetensorsHeader]) -> None:
        self.root = root
        self.tensors = tensors
        self._key_offsets = {(rel, t.name): t.begin for rel, h in headers.items() for t in h.tensors}
        self.files = FilePool(root)

    def _fd(self, rel: str) -> int:
        return self.files.fd(rel)

    def _range(self, piece: Piece, itemsize: int) -> tuple[int, int]:
        begin = self._key_offsets[(piece.file, piece.key)] + piece.start * itemsize
        return begin, (piece.end - piece.start) * itemsize

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The full tensor's bytes: its pieces in rank order."""
        entry = self.tensors[info.name]
        itemsize = DTYPE_BITS[entry.dtype] // 8
        parts = []
        try:
            for piece in entry.pieces:
                begin, length = self._range(piece, itemsize)
                parts.append(read_at(self._fd(piece.file), length, begin))
        except EOFError:
            raise _fail(str(self.root), "a rank file ended early (it changed after it was opened)", info.name) from None
        return parts[0] if len(parts) == 1 else b"".join(parts)  # b'' for an empty tensor

    def sources_of(self, info: TensorInfo) -> list[tuple[str, int]]:
        """(file, bytes) for every rank file that holds a piece of the tensor, in rank order."""
        entry = self.tensors[info.name]
        itemsize = DTYPE_BITS[entry.dtype] // 8
        out: dict[str, int] = {}
        for piece in entry.pieces:
            out[piece.file] = out.get(piece.file, 0) + (piece.end - piece.start) * itemsize
        return list(out.items())

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """Raw bytes of a tensor held whole by one rank, else None."""
        entry = self.tensors[info.name]
        if len(entry.pieces) != 1:
            return None
        begin, length = self._range(entry.pieces[0], DTYPE_BITS[entry.dtype] // 8)
        return ((self.root / entry.pieces[0].file).resolve(), begin, begin + length)

    def close(self) -> None:
        self.files.close()


def _refuse_links_out(folder: Path) -> None:
    """Every file this reader opens must stay inside the folder, links included."""
    for entry in os.scandir(folder):
        if entry.is_symlink() and (_SUFFIX.match(entry.name) or entry.name in _FIXED_FILES):
            safe_member(folder, entry.name, what=f"atorch file {entry.name}")


def open_path(path: Path) -> Catalog:
    """Open an atorch flat checkpoint folder (format 'atorch-flat')."""
    folder = path
    source = str(folder)
    _refuse_links_out(folder)
    meta_files = _rank_files(folder, "flat_meta")
    if not meta_files:
        raise _fail(source, "it holds no flat_meta.RRRRR-WWWWW file", fix="Point at the folder atorch saved.")
    world = next(iter(meta_files.values()))[1]
    metadata = {"world_size": str(world)}
    if (folder / "ckpt_meta").is_file():
        ckpt_meta = _load_pickle(folder / "ckpt_meta")
        if isinstance(ckpt_meta, dict):
            if type(ckpt_meta.get("world_size")) is int and ckpt_meta["world_size"] != world:
                raise _fail(source, f"ckpt_meta says world size {ckpt_meta['world_size']} but the files say {world}")
            metadata["version"] = str(ckpt_meta.get("version"))
            wrap = ckpt_meta.get("wrap_class")
            if isinstance(wrap, (set, frozenset, list, tuple)):
                metadata["wrap_class"] = ", ".join(sorted(".".join(map(str, w)) if isinstance(w, tuple) else str(w) for w in wrap))
    headers: dict[str, SafetensorsHeader] = {}
    params, _ = _params(folder, world, headers)
    tensors = {t.name: t for t in params}
    if (folder / "buffers").is_file():
        headers["buffers"] = _header(folder, "buffers")
        for t in headers["buffers"].tensors:
            if t.name in tensors:
                raise _fail(source, "it is both a parameter and a buffer", t.name)
            tensors[t.name] = FlatTensor(t.name, t.dtype, t.shape, (Piece("buffers", t.name, 0, _prod(t.shape)),), None)
    for t in _optimizer(folder, world, tensors, headers):
        tensors[t.name] = t
    reader = AtorchReader(folder, tensors, headers)
    infos: dict[str, TensorInfo] = {}
    for t in tensors.values():
        first = t.pieces[0] if t.pieces else None
        if first is None:
            infos[t.name] = TensorInfo(t.name, t.dtype, t.shape)
            continue
        begin, length = reader._range(first, DTYPE_BITS[t.dtype] // 8)
        infos[t.name] = TensorInfo(t.name, t.dtype, t.shape, first.file, begin, begin + length)
    counts: dict[str, int] = {}
    for info in infos.values():
        counts[info.file] = counts.get(info.file, 0) + 1
    files = {rel: FileInfo(rel, h.file_size, h.header_bytes, counts.get(rel, 0)) for rel, h in sorted(headers.items())}
    columns: dict[str, dict[str, object]] = {
        "pieces": {t.name: len(t.pieces) for t in tensors.values()},
        "unit": {t.name: t.unit for t in tensors.values() if t.unit is not None},
    }
    extras = sorted(n for n in ("ckpt_meta", "optim_meta") if (folder / n).is_file())
    return Catalog(root=folder, format="atorch-flat", tensors=infos, files=files, metadata=metadata, extras=extras, reader=reader, columns=columns)


def read_param_groups(path: str | os.PathLike) -> list[dict]:
    """The optimizer's param_groups from `optim_meta` (hyper-parameters and parameter names), read inertly."""
    groups = _load_pickle(Path(path) / "optim_meta")
    return groups if isinstance(groups, list) else []


# ---------------------------------------------------------------------------------------------- writer


def unit_layout(numels: list[int], itemsize: int, world_size: int) -> tuple[list[int], int]:
    """FSDP flat-parameter layout: each parameter's start in the unsharded flat tensor, and the padded total."""
    align = max(ALIGNMENT_BYTES // itemsize, 1)
    starts = []
    total = 0
    for numel in numels:
        if total % align:
            total += align - total % align
        starts.append(total)
        total += numel
    if total % world_size:
        total += world_size - total % world_size
    return starts, total


def shard_pieces(starts: list[int], numels: list[int], total: int, world_size: int, rank: int) -> list[tuple[int, int, int, int]]:
    """(param index, offset in shard, numel in shard, offset within the param) for each parameter in `rank`'s shard."""
    size = total // world_size
    lo, hi = rank * size, (rank + 1) * size
    out = []
    for i, (start, numel) in enumerate(zip(starts, numels, strict=True)):
        a, b = max(start, lo), min(start + numel, hi)
        if a < b:
            out.append((i, a - lo, b - a, a - start))
    return out


def write_flat_checkpoint(
    folder: str | os.PathLike,
    units: Mapping[str, Mapping[str, Any]],
    world_size: int,
    *,
    buffers: Mapping[str, Any] | None = None,
    optim_state: Mapping[str, Mapping[str, Any]] | None = None,
    param_groups: list[dict] | None = None,
) -> None:
    """Write an atorch flat checkpoint from full tensors, sharded the way FSDP (use_orig_params) shards them.

    `units` maps an FSDP unit name ('' for the root) to its parameters {name within the unit: tensor}, in
    order; `optim_state` maps a parameter fqn to {state name: tensor shaped like the parameter, or a scalar}.
    """
    import pickle

    import torch
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    suffix = [f"{r:05d}-{world_size:05d}" for r in range(world_size)]
    flat_params: list[dict[str, Any]] = [{} for _ in range(world_size)]
    metas: list[dict[str, Any]] = [{"flat_param_meta": {}, "param_meta": {}} for _ in range(world_size)]
    optim_shards: list[dict[str, Any]] = [{} for _ in range(world_size)]
    for unit, params in units.items():
        names = list(params)
        tensors = [params[n].detach().contiguous() for n in names]
        dtype = tensors[0].dtype
        numels = [t.numel() for t in tensors]
        starts, total = unit_layout(numels, tensors[0].element_size(), world_size)
        flat = torch.zeros(total, dtype=dtype)
        for t, start in zip(tensors, starts, strict=True):
            flat[start : start + t.numel()] = t.reshape(-1).to(dtype)
        size = total // world_size
        for rank in range(world_size):
            flat_params[rank][unit] = flat[rank * size : (rank + 1) * size].clone()
            metas[rank]["flat_param_meta"][unit] = {"numels": tuple(numels), "flat_numel": size}
            for index, in_shard, count, intra in shard_pieces(starts, numels, total, world_size, rank):
                fqn = f"{unit}.{names[index]}" if unit else names[index]
                metas[rank]["param_meta"][fqn] = {
                    "param_names": names[index],
                    "param_shapes": tensors[index].shape,
                    "param_numels": numels[index],
                    "param_offsets": (in_shard, in_shard + count),
                    "pad": total - sum(numels) if rank == world_size - 1 else 0,
                    "rank": rank,
                    "striped_fsdp_name": unit,
                    "flat_numel": size,
                }
                for state, value in (optim_state or {}).get(fqn, {}).items():
                    value = value.detach()
                    if value.dim() == 0:
                        optim_shards[rank][f"{fqn}-{state}"] = value.clone()
                    else:
                        optim_shards[rank][f"{fqn}-{state}"] = value.reshape(-1)[intra : intra + count].clone()
    for rank in range(world_size):
        save_file(flat_params[rank], str(out / f"flat_param.{suffix[rank]}"))
        with open(out / f"flat_meta.{suffix[rank]}", "wb") as fh:
            pickle.dump(metas[rank], fh)
        if optim_state is not None:
            save_file(optim_shards[rank], str(out / f"optim_param.{suffix[rank]}"))
    save_file({k: v.detach().contiguous() for k, v in (buffers or {}).items()}, str(out / "buffers"))
    with open(out / "ckpt_meta", "wb") as fh:
        pickle.dump({"version": 1, "world_size": world_size, "wrap_class": set()}, fh)
    if optim_state is not None:
        groups = param_groups or [{"lr": 0.001, "params": list(optim_state)}]
        with open(out / "optim_meta", "wb") as fh:
            pickle.dump([{**g, "params_names": dict(enumerate(g["params"]))} for g in groups], fh)
