"""The `__metadata__` of each output shard: the source's, where it is unambiguous.

LoRA trainers and diffusion tools key on safetensors header metadata (`ss_network_dim`,
`modelspec.architecture` ...), so a conversion carries it over. An output shard takes a key when
every source file its tensors come from carries that key with the same value (always true when one
source file feeds the shard); a key the files disagree on, or that only some of them carry, is dropped
and the plan says why. `format` is always present (`pt` unless the sources agree on another value).
Keys are sorted, so the header bytes never depend on the order files or tensors were met in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..catalog import TensorInfo
from ..output.safetensors import DEFAULT_METADATA


@dataclass
class HeaderMetadata:
    """Chooses each output shard's metadata from the per-file metadata of the source, and records the choices."""

    per_file: Mapping[str, Mapping[str, str]]
    kept: dict[str, str] = field(default_factory=dict)  # key -> value kept in at least one output
    dropped: dict[str, str] = field(default_factory=dict)  # key -> why an output lost it (first reason met)

    def choose(self, sources: Iterable[str]) -> dict[str, str]:
        """The metadata of one output shard whose tensors come from the source files `sources`."""
        files = sorted(set(sources))
        metas = [self.per_file.get(rel, {}) for rel in files]
        chosen: dict[str, str] = {}
        for key in sorted({k for m in metas for k in m}):
            values = [m.get(key) for m in metas]
            present = [v for v in values if v is not None]
            if len(present) == len(values) and len(set(present)) == 1:
                chosen[key] = present[0]
            elif key != "format":
                self._drop(key, files, values)
        for key, value in chosen.items():
            self.kept.setdefault(key, value)
        if "format" not in chosen:
            chosen["format"] = DEFAULT_METADATA["format"]
        return dict(sorted(chosen.items()))

    def _drop(self, key: str, files: list[str], values: list[str | None]) -> None:
        if key in self.dropped:
            return
        distinct = sorted({v for v in values if v is not None})
        if len(distinct) > 1:
            shown = ", ".join(f"{rel}: {_short(v)}" for rel, v in zip(files, values, strict=True) if v is not None)
            self.dropped[key] = f"the source files of one output shard disagree ({shown})"
        else:
            missing = [rel for rel, v in zip(files, values, strict=True) if v is None]
            self.dropped[key] = f"only some source files of one output shard carry it (not {', '.join(missing[:3])})"

    @property
    def interesting(self) -> bool:
        """True when the source has metadata beyond `format` (worth a line in the plan)."""
        return any(k != "format" for m in self.per_file.values() for k in m)


def _short(value: str, limit: int = 40) -> str:
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")


def shard_sources(step_inputs: Iterable[tuple[Sequence[TensorInfo], Sequence[int]]], n_shards: int) -> list[set[str]]:
    """For each shard number, the source files whose tensors feed it (from each step's inputs and shard numbers)."""
    sources: list[set[str]] = [set() for _ in range(n_shards)]
    for inputs, shards in step_inputs:
        if len(inputs) == 1 and len(shards) == 1:  # one tensor into one shard: 100k times on big checkpoints
            sources[shards[0]].add(inputs[0].file)
            continue
        files = [t.file for t in inputs]
        for k in shards:
            sources[k].update(files)
    return sources
