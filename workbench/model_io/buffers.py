"""Recompute the non-persistent buffers a meta module lost, with the module's own initialisation.

A module built under `torch.device("meta")` has no values for the buffers its constructor computed
(rotary `inv_freq`, BERT's `position_ids`), and `state_dict()` leaves them out, so a checkpoint seldom
holds them. After a load, each module owning such a buffer is re-initialised by its own code, tried in
this order until every lost buffer of it has a value:

- transformers: `_init_weights(module)` of the `PreTrainedModel` governing it (the innermost one on its
  path, as `initialize_weights` dispatches), the hook `from_pretrained` itself recomputes them with;
- any module: its `reset_parameters()` (the torch convention), then `init_weights()`, when callable
  without arguments.

A hook runs on a twin of the owning module whose parameters and other buffers are on the meta device,
so it may re-initialise weights freely: nothing loaded is touched and nothing is allocated but the
lost buffers. It runs twice, with those buffers first zeroed and then filled with one-bits; a value is
accepted only when both runs give the same bits, i.e. it does not depend on the garbage it replaced.
Since the twin needs no loaded value, a load computes these values before reading anything, and can
refuse a buffer nothing sets without side effects.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import PlanError
from .local_part import local_part, local_tensor

OnUninitialized = Literal["error", "meta", "empty"]
ON_UNINITIALIZED = ("error", "meta", "empty")
FALLBACK_METHODS = ("reset_parameters", "init_weights")
NO_HOOK = "no initialisation hook found (no transformers _init_weights, reset_parameters() or init_weights())"


class UninitializedBufferError(PlanError):
    """A meta module has non-persistent buffers that neither the source nor the module's own
    initialisation gives values (`keys` names them); raised before the load reads or allocates anything."""

    def __init__(self, message: str, keys: list[str]) -> None:
        super().__init__(message, tensor=keys[0] if keys else None)
        self.keys = keys


@dataclass(frozen=True)
class Hook:
    """One way to re-initialise a module: `run(twin)` with a description for the report."""

    description: str
    run: Callable[[Any], None]


@dataclass(frozen=True)
class BufferInit:
    """The lost buffers of one module (`owner`, its dotted name) and the hooks to try on it, in order."""

    owner: str
    attrs: tuple[str, ...]
    hooks: tuple[Hook, ...]

    @property
    def keys(self) -> list[str]:
        """The buffers' dotted names in the model."""
        return [f"{self.owner}.{attr}" if self.owner else attr for attr in self.attrs]


def _governor(model: Any, owner: str) -> Any:
    """The innermost transformers PreTrainedModel on the path to `owner` (itself included), if any."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    module = model
    found = model if isinstance(model, PreTrainedModel) else None
    for part in owner.split(".") if owner else ():
        module = module._modules[part]
        if isinstance(module, PreTrainedModel):
            found = module
    return found


def _without_arguments(method: Any) -> bool:
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def hooks_for(model: Any, owner: str) -> tuple[Hook, ...]:
    """The initialisation hooks that may recompute buffers of the module named `owner`, in the order tried."""
    module = model.get_submodule(owner) if owner else model
    where = owner or "the model"
    hooks = []
    governor = _governor(model, owner)
    if governor is not None and callable(getattr(governor, "_init_weights", None)):
        hooks.append(Hook(f"{type(governor).__name__}._init_weights({where})", governor._init_weights))
    for name in FALLBACK_METHODS:
        method = getattr(module, name, None)
        if callable(method) and _without_arguments(method):
            hooks.append(Hook(f"{type(module).__name__}.{name}() of {where}", lambda twin, name=name: getattr(twin, name)()))
    return tuple(hooks)


def plan_buffer_inits(model: Any, keys: list[str]) -> list[BufferInit]:
    """Group the lost buffers `keys` by owning module and find the hooks that may recompute each."""
    owners: dict[str, list[str]] = {}
    for key in keys:
        owner, _, attr = key.rpartition(".")
        owners.setdefault(owner, []).append(attr)
    return [BufferInit(owner, tuple(attrs), hooks_for(model, owner)) for owner, attrs in owners.items()]


def _meta_like(tensor: Any) -> Any:
    import torch

    empty = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty


def _twin(module: Any, real: Mapping[str, Any], memo: dict[int, Any] | None = None) -> Any:
    """A copy of `module` (same class and attributes) whose tensors are all on meta but `real`'s buffers."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    twin = object.__new__(type(module))  # no __new__/__init__ of the class: FSDP2 classes rebuild themselves there
    memo[id(module)] = twin
    state = twin.__dict__
    state.update(module.__dict__)
    state["_parameters"] = {n: None if p is None else _meta_like(p) for n, p in module._parameters.items()}
    state["_buffers"] = {n: real[n] if n in real else (None if b is None else _meta_like(b)) for n, b in module._buffers.items()}
    state["_modules"] = {n: None if c is None else _twin(c, {}, memo) for n, c in module._modules.items()}
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    return twin


def _sentinel(buffer: Any, device: Any, ones: bool) -> Any:
    """A tensor of the buffer's global shape and dtype on `device`, all bits zero or all bits one."""
    import torch

    value = torch.empty(tuple(buffer.shape), dtype=buffer.dtype, device=device)
    if not ones:
        return value.zero_()
    if value.dtype == torch.bool:
        return value.fill_(True)
    value.reshape(-1).view(torch.uint8).fill_(255)
    return value


def _bits(tensor: Any) -> Any:
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _run(hook: Hook, owner: Any, attrs: tuple[str, ...], device: Any, ones: bool) -> dict[str, Any]:
    """Run `hook` on a twin of `owner`; per buffer the value it left, or why there is none (a str)."""
    import torch

    twin = _twin(owner, {attr: _sentinel(owner._buffers[attr], device, ones) for attr in attrs})
    try:
        with torch.no_grad():
            hook.run(twin)
    except Exception as exc:  # a hook of any module may fail in any way: report it, try the next
        return {attr: f"{hook.description} raised {type(exc).__name__}: {exc}" for attr in attrs}
    results: dict[str, Any] = {}
    for attr in attrs:
        value, held = twin._buffers.get(attr), owner._buffers[attr]
        if not isinstance(value, torch.Tensor) or value.is_meta:
            results[attr] = f"{hook.description} leaves it without a value"
        elif tuple(value.shape) != tuple(held.shape) or value.dtype != held.dtype:
            results[attr] = (f"{hook.description} makes it {value.dtype} {list(value.shape)} but the module holds "
                             f"{held.dtype} {list(held.shape)}")
        else:
            results[attr] = value.detach()
    return results


def _compute_one(model: Any, init: BufferInit, device: Any) -> tuple[dict[str, Recomputed], dict[str, str]]:
    owner = model.get_submodule(init.owner) if init.owner else model
    done: dict[str, Recomputed] = {}
    why: dict[str, list[str]] = {attr: [] for attr in init.attrs}
    for hook in init.hooks:
        todo = tuple(attr for attr in init.attrs if attr not in done)
        if not todo:
            break
        zeros, ones = _run(hook, owner, todo, device, ones=False), _run(hook, owner, todo, device, ones=True)
        for attr in todo:
            first, second = zeros[attr], ones[attr]
            if isinstance(first, str) or isinstance(second, str):
                why[attr].append(first if isinstance(first, str) else second)
            elif not _same_bits(first, second):
                why[attr].append(f"{hook.description} does not set it (its value depends on the uninitialised memory)")
            else:
                done[attr] = Recomputed(first, hook.description)
    prefix = f"{init.owner}." if init.owner else ""
    failed = {prefix + attr: "; ".join(reasons) or NO_HOOK for attr, reasons in why.items() if attr not in done}
    return {prefix + attr: value for attr, value in done.items()}, failed


@dataclass(frozen=True)
class Recomputed:
    """A buffer's value as its module's initialisation computes it, and which hook did."""

    value: Any
    how: str


def compute_buffers(model: Any, inits: list[BufferInit], device: Any) -> tuple[dict[str, Recomputed], dict[str, str]]:
    """The values of the lost buffers, computed on `device` without touching `model` (which may still be on
    meta): (key -> value and the hook that computed it, key -> why no hook gives it a value)."""
    values: dict[str, Recomputed] = {}
    failed: dict[str, str] = {}
    for init in inits:
        done, missed = _compute_one(model, init, device)
        values.update(done)
        failed.update(missed)
    return values, failed


def write_buffers(model: Any, values: Mapping[str, Recomputed]) -> dict[str, str]:
    """Copy computed values into the (materialised) buffers; returns key -> how each was computed."""
    import torch

    with torch.no_grad():
        for key, computed in values.items():
            held = model.get_buffer(key)
            local_tensor(held).copy_(local_part(held, key).take(computed.value))
    return {key: computed.how for key, computed in values.items()}


def keep_on_meta(model: Any, keys: list[str]) -> None:
    """Put these buffers back on the meta device, so that a forward pass using them fails loudly."""
    import torch

    for key in keys:
        owner_name, _, attr = key.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        held = owner._buffers[attr]
        owner._buffers[attr] = torch.empty(tuple(held.shape), dtype=held.dtype, device="meta")


def check_on_uninitialized(value: str) -> None:
    """Refuse an unknown `on_uninitialized` policy, naming the accepted ones."""
    if value not in ON_UNINITIALIZED:
        raise PlanError(
            f"Cannot load with on_uninitialized={value!r}: it must be one of {', '.join(map(repr, ON_UNINITIALIZED))} "
            "('error': refuse buffers nothing can set; 'meta': leave them on the meta device; 'empty': leave them uninitialised)."
        )


def uninitialized_error(module_name: str, source_name: str, failed: Mapping[str, str]) -> UninitializedBufferError:
    """The error for buffers that nothing sets (raised before anything is read or allocated)."""
    listed = "; ".join(f"{key!r}: {why}" for key, why in list(failed.items())[:10])
    more = f"; ... and {len(failed) - 10} more" if len(failed) > 10 else ""
    return UninitializedBufferError(
        f"Cannot load {source_name} into {module_name}: {len(failed)} non-persistent buffer(s) are on the meta device, "
        f"not in the source, and not recomputed by the module's own initialisation ({listed}{more}). Nothing was "
        "read or allocated. "
        "Give the owning module a reset_parameters() that sets them, build the model with these buffers on a real "
        "device (only the parameters on meta), or pass on_uninitialized='meta' (keep them on meta) or 'empty' "
        "(leave them uninitialised) and set them yourself.",
        list(failed),
    )
