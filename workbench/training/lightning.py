"""A Lightning view: model weights, optimizer state, EMA, hyper-parameters and progress as separate tables.

Works on a Lightning `.ckpt` file (a torch.save zip, format 'torch') and on an FSDP "sharded" `*.ckpt/`
folder (DCP with `model.` / `optimizer_<i>.` keys plus `meta.pt`, format 'dcp'). Nothing is loaded: the
tables come from the catalog and the inert object tree.

Weight names are the LightningModule's state_dict keys (`model.0.weight`). EMA weights are found where
the usual tools put them: Lightning's WeightAveraging (`state_dict` holds the average, the live weights
move to `current_model_state`), a callback or top-level entry holding named tensors (`...ema...`,
`...shadow...`), or torch_ema's unnamed `shadow_params` list, matched to parameters by order and shape
(refused when more than one matching is possible). `strip_prefixes` turns weight names into model names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..catalog import Catalog
from ..errors import CheckpointError, MapperError
from ..formats.pickle.unpickler import describe
from ..formats.torch_zip import walk_tree

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
_FLOAT = ("F16", "BF16", "F32", "F64")
_EMA_HINT = re.compile(r"(^|[._])(ema|shadow\w*|averag\w*|swa)($|[._{])", re.IGNORECASE)
_LIST_INDEX = re.compile(r"^(?P<container>.+)\.(?P<index>\d+)$")


def strip_prefixes(names: Iterable[str], prefixes: Sequence[str] = ("model.",), drop_segments: Sequence[str] = ("_orig_mod",)) -> dict[str, str]:
    """Map each name to itself without its first matching leading prefix and without `drop_segments` anywhere.

    `model._orig_mod.layers.0.weight` -> `layers.0.weight` with the defaults (Lightning's attribute name,
    torch.compile's wrapper). Refuses when two names would become one.
    """
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for name in names:
        new = name
        for prefix in prefixes:
            if new.startswith(prefix):
                new = new[len(prefix):]
                break
        if drop_segments:
            new = ".".join(part for part in new.split(".") if part not in drop_segments)
        if new in owner:
            raise MapperError(
                f"Cannot strip prefixes {list(prefixes)}: {owner[new]!r} and {name!r} would both become {new!r}. "
                "Strip fewer prefixes, or drop one of the two tensors first."
            )
        owner[new] = name
        out[name] = new
    return out


def align_by_order(wanted: Sequence[tuple[int, ...]], candidates: Sequence[tuple[int, ...]]) -> tuple[list[int] | None, int]:
    """Match a sequence of shapes to a subsequence of candidate shapes, keeping order.

    Returns (indices into candidates, number of possible matchings capped at 2); indices is None unless the
    matching is unique.
    """
    n, m = len(wanted), len(candidates)
    if n > m:
        return None, 0
    # ways[i][j]: matchings of wanted[i:] into candidates[j:], capped at 2.
    ways = [[0] * (m + 1) for _ in range(n + 1)]
    for j in range(m + 1):
        ways[n][j] = 1
    for i in range(n - 1, -1, -1):
        row, below = ways[i], ways[i + 1]
        for j in range(m - 1, -1, -1):
            row[j] = min(2, row[j + 1] + (below[j + 1] if wanted[i] == candidates[j] else 0))
    count = ways[0][0]
    if count != 1:
        return None, count
    picked, j = [], 0
    for i in range(n):
        while not (wanted[i] == candidates[j] and ways[i + 1][j + 1] == 1):
            j += 1
        picked.append(j)
        j += 1
    return picked, 1


@dataclass
class LightningInfo:
    """A Lightning checkpoint seen as training parts; `catalog` is the underlying tensor catalog."""

    path: Path
    catalog: Catalog
    root: dict  # the torch.save'd dict (the `.ckpt` file, or `meta.pt` of a sharded folder)
    sharded: bool

    # -- where things are ------------------------------------------------------------------------------------
    @property
    def _weights_prefix(self) -> str:
        if self.sharded:
            return "model."
        return "current_model_state." if self._weight_averaging else "state_dict."

    @property
    def _weight_averaging(self) -> bool:
        return not self.sharded and "current_model_state" in self.root and "state_dict" in self.root

    def weight_sources(self) -> dict[str, str]:
        """LightningModule state_dict key -> catalog tensor name, for the live (non-EMA) weights."""
        prefix = self._weights_prefix
        return {n[len(prefix):]: n for n in self.catalog.tensors if n.startswith(prefix)}

    def _parameter_candidates(self) -> list[str]:
        """Weight names that can be parameters: floating tensors that are not well-known buffers."""
        sources = self.weight_sources()
        return [
            name for name, src in sources.items()
            if self.catalog[src].dtype in _FLOAT and not name.endswith(BUFFER_SUFFIXES)
        ]

    # -- tables ----------------------------------------------------------------------------------------------
    def weights(self) -> pd.DataFrame:
        """Model weights: one row per state_dict key, with the catalog tensor that holds it."""
        return self._tensor_table({name: src for name, src in self.weight_sources().items()}, "weight")

    def optimizer(self) -> pd.DataFrame:
        """Optimizer state tensors: optimizer index, parameter (name when known), state name, source tensor."""
        import pandas as pd

        rows = []
        if self.sharded:
            pattern = re.compile(r"^optimizer_(?P<opt>\d+)\.state\.(?P<param>.+)\.(?P<state>[^.]+)$")
            for name in self.catalog.tensors:
                match = pattern.match(name)
                if match:
                    rows.append({"optimizer": int(match["opt"]), "param_id": None, "param": match["param"], "state": match["state"], "source": name})
        else:
            pattern = re.compile(r"^optimizer_states\.(?P<opt>\d+)\.state\.(?P<pid>\d+)\.(?P<state>.+)$")
            for name in self.catalog.tensors:
                match = pattern.match(name)
                if match:
                    rows.append({"optimizer": int(match["opt"]), "param_id": int(match["pid"]), "param": None, "state": match["state"], "source": name})
            self._name_optimizer_params(rows)
        for row in rows:
            info = self.catalog[row["source"]]
            row.update(dtype=info.dtype, shape=info.shape)
        return pd.DataFrame(rows, columns=["optimizer", "param_id", "param", "state", "source", "dtype", "shape"])

    def _name_optimizer_params(self, rows: list[dict]) -> None:
        """Name parameter ids when the state shapes match the parameters in exactly one way (single optimizer)."""
        if not rows or len({r["optimizer"] for r in rows}) != 1:
            return
        shapes: dict[int, tuple[int, ...]] = {}
        for row in rows:
            if row["state"] not in ("step",) and row["param_id"] not in shapes:
                shapes[row["param_id"]] = self.catalog[row["source"]].shape
        ids = sorted(shapes)
        if ids != list(range(len(ids))):
            return
        candidates = self._parameter_candidates()
        sources = self.weight_sources()
        picked, _ = align_by_order([shapes[i] for i in ids], [self.catalog[sources[c]].shape for c in candidates])
        if picked is not None:
            names = {i: candidates[j] for i, j in zip(ids, picked, strict=True)}
            for row in rows:
                row["param"] = names.get(row["param_id"])

    def ema(self, source: str | None = None, param_names: Sequence[str] | None = None) -> pd.DataFrame:
        """The EMA matching: weight name, EMA source tensor, how it was matched ('name' or 'order')."""
        import pandas as pd

        matches = self._ema_matches(source, param_names, refuse=False)
        rows = [
            {"weight": w, "ema_source": s, "matched_by": how, "dtype": self.catalog[s].dtype, "shape": self.catalog[s].shape}
            for w, (s, how) in matches.items()
        ]
        return pd.DataFrame(rows, columns=["weight", "ema_source", "matched_by", "dtype", "shape"])

    def hyper_parameters(self) -> pd.DataFrame:
        """Hyper-parameters saved by `save_hyperparameters()`, one row per (dotted) key."""
        return self._leaf_table(self.root.get("hyper_parameters", {}), "")

    def progress(self) -> dict[str, Any]:
        """Epoch, global step and the Lightning version that wrote the checkpoint."""
        return {
            "epoch": self.root.get("epoch"),
            "global_step": self.root.get("global_step"),
            "lightning_version": self.root.get("pytorch-lightning_version"),
        }

    def other(self) -> pd.DataFrame:
        """Every remaining non-tensor value (loops, schedulers, callbacks' scalars ...), by dotted key."""
        shown_elsewhere = ("hyper_parameters", "epoch", "global_step", "pytorch-lightning_version", "state_dict", "current_model_state")
        rest = {k: v for k, v in self.root.items() if k not in shown_elsewhere}
        return self._leaf_table(rest, "", with_tensors=False)

    def tables(self) -> dict[str, Any]:
        """Every table at once: weights, optimizer, ema, hyper_parameters, progress, other."""
        return {
            "weights": self.weights(),
            "optimizer": self.optimizer(),
            "ema": self.ema(),
            "hyper_parameters": self.hyper_parameters(),
            "progress": self.progress(),
            "other": self.other(),
        }

    # -- EMA -------------------------------------------------------------------------------------------------
    def ema_sources(self) -> list[str]:
        """Candidate EMA containers (tensor-name prefixes) found in the checkpoint."""
        if self._weight_averaging:
            return ["state_dict."]
        skip = ("state_dict.", "optimizer_states.", "optimizer_", "model.", "current_model_state.")
        found: list[str] = []
        for name in self.catalog.tensors:
            if name.startswith(skip) or not _EMA_HINT.search(name):
                continue
            match = _LIST_INDEX.match(name)
            container = match["container"] + "." if match and "shadow_params" in match["container"] else self._named_container(name)
            if container and container not in found:
                found.append(container)
        return found

    def _named_container(self, name: str) -> str | None:
        for weight in self.weight_sources():
            if name.endswith("." + weight):
                return name[: -len(weight)]
        match = _LIST_INDEX.match(name)
        return match["container"] + "." if match else None

    def ema_matches(self, source: str | None = None, param_names: Sequence[str] | None = None) -> dict[str, tuple[str, str]]:
        """Weight name -> (EMA source tensor, 'name' | 'order'); raises CheckpointError when absent or ambiguous."""
        return self._ema_matches(source, param_names, refuse=True)

    def _ema_matches(self, source: str | None, param_names: Sequence[str] | None, *, refuse: bool = True) -> dict[str, tuple[str, str]]:
        sources = self.ema_sources() if source is None else [source]
        if not sources:
            if refuse:
                raise CheckpointError(f"Cannot find EMA weights in {self.path}: no callback or entry holds them.", file=str(self.path))
            return {}
        if len(sources) > 1:
            if not refuse:
                return {}
            raise CheckpointError(
                f"Cannot choose the EMA weights of {self.path}: several entries could hold them ({', '.join(sources)}). "
                "Pass source=<one of them> to pick one.",
                file=str(self.path),
            )
        prefix = sources[0]
        members = [n for n in self.catalog.tensors if n.startswith(prefix)]
        weights = self.weight_sources()
        by_name = {n[len(prefix):]: n for n in members if n[len(prefix):] in weights}
        if by_name:
            return {w: (s, "name") for w, s in by_name.items()}
        indexed = sorted((int(n[len(prefix):]), n) for n in members if n[len(prefix):].isdigit())
        if not indexed:
            if refuse:
                raise CheckpointError(f"Cannot match EMA entry {prefix!r} of {self.path}: its tensors are neither named like the weights nor a list.", file=str(self.path))
            return {}
        shadow = [n for _, n in indexed]
        if param_names is not None:
            names = list(param_names)
            if len(names) != len(shadow) or any(n not in weights for n in names):
                raise CheckpointError(
                    f"Cannot match EMA entry {prefix!r} of {self.path}: param_names has {len(names)} names (all must be weight "
                    f"names) for {len(shadow)} EMA tensors.",
                    file=str(self.path),
                )
            return {w: (s, "order") for w, s in zip(names, shadow, strict=True)}
        candidates = self._parameter_candidates()
        picked, count = align_by_order([self.catalog[s].shape for s in shadow], [self.catalog[weights[c]].shape for c in candidates])
        if picked is None:
            if not refuse:
                return {}
            why = "no order of the parameters has the EMA tensors' shapes" if count == 0 else "more than one set of parameters fits their shapes in order"
            raise CheckpointError(
                f"Cannot match the {len(shadow)} unnamed EMA tensors of {prefix!r} in {self.path} to parameters: {why}. "
                "Pass param_names=[...] (the model's named_parameters() order) to match them explicitly.",
                file=str(self.path),
            )
        return {candidates[j]: (s, "order") for s, j in zip(shadow, picked, strict=True)}

    # -- helpers ---------------------------------------------------------------------------------------------
    def _tensor_table(self, mapping: dict[str, str], label: str) -> pd.DataFrame:
        import pandas as pd

        rows = [{label: k, "source": s, "dtype": self.catalog[s].dtype, "shape": self.catalog[s].shape, "nbytes": self.catalog[s].nbytes} for k, s in mapping.items()]
        return pd.DataFrame(rows, columns=[label, "source", "dtype", "shape", "nbytes"])

    @staticmethod
    def _leaf_table(tree: Any, prefix: str, *, with_tensors: bool = True) -> pd.DataFrame:
        import pandas as pd

        contents = walk_tree(tree, prefix)
        rows = [{"key": k, "value": v if isinstance(v, (int, float, str, bool)) or v is None else describe(v)} for k, v in contents.leaves]
        if with_tensors:
            rows += [{"key": k, "value": describe(t)} for k, t in contents.tensors]
        return pd.DataFrame(rows, columns=["key", "value"], dtype=object)


def open_lightning(path: str | os.PathLike) -> LightningInfo:
    """Open a Lightning `.ckpt` file or FSDP sharded `*.ckpt/` folder as a LightningInfo (no data read)."""
    from ..formats import open_catalog

    return lightning_info(open_catalog(Path(path)))


def lightning_info(catalog: Catalog) -> LightningInfo:
    """The LightningInfo of an already opened catalog; refuses catalogs that are not Lightning checkpoints."""
    p = catalog.root
    if catalog.format == "torch":
        root = catalog.reader.archive.root  # type: ignore[union-attr]
        sharded = False
    elif catalog.format == "dcp" and getattr(catalog.reader, "meta_reader", None) is not None:
        root = catalog.reader.meta_reader.archive.root  # type: ignore[union-attr]
        sharded = True
    else:
        root = None
        sharded = False
    if not isinstance(root, dict) or not ("pytorch-lightning_version" in root or "state_dict" in root or sharded):
        raise CheckpointError(
            f"Cannot read {p} as a Lightning checkpoint: it is a {catalog.format!r} checkpoint without Lightning's "
            "keys (pytorch-lightning_version, state_dict) or meta.pt. Use open_catalog() for a generic view.",
            file=str(p),
        )
    return LightningInfo(p, catalog, root, sharded)


def lightning_tables(path: str | os.PathLike) -> dict[str, Any]:
    """weights, optimizer, ema, hyper_parameters (DataFrames), progress (dict) and other, for one checkpoint."""
    return open_lightning(path).tables()


def ema_weights(path: str | os.PathLike, *, source: str | None = None, param_names: Sequence[str] | None = None) -> dict[str, str]:
    """Weight name -> catalog tensor holding its EMA value; refuses (CheckpointError) when not unambiguous."""
    info = open_lightning(path)
    return {w: s for w, (s, _) in info._ema_matches(source, param_names).items()}
