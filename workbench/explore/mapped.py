"""A checkpoint seen through a mapper: the mapper's outputs as a read-only catalog, computed on demand.

`ck_a.diff(ck_b, mapper=m)` compares `m` applied to `ck_a` with `ck_b`, so a converted checkpoint can be
checked against its source up to the layout change. Only headers are used until values are asked for;
then each output is computed from its group's inputs alone (one group in memory at a time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..errors import MapperError


class MappedReader:
    """Computes a mapped output's bytes by running the group that produces it (the last group is cached)."""

    def __init__(self, source: Catalog, groups: dict[str, Any]) -> None:
        self.source = source
        self.groups = groups
        self._cached: tuple[int, dict[str, Any]] | None = None

    def _tensor(self, name: str) -> Any:
        from .checkpoint import Checkpoint

        group = self.groups[name]
        if self._cached is None or self._cached[0] != id(group):
            loader = Checkpoint(self.source)
            self._cached = (id(group), group.apply({t.name: loader.load(t.name) for t in group.inputs}))
        return self._cached[1][name]

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The output tensor's bytes, row-major."""
        import torch

        tensor = self._tensor(info.name).contiguous()
        return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""

    def locate(self, info: TensorInfo) -> tuple[Path, int, int] | None:
        """Mapped tensors are computed, never located in a file."""
        return None

    def close(self) -> None:
        """Drop the cached group."""
        self._cached = None


def mapped_catalog(source: Catalog, mapper: Any, rest: str = "keep") -> Catalog:
    """The catalog of `mapper`'s outputs over `source` (binding problems raise MapperError)."""
    from ..planning.sources import bind

    binding = bind(source, mapper, rest)
    errors = [p for p in binding.problems if p.severity == "error"]
    if errors:
        raise MapperError(f"Cannot compare through the mapper: {errors[0].message}")
    groups = {out.name: group for group in binding.groups for out in group.outputs}
    tensors = {name: TensorInfo(name, g_out.dtype, g_out.shape) for name, g_out in
               ((o.name, o) for group in binding.groups for o in group.outputs)}
    return Catalog(root=source.root, format=f"{source.format} (mapped)", tensors=tensors, reader=MappedReader(source, groups))
