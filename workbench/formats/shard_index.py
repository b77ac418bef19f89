"""Sharded checkpoints with an HF index (`*.index.json`): the shard each tensor is claimed to be in,
checked against what the shards really hold.

The same rules for every sharded layout, local or remote, safetensors or torch.save: an index entry may
only name a file inside the checkpoint; a tensor stored in two shards, or claimed by the index but not in
its shard, is an error; tensors the index does not list are ignored with a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import repeat

from ..catalog import TensorInfo
from ..errors import CannotRead, CheckpointError

_fail = CannotRead("sharded checkpoint", "Regenerate the index or re-download the shards.")


def shard_map(weight_map: Mapping[str, object], member: Callable[[object, str], str], index_name: str) -> tuple[dict[str, str], list[str]]:
    """(tensor -> shard, sorted shards) from an index's weight map; `member(rel, what)` refuses paths that
    leave the checkpoint and returns each one normalised."""
    shard_of: dict[str, str] = {}
    checked: dict[object, str] = {}
    for name, rel in weight_map.items():
        norm = checked.get(rel) if isinstance(rel, str) else None
        if norm is None:  # a few shards serve every entry: check each path once
            norm = member(rel, f"index {index_name} entry for tensor {name!r}")
            checked[rel] = norm
        shard_of[name] = norm
    return shard_of, sorted(set(shard_of.values()))


def check_shard_present(where: str, index_name: str, rel: str, state: str | None, shard_of: Mapping[str, str]) -> None:
    """Raise when a shard the index names is not there (`state` 'missing') or is not a regular file; `state`
    None means it is fine."""
    if state is None:
        return
    users = [n for n, r in shard_of.items() if r == rel]
    fix = "Download the missing shard." if state == "missing" else "Replace it with the shard file."
    raise _fail(where, f"shard {rel} named by {index_name} is {state} (it should hold {len(users)} tensors)",
                users[0] if users else None, fix=fix)


def check_claims(where: str, index_name: str, shard_of: Mapping[str, str], held: Mapping[str, Sequence[TensorInfo]]) -> tuple[dict[str, TensorInfo], list[str]]:
    """The tensors the index lists, each from the shard that holds it (`held`: shard -> its tensors), and
    warnings; raises when a tensor is in two shards or not where the index says."""
    # The usual case, checked with whole-dict operations: every tensor is in one shard, as the index says.
    every: dict[str, str] = {}
    count = 0
    for rel, infos in held.items():
        every.update(zip([info.name for info in infos], repeat(rel)))
        count += len(infos)
    if count == len(every) and every == shard_of:
        return {info.name: info for infos in held.values() for info in infos}, []
    tensors: dict[str, TensorInfo] = {}
    home: dict[str, str] = {}
    unlisted: list[str] = []
    for rel, infos in held.items():
        for info in infos:
            if info.name in home:
                raise CheckpointError(
                    f"Cannot open checkpoint {where}: tensor {info.name!r} is stored in two shards "
                    f"({home[info.name]} and {rel}). Remove the stale copy or regenerate the checkpoint.",
                    file=rel,
                    tensor=info.name,
                )
            home[info.name] = rel
            if shard_of.get(info.name) == rel:
                tensors[info.name] = info
            else:
                unlisted.append(info.name)
    for name, rel in shard_of.items():
        if name not in tensors:
            found = f"it is in {home[name]}" if name in home else "no shard holds it"
            raise CheckpointError(
                f"Cannot open checkpoint {where}: {index_name} says tensor {name!r} is in {rel}, but {found}. "
                "The index and the shards disagree: regenerate the index or re-download the shards.",
                file=rel,
                tensor=name,
            )
    warnings = []
    if unlisted:
        warnings.append(f"{len(unlisted)} tensors stored in shards are not listed in {index_name} and are ignored "
                        f"(e.g. {unlisted[0]!r}).")
    return tensors, warnings
