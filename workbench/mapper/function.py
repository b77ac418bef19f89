"""`Function`: a custom operation naming an importable callable, for what the vocabulary lacks.

The callable is named by reference ("package.module:function") rather than held as an object, so a
mapper that uses it still exports to code and JSON and ships to torchrun workers. It receives the
input tensors positionally (in `inputs` order) plus `params` as keywords, and returns one tensor,
a sequence of tensors in `outputs` order, or a mapping output name -> tensor.

Metadata comes from the optional `infer` callable (same arguments, TensorInfos instead of tensors,
returning (dtype, shape) pairs or TensorInfos); without it the function is run once on torch 'meta'
tensors, which costs no memory but imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..dtypes import from_torch, normalize_dtype, to_torch
from ..errors import MapperError, WorkbenchError
from .base import Meta
from .op import Op


def _freeze(value: Any, where: str) -> Any:
    """Params must survive JSON: scalars, strings, None, and lists/dicts of those (stored as tuples)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, where) for item in value)
    raise MapperError(
        f"Cannot build {where}: parameter value {value!r} is not JSON-friendly. "
        "Use numbers, strings, booleans, None or lists of those."
    )


def resolve(reference: str, where: str) -> Any:
    """Import the object named 'package.module:attribute.path'."""
    module_name, _, attribute = reference.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's to fix
        raise MapperError(
            f"Cannot use {where}: module {module_name!r} does not import ({type(exc).__name__}: {exc}). "
            "Make it importable (installed, or on PYTHONPATH) on every process that runs the mapper."
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise MapperError(f"Cannot use {where}: {module_name!r} has no attribute {attribute!r}. Check the name after ':'.")
        target = getattr(target, part)
    if not callable(target):
        raise MapperError(f"Cannot use {where}: {reference!r} is not callable. Name a function.")
    return target


def _check_reference(reference: Any, field: str) -> str:
    module_name, colon, attribute = reference.partition(":") if isinstance(reference, str) else ("", "", "")
    if not (colon and module_name and attribute):
        raise MapperError(
            f"Cannot build Function: {field}={reference!r} must name a callable as 'package.module:function'."
        )
    return reference


@dataclass(frozen=True, repr=False)
class Function(Op):
    """Custom operation: `fn` ('pkg.mod:func') maps `inputs` to `outputs`; `infer` gives output metadata."""

    fn: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    infer: str | None = None
    params: tuple[tuple[str, Any], ...] = ()

    NAME_LIST_FIELDS = ("inputs", "outputs")

    def __post_init__(self) -> None:
        _check_reference(self.fn, "fn")
        if self.infer is not None:
            _check_reference(self.infer, "infer")
        self._normalize()
        if not self.inputs:
            raise MapperError(f"Cannot build Function {self.fn!r}: it needs at least one input tensor.")
        params = self.params.items() if isinstance(self.params, Mapping) else self.params
        frozen = []
        for key, value in params:
            if not isinstance(key, str):
                raise MapperError(f"Cannot build Function {self.fn!r}: parameter names must be strings (got {key!r}).")
            frozen.append((key, _freeze(value, f"Function {self.fn!r}")))
        self._set("params", tuple(sorted(frozen)))

    def rows(self, group: Any, ahead: tuple[Any, ...] = ()) -> Any:
        """The row job (`mapper.row_jobs.RowJob`) this function offers for its bound `group`, `ahead` being the ops
        applied before it in the group; None when its callable offers none (no `rows` attribute, or its module is
        not imported: asking never imports)."""
        from .row_jobs import offered_rows

        offer = offered_rows(self.fn)
        return offer(self, group, ahead) if offer is not None else None

    @property
    def kwargs(self) -> dict[str, Any]:
        """`params` as keyword arguments (tuples turned back into lists)."""
        return {key: _thaw(value) for key, value in self.params}

    def _normalize_outputs(self, result: Any, kind: str) -> list[Any]:
        if isinstance(result, Mapping):
            missing = [name for name in self.outputs if name not in result]
            if missing:
                raise MapperError(f"Cannot apply {self.short()}: its {kind} returned no {missing[0]!r}. Return every declared output.")
            return [result[name] for name in self.outputs]
        if len(self.outputs) == 1 and not isinstance(result, (list, tuple)):
            return [result]
        if not isinstance(result, (list, tuple)) or len(result) != len(self.outputs):
            count = len(result) if isinstance(result, (list, tuple)) else 1
            raise MapperError(
                f"Cannot apply {self.short()}: its {kind} returned {count} result(s) for {len(self.outputs)} declared "
                "outputs. Return one per output, in `outputs` order."
            )
        return list(result)

    def _infer(self, metas: list[Meta]) -> list[Meta]:
        if self.infer is None:
            return self._infer_on_meta_device(metas)
        from ..catalog import TensorInfo

        infos = [TensorInfo(name, dtype, shape) for name, (dtype, shape) in zip(self.inputs, metas, strict=False)]
        try:
            result = resolve(self.infer, self.short())(*infos, **self.kwargs)
        except WorkbenchError:
            raise
        except Exception as exc:
            raise MapperError(f"Cannot infer outputs of {self.short()}: infer raised {type(exc).__name__}: {exc}.") from None
        out: list[Meta] = []
        for item in self._normalize_outputs(result, "infer"):
            dtype, shape = (item.dtype, item.shape) if hasattr(item, "dtype") and hasattr(item, "shape") else item
            out.append((normalize_dtype(dtype), tuple(int(size) for size in shape)))
        return out

    def _infer_on_meta_device(self, metas: list[Meta]) -> list[Meta]:
        import torch

        fn = resolve(self.fn, self.short())
        try:
            tensors = [torch.empty(shape, dtype=to_torch(dtype), device="meta") for dtype, shape in metas]
            result = self._normalize_outputs(fn(*tensors, **self.kwargs), "fn")
            return [(from_torch(t.dtype), tuple(t.shape)) for t in result]
        except MapperError:
            raise
        except Exception as exc:
            raise MapperError(
                f"Cannot infer outputs of {self.short()} without data: running it on 'meta' tensors failed "
                f"({type(exc).__name__}: {exc}). Pass infer='package.module:function' returning the output dtypes and shapes."
            ) from None

    def _compute(self, tensors: list[Any]) -> list[Any]:
        fn = resolve(self.fn, self.short())
        try:
            result = fn(*tensors, **self.kwargs)
        except Exception as exc:
            raise MapperError(f"Cannot apply {self.short()}: the function raised {type(exc).__name__}: {exc}.") from None
        return self._normalize_outputs(result, "fn")


def _thaw(value: Any) -> Any:
    return [_thaw(item) for item in value] if isinstance(value, tuple) else value


MAIN_MODULES = ("__main__", "__mp_main__")


def _in_a_torchrun_job() -> bool:
    """True in a process torchrun started (every rank then runs this same main program, so `__main__` is the same)."""
    import os

    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _importable(module_name: str) -> bool:
    """Whether a worker process can import `module_name` as this process did: a mapper file (its text travels
    with the job, see mapper.files.import_context) or a module the import system finds."""
    import importlib.util

    from .files import _LOADED

    if module_name.partition(".")[0] in _LOADED:
        return True
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def _main_name() -> str | None:
    """The importable name of this program's main module (`python -m pkg.script` -> 'pkg.script'), or None
    (a script run by path, a notebook kernel, an interactive session)."""
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    return name if name and name not in MAIN_MODULES else None


def rank_problems(mapper: Any, nproc: int) -> list[str]:
    """Why `mapper`'s Functions cannot run on `nproc` separate worker processes (empty when they can).

    Workers rebuild the mapper from its JSON, which names each callable by module; they import that module
    themselves. A callable defined in `__main__` (a notebook cell, the script being run) names the worker's
    own main program there, not this one. Its code is not shipped instead: only part of a notebook cell's
    source is reachable through `inspect`, and a function's globals and closures (the imports, constants and
    helpers it uses) are the whole main program, which re-running in every worker would do again whatever
    else it does. A module (a .py file) is imported by the workers and hashed into the completion record.
    In a torchrun job every rank runs this same program, so `__main__` is the same on every rank.
    """
    if nproc <= 1 or mapper is None or not hasattr(mapper, "leaves"):
        return []
    problems: list[str] = []
    seen: set[str] = set()
    for leaf in mapper.leaves():
        if not isinstance(leaf, Function):
            continue
        for reference in (leaf.fn, leaf.infer):
            if not reference or reference in seen:
                continue
            seen.add(reference)
            module_name, _, attribute = reference.partition(":")
            if module_name.partition(".")[0] in MAIN_MODULES:
                if _in_a_torchrun_job():
                    continue
                main = _main_name()
                hint = (f" (this program runs as {main!r}: name it '{main}:{attribute}')" if main else "")
                problems.append(
                    f"Cannot run Function {leaf.fn!r} on {nproc} ranks: {reference!r} is defined in the main program (a notebook "
                    "cell or the script being run), which the worker processes do not run, so they cannot find it. "
                    f"Define it in a module (a .py file importable by the workers){hint} and name it 'module:{attribute}', "
                    "or use nproc=1."
                )
            elif not _importable(module_name):
                problems.append(
                    f"Cannot run Function {leaf.fn!r} on {nproc} ranks: module {module_name!r} of {reference!r} cannot be found by "
                    "the import system, so the worker processes cannot import it. Define it in a module (a .py file "
                    "importable by the workers: installed, on PYTHONPATH, or beside the mapper file), or use nproc=1."
                )
    return problems
