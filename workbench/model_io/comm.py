"""The process group as model I/O uses it, and where a rank sits in a pipeline.

Outside `torch.distributed` (or with one process) the world is this process alone and every
collective is trivial, so the single-process and distributed paths run the same code.
"""

from __future__ import annotations

import sys
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import to_torch
from ..errors import PlanError


class Comm:
    """Rank, world size and the few collectives model I/O needs (objects, and tensors as raw bytes)."""

    def __init__(self) -> None:
        dist = sys.modules.get("torch.distributed")
        self.dist = dist if dist is not None and dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world = self.dist.get_world_size() if self.dist else 1

    @property
    def distributed(self) -> bool:
        """True with more than one process."""
        return self.world > 1

    def all_gather(self, value: Any) -> list[Any]:
        """`value` from every rank, in rank order."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def _device(self) -> str:
        return "cuda" if self.dist.get_backend() == "nccl" else "cpu"

    def send(self, tensor: Any, dst: int) -> None:
        """Send a tensor's bytes to rank `dst` (which calls `recv` with its metadata)."""
        if tensor.numel() == 0:
            return
        payload = tensor.detach().contiguous().reshape(-1).view(_uint8()).to(self._device())
        self.dist.send(payload, dst=dst)

    def recv(self, info: TensorInfo, src: int) -> Any:
        """Receive the tensor `info` describes from rank `src`, on the CPU."""
        import torch

        dtype = to_torch(info.dtype)
        if info.numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        payload = torch.empty(info.nbytes, dtype=torch.uint8, device=self._device())
        self.dist.recv(payload, src=src)
        return payload.cpu().view(dtype).reshape(info.shape)


def _uint8() -> Any:
    import torch

    return torch.uint8


def stage_of(mesh: Any, pp_dim: int | str, rank: int) -> int:
    """The pipeline stage of `rank`: its coordinate along `pp_dim` of the DeviceMesh, wherever that dim is."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    grid = mesh.mesh
    if isinstance(pp_dim, str):
        if pp_dim not in names:
            raise PlanError(
                f"Cannot find the pipeline dimension {pp_dim!r} in the device mesh (dimensions: {list(names) or 'unnamed'}). "
                "Pass pp_dim as one of the mesh_dim_names, or as a dimension index."
            )
        dim = names.index(pp_dim)
    else:
        dim = int(pp_dim)
        if not 0 <= dim < grid.dim():
            raise PlanError(f"Cannot use pp_dim={pp_dim}: the device mesh has {grid.dim()} dimension(s).")
    where = (grid == rank).nonzero()
    if len(where) == 0:
        raise PlanError(f"Cannot place rank {rank} in the pipeline: it is not in the device mesh {grid.tolist()}.")
    return int(where[0][dim])
