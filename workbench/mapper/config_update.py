"""`ConfigUpdate`: a statement that the output's config.json must say something else than the source's.

Some conversions change what the model is, not only where its tensors live: a PEFT merge that unties the output
head from a replaced embedding (`lora_merge`) makes a model whose config must say `tie_word_embeddings: false`,
or loaders that re-tie it compute other logits. A preset states such an edit as a leaf of its mapper, like a
`Claim`: it reads and writes no tensor, travels with the mapper (to_code, JSON, workers), and the plan carries it
(`planning.extras.with_config_updates`): config.json is marked updated, the plan shows
"config.json: tie_word_embeddings true -> false", and the extras step writes the edited file (atomically, by the
same durability policy as every other file) instead of the byte copy. A statement whose key is absent, or already
holds the value, changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import MapperError
from .base import Mapper, NoTensorLeaf

MAX_KEY_PARTS = 8


@dataclass(frozen=True, repr=False)
class ConfigUpdate(NoTensorLeaf):
    """config.json's value at `key` (dotted for nested objects: "text_config.tie_word_embeddings") becomes `value`
    (a JSON scalar: bool, int, finite float, str or None); `why` says which conversion needs it, for the plan."""

    key: str
    value: Any
    why: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key or any(not part for part in self.key.split(".")):
            raise MapperError(f"Cannot build ConfigUpdate: key must be a dotted name such as 'tie_word_embeddings' (got {self.key!r}).")
        if len(self.key.split(".")) > MAX_KEY_PARTS:
            raise MapperError(f"Cannot build ConfigUpdate: key {self.key!r} is nested deeper than {MAX_KEY_PARTS} levels.")
        scalar = self.value is None or isinstance(self.value, (bool, int, str)) or (
            isinstance(self.value, float) and math.isfinite(self.value))
        if not scalar:
            raise MapperError(f"Cannot build ConfigUpdate: value for {self.key!r} must be a JSON scalar (bool, int, finite "
                              f"float, str or None), got {self.value!r}.")
        if not isinstance(self.why, str):
            raise MapperError(f"Cannot build ConfigUpdate: why must be a string (got {self.why!r}).")


def config_updates(mapper: Any) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """({key: value}, {key: why}, conflicts) of every ConfigUpdate leaf of `mapper` (a mapper tree; anything else
    states none). Two statements giving one key different values are a conflict (a message per key)."""
    if not isinstance(mapper, Mapper):
        return {}, {}, []
    values: dict[str, Any] = {}
    whys: dict[str, str] = {}
    conflicts: list[str] = []
    for leaf in mapper.leaves():
        if not isinstance(leaf, ConfigUpdate):
            continue
        if leaf.key in values and values[leaf.key] != leaf.value:
            conflicts.append(f"Cannot edit config.json: the mapper sets {leaf.key!r} to both {values[leaf.key]!r} and "
                             f"{leaf.value!r}. Keep one ConfigUpdate per key.")
            continue
        values[leaf.key] = leaf.value
        whys[leaf.key] = leaf.why
    return values, whys, conflicts
