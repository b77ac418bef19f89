"""A live module's state as metadata: state keys with dtype and global shape, ties recognised.

A module's state is what `state_dict()` lists (parameters and persistent buffers), with tied tensors
(one Parameter under several names, e.g. an LM head sharing the embedding) recognised by identity,
and distributed tensors (DTensor, FSDP2) described by their global shape. Like the catalog, it is shared
vocabulary under both of its users: the mapper checks targets against it (`check_target` with a model,
`check_module`, `from_module`), and `model_io` loads and saves through it. Nothing here copies data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .catalog import TensorInfo
from .dtypes import from_torch
from .errors import MapperError


@dataclass(frozen=True)
class StateEntry:
    """One state key of a module: the live tensor, its global metadata, and the key it is tied to."""

    key: str
    tensor: Any  # the Parameter / buffer / DTensor itself (state_dict(keep_vars=True))
    info: TensorInfo  # global dtype and shape, no location
    leader: str  # the first key holding the same tensor (== key when untied)
    persistent: bool = True  # False: a buffer `state_dict()` leaves out (a load fills it only if the source has it)

    @property
    def tied(self) -> bool:
        """True when an earlier key holds the same tensor."""
        return self.leader != self.key

    @property
    def distributed(self) -> bool:
        """True for a DTensor (FSDP2 / tensor-parallel parameter): each rank holds a part."""
        return is_dtensor(self.tensor)


def is_dtensor(tensor: Any) -> bool:
    """True for a torch.distributed DTensor, without importing torch.distributed when it is not loaded."""
    return any(cls.__name__ == "DTensor" for cls in type(tensor).__mro__)


def _meta_of(key: str, tensor: Any) -> TensorInfo:
    try:
        dtype = from_torch(tensor.dtype)
    except Exception:
        raise MapperError(
            f"Cannot describe state key {key!r}: its dtype {tensor.dtype} has no safetensors code. Cast it first.", tensor=key
        ) from None
    return TensorInfo(key, dtype, tuple(int(size) for size in tensor.shape))


def module_state(model: Any) -> dict[str, StateEntry]:
    """Every state key of `model` in `state_dict()` order, with global metadata and ties."""
    state = model.state_dict(keep_vars=True)
    first_key: dict[int, str] = {}
    entries: dict[str, StateEntry] = {}
    for key, tensor in state.items():
        if not hasattr(tensor, "dtype") or not hasattr(tensor, "shape"):
            raise MapperError(
                f"Cannot describe state key {key!r} of {type(model).__name__}: it is a {type(tensor).__name__}, not a tensor "
                "(extra state is not supported). Remove it from the module's state or load it separately.",
                tensor=key,
            )
        leader = first_key.setdefault(id(tensor), key)
        entries[key] = StateEntry(key, tensor, _meta_of(key, tensor), leader)
    return entries
