"""Who holds what, across the ranks of a distributed save: one catalog of the whole model, and for each
tensor the ranks that can produce it whole.

Every rank publishes its state keys (dtype, global shape, and the ranks of the DTensor mesh that
shards it, or itself for a plain tensor). Merged in (pipeline stage, rank) order, they give the
catalog a single-process save of the whole model would see, so the planner lays out identical
files. A key is gathered once, by the ranks of its first holder's group (its canonical replica).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..catalog import Catalog, TensorInfo
from ..errors import PlanError
from ..module_state import StateEntry

# (key, dtype, shape, group, sharded): plain data, cheap to pickle for all_gather_object.
Record = tuple[str, str, tuple[int, ...], tuple[int, ...], bool]


def publish(state: dict[str, StateEntry], rank: int, *, drop_tied: bool = True) -> list[Record]:
    """This rank's state keys as records (tied duplicates left out when `drop_tied`)."""
    records = []
    for entry in state.values():
        if drop_tied and entry.tied:
            continue
        if entry.distributed:
            group = tuple(sorted(int(r) for r in entry.tensor.device_mesh.mesh.flatten().tolist()))
        else:
            group = (rank,)
        records.append((entry.key, entry.info.dtype, entry.info.shape, group, entry.distributed))
    return records


@dataclass
class Holdings:
    """The whole model's keys in save order, and where each one can be obtained whole."""

    infos: list[TensorInfo]
    source_group: dict[str, tuple[int, ...]] = field(default_factory=dict)  # ranks that gather the canonical copy
    sharded: dict[str, bool] = field(default_factory=dict)  # the canonical copy is a DTensor (gathered collectively)
    plain: dict[str, frozenset[int]] = field(default_factory=dict)  # ranks holding a whole plain copy

    def holders(self, key: str) -> frozenset[int]:
        """Ranks that end up with `key` whole without receiving it."""
        return frozenset(self.source_group[key]) | self.plain.get(key, frozenset())

    def catalog(self, name: str) -> Catalog:
        """A data-less catalog of the whole model (what the planner lays out)."""
        return Catalog.from_infos(self.infos, root=f"<module {name}>", format="module")


def merge(published: Sequence[tuple[int | None, list[Record]]]) -> Holdings:
    """Merge every rank's (stage, records) into Holdings; refuse keys that would be silently lost.

    With stages, a key published by two stages is an error (stage modules must keep their global
    names). Without stages, a key shared by ranks that hold different sets of keys is one too: they
    are not replicas of each other, so one rank's tensor would silently replace the other's.
    """
    order = sorted(range(len(published)), key=lambda r: (published[r][0] or 0, r))
    key_sets = [frozenset(record[0] for record in records) for _, records in published]
    infos: dict[str, TensorInfo] = {}
    first: dict[str, int] = {}
    publishers: dict[str, set[int]] = {}
    holdings = Holdings([])
    for rank in order:
        stage, records = published[rank]
        for key, dtype, shape, group, sharded in records:
            info = TensorInfo(key, dtype, tuple(shape))
            if key not in infos:
                infos[key] = info
                first[key] = rank
                holdings.source_group[key] = tuple(group)
                holdings.sharded[key] = sharded
            else:
                _check_replica(key, info, infos[key], rank, first[key], published, key_sets)
            publishers.setdefault(key, set()).add(rank)
            if not sharded:
                holdings.plain[key] = holdings.plain.get(key, frozenset()) | {rank}
    for key, group in holdings.source_group.items():
        absent = sorted(set(group) - publishers[key])
        if absent:
            raise PlanError(
                f"Cannot save {key!r}: it is a DTensor over ranks {list(group)} but rank {absent[0]} does not hold it, so it "
                "cannot be gathered. Every rank of a parameter's device mesh must call save_from with the same model.",
                tensor=key,
            )
    holdings.infos = list(infos.values())
    return holdings


def _check_replica(key: str, info: TensorInfo, known: TensorInfo, rank: int, other: int,
                   published: Sequence[tuple[int | None, list[Record]]], key_sets: list[frozenset[str]]) -> None:
    if (info.dtype, info.shape) != (known.dtype, known.shape):
        raise PlanError(
            f"Cannot save {key!r}: rank {other} holds it as {known.dtype} {list(known.shape)} but rank {rank} as "
            f"{info.dtype} {list(info.shape)}. Every rank must describe the same model.",
            tensor=key,
        )
    stage, other_stage = published[rank][0], published[other][0]
    if stage is not None and stage != other_stage:
        raise PlanError(
            f"Cannot save {key!r}: pipeline stages {other_stage} (rank {other}) and {stage} (rank {rank}) both hold it, so "
            "one stage's tensor would overwrite the other's. Keep the model's global names in each stage's module "
            "(e.g. layers in an nn.ModuleDict keyed by the global layer index).",
            tensor=key,
        )
    if stage is None and key_sets[rank] != key_sets[other]:
        raise PlanError(
            f"Cannot save {key!r}: ranks {other} and {rank} both hold it but hold different sets of tensors, so they are not "
            "replicas (pipeline stages reusing local names?). Pass mesh= and pp_dim= to save_from, and keep the "
            "model's global names in each stage's module.",
            tensor=key,
        )
