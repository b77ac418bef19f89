"""What a load may fill in a module, and giving meta modules real storage.

The state keys themselves (`module_state`, `StateEntry`) are described in `workbench.module_state`
and re-exported here. A load also accepts the
non-persistent buffers (`load_state`): a checkpoint may hold them (BERT's `position_ids` once was
persistent), and when it does not, a meta module must have them recomputed. Nothing here copies data.
"""

from __future__ import annotations

from typing import Any

from ..module_state import StateEntry, _meta_of, is_dtensor, module_state


def non_persistent_buffers(model: Any) -> dict[str, Any]:
    """Every buffer `state_dict()` leaves out (registered with persistent=False), by its dotted name, in
    `named_buffers()` order."""
    found: dict[str, Any] = {}
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():  # in registration order (the set has none)
            if buffer is not None and attr in module._non_persistent_buffers_set:
                found[f"{module_name}.{attr}" if module_name else attr] = buffer
    return found


def load_state(model: Any) -> dict[str, StateEntry]:
    """The keys a load may fill: the state keys, then the non-persistent buffers (`persistent=False`)."""
    entries = module_state(model)
    first_key = {id(e.tensor): e.leader for e in entries.values()}
    for key, buffer in non_persistent_buffers(model).items():
        if key not in entries:
            leader = first_key.setdefault(id(buffer), key)
            entries[key] = StateEntry(key, buffer, _meta_of(key, buffer), leader, persistent=False)
    return entries


def _split_key(key: str) -> tuple[str, str]:
    module, _, attr = key.rpartition(".")
    return module, attr


def _holder(model: Any, key: str) -> tuple[Any, str]:
    module_name, attr = _split_key(key)
    return (model.get_submodule(module_name) if module_name else model), attr


def on_meta(model: Any) -> bool:
    """True when some parameter or buffer lives on the meta device (no storage yet)."""
    import itertools

    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _real_tensors(model: Any) -> list[tuple[str, str, str, Any]]:
    """(module, table, attribute, tensor) of every plain parameter and buffer that already has storage."""
    found = []
    for module_name, module in model.named_modules():
        for table in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, table).items():
                if tensor is not None and not tensor.is_meta and not is_dtensor(tensor):
                    found.append((module_name, table, attr, tensor))
    return found


def _moved(tensor: Any, device: Any, memo: dict[int, Any]) -> Any:
    import torch

    if id(tensor) not in memo:
        moved = tensor.to(device)
        if isinstance(tensor, torch.nn.Parameter) and moved is not tensor:
            moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = moved
    return memo[id(tensor)]


def materialize(model: Any, device: Any) -> None:
    """Give the meta tensors of a module real (uninitialised) storage on `device`, keeping ties and the
    tensors that already had values. What no checkpoint fills afterwards holds garbage."""
    before = module_state(model)
    ties = [(e.key, e.leader) for e in before.values() if e.tied]
    real = _real_tensors(model)
    model.to_empty(device=device)  # the one call FSDP2 modules follow; it also empties what had values ...
    memo: dict[int, Any] = {}
    for module_name, table, attr, tensor in real:  # ... so those are put back
        getattr(model.get_submodule(module_name), table)[attr] = _moved(tensor, device, memo)
    for key, leader in ties:  # to_empty replaces Parameters one module at a time, which unties them
        owner, attr = _holder(model, key)
        source, source_attr = _holder(model, leader)
        tensors = owner._parameters if attr in owner._parameters else owner._buffers
        value = getattr(source, source_attr)
        if tensors.get(attr) is not value:
            tensors[attr] = value
